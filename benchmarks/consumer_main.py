"""One consumer in its own process, reporting progress on stdout for the benchmark.

    python benchmarks/consumer_main.py MODE BOOTSTRAP PREFIX PARTITIONS APP_ID

MODE is ``trainguard`` (the real worker: ``create_app`` run by ``faust.Worker``),
``trainguard-agent`` (the same worker with its bulk lane off: events through Faust's agent),
``bare`` (a Faust agent with the same App settings that only decodes), or ``aiokafka``
(a plain aiokafka consumer and orjson decode: the physical limit of a Python consumer).

Lines on stdout (times are ``time.time()`` of this machine):

    F <t>                      the first event is about to be handled
    P <t_last> <events> <samples>  the time the latest event was done, and the counts so far

The trainguard worker is measured without touching its code: ``engine.handle`` (looked up
by the agent once per batch) is wrapped by a function that counts the event and stamps its
end time; the cost of the wrapper is one extra call and one clock read per event.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import orjson


def say(line: str) -> None:
    """Straight to the pipe: Faust's worker redirects ``sys.stdout`` into its log."""
    os.write(1, (line + "\n").encode())


class Meter:
    __slots__ = ("events", "first", "last", "samples", "shown")

    def __init__(self) -> None:
        self.first = None
        self.last = 0.0
        self.events = 0
        self.samples = 0
        self.shown = -1

    def show(self) -> None:
        if self.events != self.shown:
            self.shown = self.events
            say(f"P {self.last:.6f} {self.events} {self.samples}")


async def reporter(meter: Meter) -> None:
    while True:
        await asyncio.sleep(0.05)
        meter.show()


def app_settings(bootstrap: str, prefix: str, partitions: int):
    from trainguard.core.kafka import KafkaSettings, Topics

    return KafkaSettings(bootstrap=bootstrap, partitions=partitions, topics=Topics.with_prefix(prefix))


def run_trainguard(settings, app_id: str) -> None:
    import faust

    from trainguard.streams.app import create_app

    app = create_app(settings, app_id=app_id)
    engine = app.trainguard_engine
    meter = Meter()
    inner = engine.handle
    clock = time.time

    def handle(raw, partition=0, offset=-1, topic="", _inner=inner, _m=meter):
        if _m.first is None:
            _m.first = clock()
            say(f"F {_m.first:.6f}")
        out = _inner(raw, partition, offset, topic)
        _m.events += 1
        _m.last = clock()
        return out

    engine.handle = handle

    @app.task
    async def _report() -> None:
        while True:
            await asyncio.sleep(0.05)
            meter.samples = engine.samples
            meter.show()

    faust.Worker(app, loglevel="info", quiet=True).execute_from_commandline()


def run_bare(settings, app_id: str, batch_max: int = 1000, within: float = 0.02) -> None:
    """The same App settings as ``create_app`` (memory store, rebalance timeout, raw topic),
    and the same ``take_events`` batching, but the agent only decodes."""
    import faust

    from trainguard.streams.app import data_dir

    app = faust.App(
        app_id,
        broker=[f"kafka://{b}" for b in settings.bootstrap.split(",")],
        store="memory://",
        datadir=data_dir(app_id),
        topic_partitions=settings.partitions,
        topic_replication_factor=1,
        broker_rebalance_timeout=3.0,
        broker_session_timeout=10.0,
        broker_heartbeat_interval=1.0,
        consumer_auto_offset_reset="earliest",
        web_enabled=False,
        producer_acks=-1,
    )
    topic = app.topic(settings.topics.events, key_type=bytes, value_type=bytes, key_serializer="raw",
                      value_serializer="raw", partitions=settings.partitions)
    meter = Meter()
    clock = time.time

    @app.agent(topic)
    async def decode(stream):
        loads = orjson.loads
        async for batch in stream.take_events(batch_max, within=within):
            if meter.first is None:
                meter.first = clock()
                say(f"F {meter.first:.6f}")
            samples = 0
            for event in batch:
                samples += len(loads(event.message.value)["metrics"])
            meter.events += len(batch)
            meter.samples += samples
            meter.last = clock()

    @app.task
    async def _report() -> None:
        await reporter(meter)

    faust.Worker(app, loglevel="info", quiet=True).execute_from_commandline()


async def run_aiokafka(settings) -> None:
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(settings.topics.events, bootstrap_servers=settings.bootstrap, group_id=None,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    say("READY")
    meter = Meter()
    task = asyncio.get_running_loop().create_task(reporter(meter))
    loads = orjson.loads
    clock = time.time
    try:
        while True:
            batches = await consumer.getmany(timeout_ms=200)
            if not batches:
                continue
            if meter.first is None:
                meter.first = clock()
                say(f"F {meter.first:.6f}")
            for records in batches.values():
                samples = 0
                for r in records:
                    samples += len(loads(r.value)["metrics"])
                meter.events += len(records)
                meter.samples += samples
            meter.last = clock()
    finally:
        task.cancel()
        await consumer.stop()


def main(argv: list[str]) -> int:
    mode, bootstrap, prefix, partitions, app_id = argv[:5]
    settings = app_settings(bootstrap, prefix, int(partitions))
    if mode == "trainguard":
        run_trainguard(settings, app_id)
    elif mode == "trainguard-agent":  # the worker without its bulk lane: Faust's per-message path
        os.environ["TRAINGUARD_BULK_LANE"] = "0"
        run_trainguard(settings, app_id)
    elif mode == "bare":
        run_bare(settings, app_id)
    elif mode == "aiokafka":
        asyncio.run(run_aiokafka(settings))
    else:
        print(f"unknown mode {mode}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

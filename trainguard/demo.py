"""``trainguard demo``: the whole loop on one machine, live.

Starts the embedded broker and a stream worker, then runs a simulated PPO trainer that
publishes verl's metrics and node metrics, saves checkpoints, and suffers a fault. The
console shows healthy steps, the alerts, the rollback command, the trainer's ack and the
healthy steps after the rollback, then a summary and one JSON line. Ctrl-C at any
moment stops everything it started.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import orjson

from trainguard.core import settings as settings_mod
from trainguard.core.kafka import KafkaSettings

CHECKPOINT_EVERY = 20


class TimeOrdered:
    """Shows lines from three topics and the trainer's thread in time order: each waits
    ``hold_s`` for anything older still in flight (a report arrives after the ack it precedes)."""

    def __init__(self, hold_s: float = 0.4):
        self.hold_s = hold_s
        self._heap: list = []
        self._lock = threading.Lock()
        self._seq = itertools.count()

    def put(self, ts: float, show) -> None:
        with self._lock:
            heapq.heappush(self._heap, (ts, next(self._seq), time.monotonic(), show))

    def say(self, text: str) -> None:
        self.put(time.time(), lambda: print(text, flush=True))

    def release(self, everything: bool = False) -> None:
        due = []
        with self._lock:
            now = time.monotonic()
            while self._heap and (everything or now - self._heap[0][2] >= self.hold_s):
                due.append(heapq.heappop(self._heap))
        for _, _, _, show in due:
            show()


class Watcher(threading.Thread):
    """Follows the alerts, control and acks topics and hands every event of the run to the
    sinks, in time order with the trainer's own lines."""

    def __init__(self, settings: KafkaSettings, run_id: str, sinks: list, ordered: TimeOrdered):
        super().__init__(name="trainguard-demo-watcher", daemon=True)
        self.settings, self.run_id, self.sinks, self.ordered = settings, run_id, sinks, ordered
        self.alerts = 0
        self.commands: list[str] = []
        self.acks: dict[str, int] = {}
        self.stop = threading.Event()
        self.ready = threading.Event()

    def run(self) -> None:
        from trainguard.core.reader import topic_reader
        from trainguard.schemas import events as ev

        t = self.settings.topics
        consumer, _missing = topic_reader(self.settings, (t.alerts, t.control, t.acks))
        self.ready.set()
        try:
            while not self.stop.is_set():
                self.ordered.release()
                msg = consumer.poll(0.1)
                if msg is None or msg.error():
                    continue
                try:
                    event = ev.decode(msg.value())
                except ev.SchemaError:
                    continue
                if event.get("run_id") != self.run_id:
                    continue
                kind = event["schema"]
                if kind == ev.ALERT and event["status"] == "firing":
                    self.alerts += 1
                elif kind == ev.COMMAND:
                    self.commands.append(event["action"])
                elif kind == ev.ACK:
                    self.acks[event["status"]] = self.acks.get(event["status"], 0) + 1
                when = event.get("ts") or event.get("issued") or time.time()  # commands carry `issued`
                self.ordered.put(when, functools.partial(self._deliver, event))
        finally:
            consumer.close()

    def _deliver(self, event: dict) -> None:
        for sink in self.sinks:
            sink.deliver([event])


def _start_worker(bootstrap: str, log_path: Path) -> subprocess.Popen:
    env = {**os.environ, "TRAINGUARD_BOOTSTRAP": bootstrap}
    out = open(log_path, "wb")
    return subprocess.Popen([sys.executable, "-m", "trainguard.cli", "worker", "--bootstrap", bootstrap],
                            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            start_new_session=True)


def run_trainer(settings: KafkaSettings, run_id: str, *, fault: str, fault_step: int, steps: int,
                step_seconds: float, say=print, deadline_s: float = 120.0) -> dict:
    """The simulated trainer: log, checkpoint, obey commands at step boundaries."""
    from trainguard.producers.control import ControlListener
    from trainguard.producers.trainer import TrainerLogger
    from trainguard.simulator import SimulatedPPO

    sim = SimulatedPPO(seed=7)
    sim.inject(fault, at_step=fault_step)
    logger = TrainerLogger(run_id, settings, host=sim.host)
    node = TrainerLogger(run_id, settings, host=sim.host, rank=None, kind="node", publisher=logger.publisher)
    listener = ControlListener(run_id, settings, publisher=logger.publisher).start()
    listener.wait_ready(10)
    logger.lifecycle("started", step=0)
    result = {"rollbacks": 0, "steps_after_rollback": 0, "stopped": False, "steps_run": 0}
    started = time.monotonic()

    def apply(command: dict) -> str:
        if command["action"] == "rollback":
            target = command["target"]["step"]
            sim.restore(target)
            logger.lifecycle("rolled_back", step=target, detail={"command_id": command["id"]})
            result["rollbacks"] += 1
            result["steps_after_rollback"] = 0
            say(f"trainer: rolled back to step {target} ({command['target']['path']})")
            return f"restored {command['target']['path']}"
        if command["action"] == "stop":
            result["stopped"] = True
            say("trainer: stopping on command")
            return "stopping at the next step boundary"
        return f"{command['action']} noted"

    try:
        while sim.current_step < steps and not result["stopped"]:
            if time.monotonic() - started > deadline_s:
                say("trainer: demo deadline reached")
                break
            metrics = sim.step()
            if metrics is None:  # a hung trainer publishes nothing, and takes no command
                time.sleep(step_seconds)
                continue
            step = sim.current_step
            logger.log(metrics, step)
            node.log(sim.node_metrics(), step)
            if step % CHECKPOINT_EVERY == 0:
                logger.checkpoint_saved(step, sim.save_checkpoint())
            result["steps_run"] += 1
            if result["rollbacks"]:
                result["steps_after_rollback"] += 1
            if step % 10 == 0:
                say(f"step {step:4d}  kl={metrics['actor/kl_loss']:.4f}  score={metrics['critic/score/mean']:.3f}  "
                    f"entropy={metrics['actor/entropy']:.3f}  latency={metrics['rollout/latency_ms']:.0f}ms")
            listener.dispatch(apply, step=step)
            time.sleep(step_seconds)
        logger.lifecycle("stopped" if result["stopped"] else "finished", step=sim.current_step)
    finally:
        listener.close()
        logger.close()
    return result


def main(args) -> int:
    from trainguard.broker import BrokerError, kafka_or_embedded, stop_process
    from trainguard.sinks.console import ConsoleSink
    from trainguard.sinks.jsonl import JsonlSink
    from trainguard.sinks.report_files import ReportSink

    started = time.time()
    out_dir = Path(args.jsonl).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    run_id = f"demo-{time.strftime('%H%M%S')}-{uuid.uuid4().hex[:4]}"
    broker = worker = watcher = None

    def _terminate(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    from trainguard.schemas.signing import ensure_key

    ensure_key("demo")
    try:
        settings, broker = kafka_or_embedded(args.bootstrap, out_dir / "demo-broker.log")
        print(f"demo: broker at {settings.bootstrap}; run {run_id}; fault {args.fault} at step {args.fault_step}",
              flush=True)
        worker = _start_worker(settings.bootstrap, out_dir / "demo-worker.log")
        reports = ReportSink(out_dir / "reports")
        ordered = TimeOrdered()
        watcher = Watcher(settings, run_id, [ConsoleSink(), JsonlSink(args.jsonl), reports], ordered)
        watcher.start()
        watcher.ready.wait(15)
        result = run_trainer(settings, run_id, fault=args.fault, fault_step=args.fault_step, steps=args.steps,
                             step_seconds=args.step_seconds, say=ordered.say)
        time.sleep(1.0)  # let the last alerts and acks arrive
        if worker.poll() is not None:
            print(f"demo: the worker exited early (status {worker.returncode}); see {out_dir / 'demo-worker.log'}",
                  file=sys.stderr)
    except BrokerError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ndemo: interrupted; stopping everything it started.", file=sys.stderr)
        return 130
    finally:
        if watcher is not None:
            watcher.stop.set()
            watcher.join(5)
            watcher.ordered.release(everything=True)
        stop_process(worker)
        if broker is not None:
            broker.stop()

    summary = {"alerts": watcher.alerts, "commands": watcher.commands, "acks": watcher.acks,
               "steps_after_rollback": result["steps_after_rollback"], "seconds": round(time.time() - started, 1)}
    setup_started = settings_mod.value("TRAINGUARD_DEMO_SETUP_STARTED")  # `make demo`: its setup counts too
    if setup_started and setup_started.isdigit():
        summary["seconds_with_setup"] = round(time.time() - int(setup_started))
    print(f"\ndemo summary: {summary['alerts']} alerts, commands {summary['commands']}, acks {summary['acks']}, "
          f"{result['rollbacks']} rollback(s), {summary['steps_after_rollback']} healthy steps after the rollback, "
          f"{summary['seconds']} s"
          + (f" ({summary['seconds_with_setup']} s with the setup)" if "seconds_with_setup" in summary else "")
          + f". Alerts, commands and acks are in {args.jsonl}; diagnosis reports (text, and HTML with plots) in "
          f"{out_dir / 'reports' / run_id}.")
    print(orjson.dumps(summary).decode(), flush=True)
    ok = watcher.alerts > 0 and "rollback" in watcher.commands and watcher.acks.get("applied", 0) > 0 \
        and result["steps_after_rollback"] > 20
    return 0 if ok else 1

"""``trainguard tail``: follow alerts, commands and acks live, one coloured line each.

Reads the alerts, control and acks topics without a consumer group: every partition is
assigned from the chosen end (``--from end``, the default, shows what happens from now on;
``--from beginning`` shows the history first). Nothing is committed, so any number of
people can tail the same cluster without disturbing the sinks' group. Runs until Ctrl-C
(or SIGTERM). When nothing arrives, a status line says what it is waiting on (on a terminal;
otherwise it is said once, on stderr).

Each record is decoded for the topic it came from; an invalid one is skipped, the first of each
cause said on stderr and the count at the end. Strings from the topics are printed without
their control characters and escape sequences (``trainguard.terminal``).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import TextIO

from trainguard.core.kafka import KafkaSettings
from trainguard.core.reader import TopicDecoder, topic_reader

TOPICS = ("alerts", "control", "acks")


def tail(settings: KafkaSettings, *, start: str = "end", run: str | None = None, detail: bool = False,
         as_json: bool = False, stop: threading.Event | None = None, stdout: TextIO | None = None,
         stderr: TextIO | None = None, topics=TOPICS, idle_s: float = 2.0) -> int:
    """Print every alert, command and ack (of ``run``, or all) until ``stop`` is set: one
    coloured line each, or with ``as_json`` the events themselves, one JSON object a line
    (for ``jq`` and scripts; status then goes to stderr only)."""
    import orjson
    from confluent_kafka import KafkaError, KafkaException

    from trainguard.sinks.console import ConsoleSink
    from trainguard.terminal import safe_event, safe_json

    if start not in ("beginning", "end"):
        raise ValueError(f"start must be 'beginning' or 'end', not {start!r}")
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    stop = stop or threading.Event()
    console = ConsoleSink(stdout, detail=detail)
    status_on_tty = _isatty(stdout) and not as_json
    names = [getattr(settings.topics, t) if hasattr(settings.topics, t) else t for t in topics]
    decoder = TopicDecoder(settings.topics, "trainguard tail", report=lambda m: print(m, file=stderr, flush=True))

    try:
        consumer, missing = topic_reader(settings, names, start=start)
    except KafkaException as exc:
        print(f"trainguard tail: cannot reach Kafka at {settings.bootstrap}: {exc}", file=stderr)
        return 2
    try:
        if len(missing) == len(names):
            print(f"trainguard tail: none of the topics {', '.join(names)} exist on {settings.bootstrap}",
                  file=stderr)
            return 2
        if missing:
            print(f"trainguard tail: not following {', '.join(missing)} (no such topic)", file=stderr)
        waiting = f"waiting for alerts on {settings.bootstrap} ({', '.join(n for n in names if n not in missing)})" \
                  + (f" for run {run}" if run else "") + " ... Ctrl-C to stop"
        if not status_on_tty:
            print(waiting, file=stderr, flush=True)
        status_shown = False
        last_event = time.monotonic()
        shown = 0
        failures: set[str] = set()
        while not stop.is_set():
            try:
                messages = consumer.consume(num_messages=500, timeout=0.5)
            except KafkaException as exc:  # the client's own trouble: say it once per kind, keep following
                if str(exc) not in failures:
                    failures.add(str(exc))
                    print(f"trainguard tail: reading failed ({exc}); retrying", file=stderr, flush=True)
                stop.wait(1.0)
                continue
            lines = []
            for msg in messages:
                if msg.error():
                    if msg.error().code() != KafkaError._PARTITION_EOF:
                        print(f"trainguard tail: consumer error: {msg.error()}", file=stderr)
                    continue
                decoded = decoder.decode(msg.topic(), msg.value())
                if decoded is None or decoded[1] is None:
                    continue
                event = decoded[1]
                if run is not None and event["run_id"] != run:
                    continue
                try:  # every string from the topic made terminal-safe; the JSON keeps its meaning
                    lines.append(safe_json(orjson.dumps(event).decode()) if as_json
                                 else console.format(safe_event(event)))
                except Exception as exc:  # a valid event of a shape the line cannot show: count it, go on
                    decoder.skip(f"{decoded[0]}: not shown ({type(exc).__name__})",
                                 f"{msg.topic()}[{msg.partition()}]@{msg.offset()}: {exc!r}")
            if lines:
                if status_shown:
                    stdout.write("\r\033[K")
                    status_shown = False
                stdout.write("".join(line + "\n" for line in lines))
                stdout.flush()
                shown += len(lines)
                last_event = time.monotonic()
            elif status_on_tty and not status_shown and time.monotonic() - last_event >= idle_s:
                skipped = f" ({decoder.skipped} invalid record(s) skipped)" if decoder.skipped else ""
                stdout.write(f"\r\033[2m{waiting}{skipped}\033[0m")
                stdout.flush()
                status_shown = True
        if status_shown:
            stdout.write("\r\033[K")
            stdout.flush()
        if decoder.skipped:
            print(f"trainguard tail: {decoder.summary()}", file=stderr)
    finally:
        consumer.close()
    return 0


def main(args) -> int:
    """``trainguard tail`` (args from the CLI's parser)."""
    settings = KafkaSettings.from_env(bootstrap=getattr(args, "bootstrap", None))
    stop = threading.Event()
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        return tail(settings, start=args.start, run=args.run, detail=args.detail,
                    as_json=getattr(args, "json", False), stop=stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False

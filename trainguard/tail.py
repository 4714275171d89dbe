"""``trainguard tail``: follow alerts, commands and acks live, one coloured line each.

Reads the alerts, control and acks topics without a consumer group: every partition is
assigned from the chosen end (``--from end``, the default, shows what happens from now on;
``--from beginning`` shows the history first). Nothing is committed, so any number of
people can tail the same cluster without disturbing the sinks' group. Lines come in the order
the records were published (their timestamps), whatever topic they are on: the history is read
to its end and sorted before it is printed; live, each record waits ``REORDER_S`` for one
published before it on another topic (an ack read before its command). Runs until Ctrl-C
(or SIGTERM). When nothing arrives, a status line says what it is waiting on (on a terminal;
otherwise it is said once, on stderr).

A broker outage is said on stderr in one line when it begins and one when tail reconnects; a
broker that came back empty (memory storage) or topics created again are read from their new
beginning, so the next run's alerts are not missed (``LiveReader``).

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
from trainguard.core.reader import LiveReader, TopicDecoder

TOPICS = ("alerts", "control", "acks")

# Live, a record waits this long for one published before it on another topic (an ack read
# before its command). Reading the history, everything is sorted.
REORDER_S = 1.0
# Reading the history: nothing more for this long ends it even short of the ends (a gap left
# by a transaction marker at a partition's end).
BACKLOG_STALL_S = 3.0
# Causes before effects when two records share a millisecond.
_ROLE_ORDER = {"alerts": 0, "control": 1, "acks": 2}


def _order_key(msg, event: dict, role: str) -> tuple:
    """When the record was published (its timestamp; the event's own time when it has none),
    then alert before command before ack, then where it lies."""
    kind, ms = msg.timestamp()
    if kind == 0 or ms is None or ms < 0:  # TIMESTAMP_NOT_AVAILABLE
        ms = int(1000 * (event.get("ts") or event.get("issued") or 0))
    return ms, _ROLE_ORDER.get(role, 3), msg.topic(), msg.partition(), msg.offset()


class Reorder:
    """Lines held back until ``reorder_s`` after they arrived, released in the order of their
    keys: when one is due, every line with a smaller key goes out before it."""

    def __init__(self, reorder_s: float):
        self.reorder_s = reorder_s
        self._held: list[tuple[tuple, float, str]] = []

    def __bool__(self) -> bool:
        return bool(self._held)

    def add(self, key: tuple, line: str) -> None:
        self._held.append((key, time.monotonic(), line))

    def take(self, everything: bool = False) -> list[str]:
        if not self._held:
            return []
        if everything:
            out, self._held = sorted(self._held), []
            return [line for _, _, line in out]
        now = time.monotonic()
        due = [key for key, arrived, _ in self._held if now - arrived >= self.reorder_s]
        if not due:
            return []
        cutoff = max(due)
        out = sorted(h for h in self._held if h[0] <= cutoff)
        self._held = [h for h in self._held if h[0] > cutoff]
        return [line for _, _, line in out]


def partition_ends(consumer) -> dict[tuple[str, int], int]:
    """The current end of every assigned partition that holds anything."""
    ends = {}
    for tp in consumer.assignment():
        low, high = consumer.get_watermark_offsets(tp, timeout=10)
        if high > low:
            ends[(tp.topic, tp.partition)] = high
    return ends


def tail(settings: KafkaSettings, *, start: str = "end", run: str | None = None, detail: bool = False,
         as_json: bool = False, stop: threading.Event | None = None, stdout: TextIO | None = None,
         stderr: TextIO | None = None, topics=TOPICS, idle_s: float = 2.0,
         reorder_s: float = REORDER_S) -> int:
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
        reader = LiveReader(settings, names, start=start, who="trainguard tail",
                            say=lambda m: print(m, file=stderr, flush=True))
    except KafkaException as exc:
        print(f"trainguard tail: cannot reach Kafka at {settings.bootstrap}: {exc}", file=stderr)
        return 2
    consumer, missing = reader.consumer, reader.missing
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
        failures: set[str] = set()
        # History (--from beginning) is read up to the ends fixed now, then printed fully in order;
        # what comes after waits reorder_s in a buffer so that a fast ack follows its command.
        backlog = partition_ends(consumer) if start == "beginning" else {}
        history = bool(backlog)
        buffer = Reorder(reorder_s)
        quiet_since = time.monotonic()
        while not stop.is_set():
            try:
                messages = reader.consume(num_messages=500, timeout=0.5)
            except KafkaException as exc:  # the client's own trouble: say it once per kind, keep following
                if str(exc) not in failures:
                    failures.add(str(exc))
                    print(f"trainguard tail: reading failed ({exc}); retrying", file=stderr, flush=True)
                stop.wait(1.0)
                continue
            for msg in messages:
                if msg.error():
                    if msg.error().code() != KafkaError._PARTITION_EOF:
                        print(f"trainguard tail: consumer error: {msg.error()}", file=stderr)
                    continue
                if msg.offset() + 1 >= backlog.get((msg.topic(), msg.partition()), 0):
                    backlog.pop((msg.topic(), msg.partition()), None)
                decoded = decoder.decode(msg.topic(), msg.value())
                if decoded is None or decoded[1] is None:
                    continue
                event = decoded[1]
                if run is not None and event["run_id"] != run:
                    continue
                try:  # every string from the topic made terminal-safe; the JSON keeps its meaning
                    line = (safe_json(orjson.dumps(event).decode()) if as_json
                            else console.format(safe_event(event)))
                except Exception as exc:  # a valid event of a shape the line cannot show: count it, go on
                    decoder.skip(f"{decoded[0]}: not shown ({type(exc).__name__})",
                                 f"{msg.topic()}[{msg.partition()}]@{msg.offset()}: {exc!r}")
                    continue
                buffer.add(_order_key(msg, event, decoded[0]), line)
            if messages:
                quiet_since = time.monotonic()
            if history and backlog and time.monotonic() - quiet_since < BACKLOG_STALL_S:
                continue  # the history is not all read yet: print none of it out of order
            lines = buffer.take(everything=history)
            history = False
            if lines:
                status_shown = _write(stdout, lines, status_shown)
                last_event = time.monotonic()
            elif status_on_tty and not status_shown and not buffer and time.monotonic() - last_event >= idle_s:
                skipped = f" ({decoder.skipped} invalid record(s) skipped)" if decoder.skipped else ""
                stdout.write(f"\r\033[2m{waiting}{skipped}\033[0m")
                stdout.flush()
                status_shown = True
        # Stopped: what is held back goes out, in order, and the status line is cleared.
        _write(stdout, buffer.take(everything=True), status_shown)
        if decoder.skipped:
            print(f"trainguard tail: {decoder.summary()}", file=stderr)
    finally:
        reader.close()
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


def _write(stdout, lines: list[str], status_shown: bool) -> bool:
    """``lines`` over the status line (cleared first when shown); False: no status line now."""
    if status_shown:
        stdout.write("\r\033[K")
    stdout.write("".join(line + "\n" for line in lines))
    stdout.flush()
    return False


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False

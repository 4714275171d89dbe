"""``trainguard dlq``: what the workers rejected, why, from whom and when.

The worker sends every record it cannot use to the dead-letter topic with the reason, where it
was read (topic, partition, offset), its size and sha256, and its bytes (``dlq/1``, see
``Engine.dead_letter``). This prints one line per dead letter, oldest first: when, the run and
the producer (read from the rejected record where it is JSON enough to say), where it came from,
and the reason. It reads the topic to its current end and exits; ``--follow`` keeps printing
new ones until Ctrl-C. Everything shown was written by whoever wrote the rejected record, so
every string is made terminal-safe (``trainguard.terminal``); ``--json`` prints the records.
"""

from __future__ import annotations

import re
import signal
import sys
import threading
import time
from typing import TextIO

from trainguard.core.clock import local_time
from trainguard.core.kafka import KafkaSettings
from trainguard.core.reader import LiveReader
from trainguard.tail import REORDER_S, Reorder, partition_ends

EXCERPT_CHARS = 120
# A rejected record cut short is no JSON: its run and producer are still read from its text.
_FIELD = {name: re.compile(rf'"{name}"\s*:\s*"((?:[^"\\]|\\.){{0,200}})"') for name in ("run_id", "kind", "host")}
_RANK = re.compile(r'"rank"\s*:\s*(-?\d{1,6})')
_SCHEMA = re.compile(r'"schema"\s*:\s*"([^"]{0,40})"')


def check_record(record) -> str | None:
    """Why ``record`` (decoded JSON) is no dead letter this release can show, or None."""
    if not isinstance(record, dict) or record.get("schema") != "dlq/1":
        return "not a dlq/1 record"
    if not isinstance(record.get("reason"), str):
        return "no reason"
    if type(record.get("ts")) not in (int, float):
        return "no time"
    return None


def origin(record: dict) -> dict:
    """Run, producer (kind, host, rank) and schema of the rejected record, as far as its text
    tells (a field it does not name is absent)."""
    import orjson

    text = record.get("raw_text")
    if not isinstance(text, str):
        return {}
    found: dict = {}
    try:
        event = orjson.loads(text)
    except orjson.JSONDecodeError:
        event = None
    if isinstance(event, dict):
        source: dict = event["source"] if isinstance(event.get("source"), dict) else {}
        for key, value in (("run_id", event.get("run_id")), ("schema", event.get("schema")),
                           ("kind", source.get("kind")), ("host", source.get("host")),
                           ("rank", source.get("rank"))):
            if isinstance(value, (str, int)) and not isinstance(value, bool):
                found[key] = value
        return found
    for key, pattern in _FIELD.items():
        match = pattern.search(text)
        if match:
            found[key] = match.group(1)
    for key, pattern in (("rank", _RANK), ("schema", _SCHEMA)):
        match = pattern.search(text)
        if match:
            found[key] = int(match.group(1)) if key == "rank" else match.group(1)
    return found


def format_record(record: dict) -> str:
    """One line: when, run, producer, where it was read, size and schema, reason, an excerpt."""
    from trainguard.terminal import safe

    seen = origin(record)
    when = local_time(record.get("ts"))
    producer = seen.get("kind") or "?"
    if seen.get("host"):
        producer += f"@{seen['host']}"
    if seen.get("rank") is not None:
        producer += f" rank {seen['rank']}"
    where = f"{record.get('topic') or '?'}[{record.get('partition', '?')}]@{record.get('offset', '?')}"
    size = record.get("size")
    size = f"{size} B" if type(size) is int else "? B"
    schema = f" {seen['schema']}" if seen.get("schema") else ""
    text = record.get("raw_text")
    excerpt = (f"  raw: {text[:EXCERPT_CHARS]}{'...' if len(text) > EXCERPT_CHARS else ''}"
               if isinstance(text, str) else "  raw: (binary; --json has it in base64)")
    return safe(f"{when}  run={seen.get('run_id', '?')}  from {producer}  {where}  {size}{schema}  "
                f"{record['reason']}{excerpt}")


def dlq(settings: KafkaSettings, *, follow: bool = False, run: str | None = None, as_json: bool = False,
        stop: threading.Event | None = None, stdout: TextIO | None = None, stderr: TextIO | None = None,
        reorder_s: float = REORDER_S) -> int:
    """Print the dead letters (of ``run``, or all), oldest first, up to the topic's end, and
    with ``follow`` the ones that come after until ``stop`` is set. Exit status 2 when the
    topic cannot be read."""
    import orjson
    from confluent_kafka import KafkaException

    from trainguard.terminal import safe, safe_json

    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    stop = stop or threading.Event()
    topic = settings.topics.dlq
    try:
        # followed across outages; a topic that comes back empty is read from its new beginning
        reader = LiveReader(settings, [topic], start="beginning", who="trainguard dlq",
                            say=lambda line: print(line, file=stderr, flush=True))
    except KafkaException as exc:
        print(f"trainguard dlq: cannot read {topic} on {settings.bootstrap}: {exc}", file=stderr)
        return 2
    consumer, missing = reader.consumer, reader.missing
    shown, skipped, causes = 0, 0, set()
    try:
        if missing:
            print(f"trainguard dlq: no topic {topic} on {settings.bootstrap} (`trainguard broker` or the compose "
                  f"stack's topics job creates it)", file=stderr)
            return 2
        ends = partition_ends(consumer)
        history = True  # up to the ends fixed now: printed sorted, all at once
        buffer = Reorder(reorder_s)
        quiet_since = time.monotonic()
        if follow:
            print(f"following dead letters on {settings.bootstrap} ({topic}) ... Ctrl-C to stop", file=stderr,
                  flush=True)
        while not stop.is_set():
            messages = reader.consume(num_messages=500, timeout=0.5)
            for msg in messages:
                if msg.error():
                    continue
                if msg.offset() + 1 >= ends.get((msg.topic(), msg.partition()), 0):
                    ends.pop((msg.topic(), msg.partition()), None)
                try:
                    record = orjson.loads(msg.value() or b"")
                except orjson.JSONDecodeError:
                    record = None
                cause = check_record(record)
                if cause is not None:
                    skipped += 1
                    if cause not in causes:
                        causes.add(cause)
                        print(f"trainguard dlq: skipping {msg.topic()}[{msg.partition()}]@{msg.offset()} "
                              f"({cause}); further ones are counted", file=stderr, flush=True)
                    continue
                if run is not None and origin(record).get("run_id") != run:
                    continue
                try:
                    line = safe_json(orjson.dumps(record).decode()) if as_json else format_record(record)
                except Exception as exc:  # valid, but of a shape the line cannot show: counted
                    skipped += 1
                    print(f"trainguard dlq: cannot show {msg.topic()}[{msg.partition()}]@{msg.offset()} "
                          f"({type(exc).__name__})", file=stderr)
                    continue
                kind, ms = msg.timestamp()
                buffer.add((ms if kind and ms >= 0 else int(record["ts"] * 1000), msg.partition(), msg.offset()),
                           line)
            if messages:
                quiet_since = time.monotonic()
            if history and ends and time.monotonic() - quiet_since < 3.0:
                continue  # the history is not all read yet
            lines = buffer.take(everything=history)
            if lines:
                stdout.write("".join(line + "\n" for line in lines))
                stdout.flush()
                shown += len(lines)
            if history and not follow:
                break
            history = False
        rest = buffer.take(everything=True)
        if rest:
            stdout.write("".join(line + "\n" for line in rest))
            stdout.flush()
            shown += len(rest)
    finally:
        reader.close()
    whose = f" of run {safe(run)}" if run else ""
    if not follow:
        print(f"{shown} dead letter(s){whose} on {topic}" + (f"; {skipped} record(s) skipped" if skipped else ""),
              file=stderr)
    elif skipped:
        print(f"trainguard dlq: {skipped} record(s) skipped", file=stderr)
    return 0


def main(args) -> int:
    """``trainguard dlq`` (args from the CLI's parser)."""
    settings = KafkaSettings.from_env(bootstrap=getattr(args, "bootstrap", None))
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return dlq(settings, follow=args.follow, run=args.run, as_json=args.json, stop=stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

"""``trainguard replay``: run a recorded run through the same engine and rules, offline.

A file any of :mod:`trainguard.readers` reads (JSON lines, CSV, ``trainer_state.json``,
TensorBoard event files, verl and Hugging Face / TRL console logs) becomes a stream of trainer metric events; the
:class:`~trainguard.streams.engine.Engine` the worker uses judges them with the same rules
file, and the circuit breaker's commands are recorded as what it *would* have sent. No Kafka.

Recorded files carry no event time, so each step gets a synthetic one, ``STEP_SECONDS``
apart (what the breaker's command expiry is measured in). Checkpoints are known where the
file says so: verl logs print ``local_global_step_folder: .../global_step_N`` when they save,
dumps of the events topic hold ``checkpoint/1`` events, and ``--checkpoint STEP`` adds more.
A checkpoint enters the replay just before the first step after it, as in the live run.

    result = replay("run.log")                  # ReplayResult
    result.alerts, result.commands, result.steps, result.skipped

``main(args)`` is the CLI: a table of alerts (or ``--json``: one object per alert line,
nothing else on stdout), a summary, a progress line on stderr when stderr is a terminal.
Exit code 0 when the file was replayed (alerts or not), 2 when it could not be read (no step
read from it at all included: the message lists the formats replay reads) or the rules file is
invalid.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, TextIO

import orjson

from trainguard.readers import ReadError, StepReader, formats_read, open_reader
from trainguard.schemas import events as ev
from trainguard.streams.policy import skipping
from trainguard.streams.signals import recognise

STEP_SECONDS = 60.0
"""Synthetic time between two replayed steps (a typical RL step; command expiry counts in it)."""

REPLAY_HOST = "replay"
# The path after the marker, then the first global_step_N within it; two linear searches (one
# lazy regex over both retried from every marker of a crafted line and took quadratic time).
_VERL_CHECKPOINT = re.compile(rb"local_global_step_folder:\s*(\S*)")
_GLOBAL_STEP = re.compile(rb"global_step_(\d+)")


@dataclass
class ReplayResult:
    path: str
    format: str
    run_id: str
    steps: int = 0
    skipped: int = 0
    bad_values: int = 0
    names_too_long: int = 0   # metric names past the schema's length, left out
    over_cap: int = 0         # metrics past the schema's per-event count, left out
    ignored: int = 0
    problems: list[str] = field(default_factory=list)
    alerts: list[dict] = field(default_factory=list)
    commands: list[dict] = field(default_factory=list)
    command_steps: list[int] = field(default_factory=list)  # the step each command came at
    checkpoints: list[dict] = field(default_factory=list)
    first_step: int | None = None
    last_step: int | None = None
    elapsed_s: float = 0.0
    framework: str | None = None                         # recognised from the metric names
    metrics: list[str] = field(default_factory=list)    # every name the file logged, first seen first
    unwatched: list[str] = field(default_factory=list)  # names no rule judges
    by_pattern: list[str] = field(default_factory=list)  # names judged by their name pattern alone
    inferred: dict[str, str] = field(default_factory=dict)  # name -> the signal its words suggest
    consecutive_critical: int = 3                        # the breaker's policy in the rules replayed
    breaker_rules: list[str] = field(default_factory=list)  # the rules the breaker acts on

    def alerts_by_rule(self) -> dict[str, dict[str, int]]:
        """``{rule: {"firing": n, "resolved": m}}`` in order of first appearance."""
        out: dict[str, dict[str, int]] = {}
        for a in self.alerts:
            counts = out.setdefault(a["rule"], {"firing": 0, "resolved": 0})
            counts[a["status"]] = counts.get(a["status"], 0) + 1
        return out


# --------------------------------------------------------------------------- checkpoints


def find_checkpoints(path: str, fmt: str) -> list[dict]:
    """Checkpoints a recording mentions: ``[{"step", "path"}]`` in file order (may be empty).

    verl logs: ``local_global_step_folder: <dir>/global_step_N``; JSON lines dumps of the
    events topic: ``checkpoint/1`` events; a trainer_state.json: the ``checkpoint-N`` folders of
    its Trainer's output directory. Other formats record none."""
    if fmt == "hf":
        from trainguard.producers.guards.checkpoint import checkpoint_folders

        return [{"step": step, "path": str(folder)}
                for step, folder in sorted(checkpoint_folders(trainer_output_dir(path)))]
    if fmt not in ("verl", "jsonl") or os.path.isdir(path):
        return []
    from trainguard.readers.base import capped_lines, open_binary

    found: list[dict] = []
    seen: set[int] = set()
    try:
        with open_binary(path) as f:
            for line in capped_lines(f):
                if line is None:
                    continue  # counted by the replay pass
                if fmt == "verl":
                    if b"global_step_" not in line:
                        continue
                    hit = _verl_checkpoint(line)
                    if hit is None:
                        continue
                    step, where = hit
                else:
                    if b'"checkpoint/1"' not in line:
                        continue
                    try:
                        event = ev.decode(line.strip(), expect=(ev.CHECKPOINT,))
                    except ev.SchemaError:
                        continue
                    step, where = event["step"], event["path"]
                if step not in seen:
                    seen.add(step)
                    found.append({"step": step, "path": where})
    except OSError:
        return found  # the replay pass reports read errors with their context
    return found


def _verl_checkpoint(line: bytes) -> tuple[int, str] | None:
    """``(step, path)`` of verl's ``local_global_step_folder: <dir>/global_step_N`` in ``line``."""
    pos = 0
    while (m := _VERL_CHECKPOINT.search(line, pos)) is not None:
        token = m.group(1)
        s = _GLOBAL_STEP.search(token)
        if s is not None:
            if len(s.group(1)) > 18:  # not a step; int() of thousands of digits is refused anyway
                return None
            return int(s.group(1)), token[:s.end()].decode("utf-8", "replace")
        # A later marker inside this token sees a suffix of it, which holds no step either.
        pos = max(m.end(), m.start() + 1)
    return None


def _within_schema(metrics: dict[str, float], result: "ReplayResult") -> dict[str, float]:
    """``metrics`` as the events schema lets one event carry them: names of 1..MAX_NAME_LEN
    characters, at most MAX_METRICS_PER_EVENT (the first ones); what is left out is counted."""
    if len(metrics) <= ev.MAX_METRICS_PER_EVENT and all(0 < len(n) <= ev.MAX_NAME_LEN for n in metrics):
        return metrics
    kept: dict[str, float] = {}
    for name, value in metrics.items():
        if not 0 < len(name) <= ev.MAX_NAME_LEN:
            result.names_too_long += 1
        elif len(kept) < ev.MAX_METRICS_PER_EVENT:
            kept[name] = value
        else:
            result.over_cap += 1
    return kept


def parse_checkpoint_arg(text: str) -> dict:
    """``STEP`` or ``STEP:PATH`` (``--checkpoint``)."""
    step, _, where = text.partition(":")
    try:
        n = int(step)
    except ValueError:
        raise ValueError(f"--checkpoint expects STEP or STEP:PATH, got {text!r}") from None
    if n < 0:
        raise ValueError(f"--checkpoint step must be >= 0, got {n}")
    return {"step": n, "path": where or f"global_step_{n}"}


# --------------------------------------------------------------------------- the replay


def replay(path: str | os.PathLike, *, rules=None, fmt: str | None = None, run_id: str | None = None,
           checkpoints: Iterable[dict] | None = None, find_file_checkpoints: bool = True,
           on_step: Callable[[StepReader], None] | None = None,
           on_output: Callable[[int, object], None] | None = None) -> ReplayResult:
    """Replay ``path`` through a fresh :class:`Engine`.

    ``rules``: a RuleSet, a rules file path, or None for the packaged defaults. ``checkpoints``
    adds ``{"step", "path"}`` entries to those found in the file. ``on_step(reader)`` is called
    after every step (progress); ``on_output(step, output)`` for every engine output as it comes.
    Raises :class:`ReadError` (unreadable input) and :class:`RulesError` (bad rules file)."""
    from trainguard.streams import rules as rules_mod
    from trainguard.streams.engine import Engine

    path = os.fspath(path)
    ruleset = rules if isinstance(rules, rules_mod.RuleSet) else rules_mod.load(rules)
    reader = open_reader(path, fmt)
    run_id = run_id or _default_run_id(path, reader.format)
    try:
        ev.check_run_id(run_id)
    except ev.SchemaError as exc:
        raise ValueError(f"--run-id: {exc}") from None
    result = ReplayResult(path=path, format=reader.format, run_id=run_id)

    known = {c["step"]: c for c in (find_checkpoints(path, reader.format) if find_file_checkpoints else [])}
    for c in checkpoints or ():
        known[c["step"]] = c
    pending = sorted(known.values(), key=lambda c: c["step"])
    result.checkpoints = list(pending)

    engine = Engine(ruleset)
    src = ev.source("trainer", REPLAY_HOST, 0)
    base_ts = 1.0e9  # synthetic, fixed: the same file replays to the same alert ids
    started = time.monotonic()
    index = 0
    next_ckpt = 0
    seen: set[str] = set()
    for step, metrics in reader:
        index += 1
        ts = base_ts + index * STEP_SECONDS
        # Checkpoints saved at or before the previous step are known before this one.
        while next_ckpt < len(pending) and pending[next_ckpt]["step"] < step:
            c = pending[next_ckpt]
            next_ckpt += 1
            engine.apply(ev.checkpoint_event(run_id, c["step"], c["path"], ts=ts - STEP_SECONDS / 2))
        if result.first_step is None:
            result.first_step = step
        result.last_step = step
        metrics = _within_schema(metrics, result)
        if not seen.issuperset(metrics):
            for name in metrics:
                if name not in seen:
                    seen.add(name)
                    result.metrics.append(name)
        event = ev.metrics_event(run_id, step, metrics, src=src, ts=ts)
        for out in engine.apply(event):
            if out.kind == "alert" and out.value is not None:
                result.alerts.append(out.value)
            elif out.kind == "command" and out.value is not None:
                result.commands.append(out.value)
                result.command_steps.append(step)
            if on_output is not None:
                on_output(step, out)
        if on_step is not None:
            on_step(reader)
    result.elapsed_s = time.monotonic() - started
    if reader.steps == 0:  # "no alerts" about a file nothing was read from would be a lie
        raise ReadError(path, f"no step read as {reader.format} ({reader.skipped} records skipped, "
                              f"{reader.ignored} without metrics). trainguard replay reads:\n{formats_read()}\n"
                              f"(--format FORMAT when the file is one of these but was taken for another)")
    result.framework = recognise(result.metrics)
    result.unwatched = ruleset.unwatched(result.metrics)
    result.by_pattern = ruleset.by_pattern(result.metrics)
    result.inferred = ruleset.inferred(result.metrics)
    result.steps = reader.steps
    result.consecutive_critical = ruleset.policy.consecutive_critical
    result.breaker_rules = ruleset.breaker_rules
    result.skipped = reader.skipped
    result.ignored = reader.ignored
    result.problems = list(reader.problems)
    result.bad_values = getattr(reader, "bad_values", 0)
    return result


def _strip_gz_name(path: str) -> str:
    name = os.path.basename(path)
    return name[:-3] if name.endswith(".gz") else name


def trainer_output_dir(path: str) -> str:
    """The Trainer's output directory of a trainer_state.json (or of the folder holding one): the
    folder it is in, or that folder's parent when it is a ``checkpoint-N`` folder."""
    from trainguard.producers.guards.checkpoint import step_of

    folder = os.path.abspath(path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path)))
    if step_of(os.path.basename(folder), "checkpoint-") is not None:
        folder = os.path.dirname(folder)
    return folder


def _default_run_id(path: str, fmt: str) -> str:
    """The file's name without its extension, made a valid run id (``my run|2*.log`` -> ``my_run_2_``);
    for a trainer_state.json, its Trainer's output directory's name (every one is called so; a
    state file saved under another name keeps its own)."""
    named_by_folder = fmt == "hf" and (os.path.isdir(path) or _strip_gz_name(path) == "trainer_state.json")
    name = os.path.basename(trainer_output_dir(path) if named_by_folder else os.path.normpath(path)) or "replay"
    for suffix in (".gz", ".log", ".jsonl", ".ndjson", ".json", ".csv", ".tsv", ".txt"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    name = re.sub(r"[^!-)+-{}~]", "_", name)[:256]  # schemas.events.RUN_ID
    return name or "replay"


# --------------------------------------------------------------------------- output


class Progress:
    """A one-line ``\\r`` progress display on a terminal: percent of bytes, steps, steps/s."""

    def __init__(self, stream: TextIO, label: str, interval_s: float = 0.1):
        self.stream = stream
        self.label = label
        self.interval_s = interval_s
        self.started = time.monotonic()
        self._last = self.started if interval_s > 0 else 0.0  # no reading of the first step's rate
        self._shown = False

    def __call__(self, reader: StepReader) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return
        self._last = now
        self.render(reader, now)

    def render(self, reader: StepReader, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        elapsed = max(now - self.started, 1e-9)
        total = reader.total_bytes or 0
        pct = f"{min(100.0, 100.0 * reader.position / total):5.1f}%" if total else "  ?  "
        width = 24
        filled = int(width * min(1.0, reader.position / total)) if total else 0
        bar = "#" * filled + "-" * (width - filled)
        self.stream.write(f"\rreplaying {self.label} [{bar}] {pct} {reader.steps} steps "
                          f"{reader.steps / elapsed:,.0f} steps/s")
        self.stream.flush()
        self._shown = True

    def clear(self) -> None:
        if self._shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._shown = False


def alert_json(alert: dict) -> bytes:
    """The ``--json`` line of one alert (NaN/Inf values as the strings the schema uses)."""
    return orjson.dumps({"step": alert["step"], "rule": alert["rule"], "severity": alert["severity"],
                         "metric": alert.get("metric"), "value": alert.get("value"), "status": alert["status"]})


def command_text(command: dict, step: int | None = None) -> str:
    """What the breaker would have done, in words."""
    at = f"at step {step} " if step is not None else ""
    target = command.get("target")
    if command["action"] == "rollback" and target:
        where = f" ({target['path']})" if target.get("path") else ""
        skip = f", {skipping(command['skip_batches'])}" if command.get("skip_batches") else ""
        return f"{at}would roll back to checkpoint at step {target['step']}{where}{skip}: {command.get('detail', '')}"
    return f"{at}would {command['action']}: {command.get('detail', '')}"


def _alert_row(console, alert: dict) -> str:
    line = console.format_alert(alert)
    # format_alert starts with the wall clock, meaningless for a replay: show the step instead
    return f"step {alert['step']:>7}  {line.split(' ', 1)[1] if ' ' in line else line}"


def summary_lines(result: ReplayResult) -> list[str]:
    span = f" (steps {result.first_step}..{result.last_step})" if result.steps else ""
    rate = f", {result.steps / result.elapsed_s:,.0f} steps/s" if result.elapsed_s > 0 and result.steps else ""
    lines = [f"replayed {result.path} as {result.format}, run {result.run_id}: {result.steps} steps{span} "
             f"in {result.elapsed_s:.2f}s{rate}"]
    if result.skipped:
        lines.append(f"skipped {result.skipped} unreadable record(s):")
        lines += [f"  {p}" for p in result.problems]
        if result.skipped > len(result.problems):
            lines.append(f"  ... and {result.skipped - len(result.problems)} more")
    else:
        lines.append("skipped 0 records")
    if result.bad_values:
        lines.append(f"left out {result.bad_values} unreadable value(s) in otherwise readable lines")
    if result.names_too_long:
        lines.append(f"left out {result.names_too_long} value(s) whose metric name is empty or longer than "
                     f"{ev.MAX_NAME_LEN} characters (the events schema's limit)")
    if result.over_cap:
        lines.append(f"left out {result.over_cap} value(s) past the {ev.MAX_METRICS_PER_EVENT:,} metrics per step "
                     f"the events schema allows (the first {ev.MAX_METRICS_PER_EVENT:,} of each step kept)")
    if result.ignored:
        lines.append(f"ignored {result.ignored} record(s) without training metrics")
    by_rule = result.alerts_by_rule()
    if by_rule:
        lines.append("alerts by rule:")
        for rule, counts in by_rule.items():
            first = next(a for a in result.alerts if a["rule"] == rule and a["status"] == "firing")
            lines.append(f"  {rule:<28} {counts['firing']} firing, {counts['resolved']} resolved "
                         f"(first at step {first['step']}, {first['severity']})")
    else:
        lines.append("no alerts")
    if result.metrics:
        known = f"{result.framework} names" if result.framework else "no framework's names recognised"
        lines.append(f"metrics: {len(result.metrics)} ({known}); "
                     f"{len(result.metrics) - len(result.unwatched)} watched by the rules")
        if result.inferred:
            said = [f"{n} as {s}" for n, s in result.inferred.items()]
            shown = ", ".join(said[:8]) + (f" (+{len(said) - 8} more)" if len(said) > 8 else "")
            lines.append(f"judged as the signal their names suggest (no dialect knows them; pin or refuse one "
                         f"under names: in a rules file): {shown}")
        if result.by_pattern:
            shown = ", ".join(result.by_pattern[:6]) + (f" (+{len(result.by_pattern) - 6} more)"
                                                        if len(result.by_pattern) > 6 else "")
            lines.append(f"judged by name pattern only (no dialect knows them): {shown}")
        if result.unwatched:
            shown = ", ".join(result.unwatched[:12]) + (f" (+{len(result.unwatched) - 12} more)"
                                                         if len(result.unwatched) > 12 else "")
            lines.append(f"  not watched by any rule: {shown}; docs/vocabulary.md lists the names each "
                         f"signal covers, --rules adds your own")
    if result.checkpoints:
        steps = ", ".join(str(c["step"]) for c in result.checkpoints[:12])
        more = f" (+{len(result.checkpoints) - 12})" if len(result.checkpoints) > 12 else ""
        lines.append(f"checkpoints known: {len(result.checkpoints)} (steps {steps}{more})")
    else:
        lines.append("checkpoints known: none (where the breaker acts, it can only stop the run; give them with "
                     "--checkpoint STEP[:PATH])")
    if result.commands:
        lines.append(f"the circuit breaker {command_text(result.commands[0], result.command_steps[0])}")
        if len(result.commands) > 1:
            # The recording goes on as the run lived it, i.e. as if no command was ever applied;
            # the breaker re-issues once an unanswered command expires.
            rest = list(zip(result.commands[1:], result.command_steps[1:], strict=True))
            kinds = Counter(c["action"] for c, _ in rest)
            what = ", ".join(f"{n} {a}" for a, n in kinds.items())
            steps = ", ".join(str(s) for _, s in rest[:15]) + (" ..." if len(rest) > 15 else "")
            lines.append(f"  then {len(rest)} more ({what}) at steps {steps}, since the recording goes on "
                         f"as if the first was never applied")
    elif any(a.get("critical") and a.get("status") == "firing" for a in result.alerts):
        lines.append(f"the circuit breaker would not have acted: it acts after "
                     f"{result.consecutive_critical} critical steps in a row (at once for a NaN/Inf when a "
                     f"checkpoint is known), and this run never had that many")
    else:
        pages = sorted({f"{a['severity']} {a['rule']}" for a in result.alerts
                        if a.get("status") == "firing" and a.get("severity") in ("P0", "P1")})
        lines.append("the circuit breaker would not have acted: " + (
            f"the pages ({', '.join(pages)}) are not of a rule it acts on; they need a person"
            if pages else "no rule it acts on fired"))
    lines.append(breaker_rules_line(result.breaker_rules, {a["rule"] for a in result.alerts
                                                           if a.get("status") == "firing"}))
    return lines


def breaker_rules_line(acts_on: list[str], fired: set[str]) -> str:
    """The rules the breaker acts on, and which of them fired: what it will do, said once."""
    if not acts_on:
        return "the circuit breaker acts on no rule (none is critical: true in the rules file)"
    hit = [r for r in acts_on if r in fired]
    return (f"the circuit breaker acts on: {', '.join(acts_on)}; of them fired: {', '.join(hit) or 'none'} "
            f"(docs/rules.md: critical)")


def main(args, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """``trainguard replay`` (args from the CLI's parser)."""
    from trainguard.sinks.console import ConsoleSink
    from trainguard.streams.rules import RulesError

    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    as_json = bool(getattr(args, "json", False))
    # The summary lists what was skipped; the readers' own warnings would only repeat it.
    logging.getLogger("trainguard.readers").setLevel(logging.ERROR)

    extra = []
    try:
        extra = [parse_checkpoint_arg(c) for c in (getattr(args, "checkpoint", None) or [])]
    except ValueError as exc:
        print(f"trainguard replay: {exc}", file=stderr)
        return 2

    show_progress = not getattr(args, "no_progress", False) and _isatty(stderr)
    progress = Progress(stderr, os.path.basename(os.fspath(args.file))) if show_progress else None
    console = ConsoleSink(stdout, colour=None if not as_json else False)

    def on_output(step: int, out) -> None:
        if out.kind != "alert":
            return
        if progress is not None:
            progress.clear()
        if as_json:
            stdout.write(alert_json(out.value).decode() + "\n")
        else:
            stdout.write(_alert_row(console, out.value) + "\n")
        stdout.flush()

    try:
        result = replay(args.file, rules=getattr(args, "rules", None), fmt=getattr(args, "format", None),
                        run_id=getattr(args, "run_id", None), checkpoints=extra,
                        on_step=progress, on_output=on_output)
    except ReadError as exc:
        print(f"{_clear(progress)}trainguard replay: cannot read {exc}", file=stderr)
        return 2
    except RulesError as exc:
        print(f"{_clear(progress)}trainguard replay: bad rules file: {exc}", file=stderr)
        return 2
    except ValueError as exc:
        print(f"{_clear(progress)}trainguard replay: {exc}", file=stderr)
        return 2
    finally:
        _clear(progress)  # also on Ctrl-C
    out = stderr if as_json else stdout
    if not as_json and not result.alerts:
        out.write("(no alerts)\n")
    if not as_json:
        out.write("\n")
    out.write("\n".join(summary_lines(result)) + "\n")
    out.flush()
    return 0


def _clear(progress: Progress | None) -> str:
    if progress is not None:
        progress.clear()
    return ""


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False

"""What every replay reader shares: the error type, counters for skipped input, byte-level
progress, opening plain or gzip-compressed files, and merging records of one step."""

from __future__ import annotations

import gzip
import logging
import math
import os
from typing import IO, Iterable, Iterator

log = logging.getLogger("trainguard.readers")

Step = tuple[int, dict[str, float]]

MAX_PROBLEMS = 20  # descriptions kept for display; the counter keeps counting past it

# Keys only an RL trainer logs (TRL's GRPO / RLOO / PPO / online trainers). DPO's "rewards/*"
# are not among them: its loss is a training loss.
RL_KEYS = ("reward", "reward_std", "kl", "frac_reward_zero_std", "completion_length")
RL_PREFIXES = ("completions/", "objective/", "rollout/")
# A plain (SFT, DPO) Trainer's "loss" is read under the name the live callback sends it as, so
# that one run gives one verdict whichever way it arrives (TRL's RL "loss" is a policy loss).
PLAIN_LOSS = "total_loss"
_LOSS_NAMES = {"loss": PLAIN_LOSS, "train/loss": "train/" + PLAIN_LOSS}


def is_rl(keys) -> bool:
    """Whether logged keys are an RL trainer's (their ``loss`` is the policy-gradient loss)."""
    for k in keys:
        k = k[6:] if k.startswith("train/") else k
        if k in RL_KEYS or k.startswith(RL_PREFIXES):
            return True
    return False


# The longest line a line reader keeps (bytes, after decompression). A metrics line of the widest
# event the schema allows (10,000 metrics) is a few MiB at most; longer is not one, and reading
# it whole would let a small .gz file expand into gigabytes held in memory.
MAX_LINE_BYTES = 8 << 20

_NON_FINITE = {
    "nan": math.nan, "+nan": math.nan, "-nan": math.nan,
    "inf": math.inf, "+inf": math.inf, "-inf": -math.inf,
    "infinity": math.inf, "+infinity": math.inf, "-infinity": -math.inf,
}


class ReadError(ValueError):
    """Input that cannot be read; the message names the file, the line or byte offset, and the problem."""

    def __init__(self, path: str | os.PathLike, problem: str, *, line: int | None = None,
                 offset: int | None = None):
        self.path = os.fspath(path)
        self.problem = problem
        self.line = line
        self.offset = offset
        if line is not None:
            where = f"{self.path}:{line}"
        elif offset is not None:
            where = f"{self.path} at byte {offset}"
        else:
            where = self.path
        super().__init__(f"{where}: {problem}")


def to_float(value) -> float | None:
    """A metric value as float, or None when it is not a number.

    Accepts int/float (not bool: a flag is not a metric), and strings holding a number or
    one of NaN/Infinity/-Infinity/inf/nan in any case. ``None`` is *not* converted here:
    whether null means NaN depends on the format.
    """
    t = type(value)
    if t is float:
        return value
    if t is int:
        try:
            return float(value)
        except OverflowError:  # a 400-digit integer is not a metric value
            return None
    if t is str:
        s = value.strip()
        special = _NON_FINITE.get(s.lower())
        if special is not None:
            return special
        try:
            return float(s)
        except ValueError:
            return None
    return None


def to_step(value) -> int | None:
    """A step number (non-negative integer; ``12.0`` and ``"12"`` are fine), else None."""
    if type(value) is bool:
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, float):
        if value.is_integer() and value >= 0:
            return int(value)
        return None
    if isinstance(value, str):
        try:
            return to_step(float(value)) if "." in value or "e" in value.lower() else to_step(int(value))
        except ValueError:
            return None
    return None


def open_binary(path: str | os.PathLike) -> IO[bytes]:
    """Open a file for reading bytes; ``.gz`` files (by magic number) are decompressed."""
    raw = open(path, "rb")
    if raw.read(2) == b"\x1f\x8b":
        raw.seek(0)
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    raw.seek(0)
    return raw


def capped_lines(f: IO[bytes], limit: int = MAX_LINE_BYTES) -> Iterator[bytes | None]:
    """The lines of a binary file, each up to ``limit`` bytes; a longer line is read past in
    ``limit``-sized pieces (never held whole) and yields ``None`` in its place."""
    while True:
        raw = f.readline(limit)
        if not raw:
            return
        if len(raw) < limit or raw.endswith(b"\n"):
            yield raw
            continue
        while True:  # the rest of the overlong line, discarded
            more = f.readline(limit)
            if not more or more.endswith(b"\n"):
                break
        yield None


def head_bytes(path: str | os.PathLike, n: int = 65536) -> bytes:
    """The first ``n`` bytes of a file's (decompressed) content."""
    with open_binary(path) as f:
        return f.read(n)


class StepReader:
    """Base class: iterate to get ``(step, {metric: float})`` in file order.

    Counters, readable during and after iteration:

    - ``skipped``: records (lines, rows, entries) that could not be read and were skipped;
      ``problems`` holds the first few descriptions ("file:line: what").
    - ``ignored``: records that are readable but carry no training metrics (other event
      kinds, entries without metrics); not an error.
    - ``steps``: steps yielded so far.
    - ``position`` / ``total_bytes``: how far into the file, for a progress bar.
    """

    format = "?"
    # Formats that split one step over several records (one TensorBoard event per tag, a train
    # and an eval entry, one event per source) merge consecutive records of the same step.
    # Formats with one complete step per line do not: a step logged twice in a row there is
    # the step run twice (a resume), and both are yielded.
    merge_steps = True
    # Formats a Hugging Face Trainer writes (trainer_state.json, TensorBoard, CSV): a plain
    # trainer's ``loss`` is named ``total_loss`` unless the run has shown RL keys by then.
    plain_loss = False

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.skipped = 0
        self.ignored = 0
        self.steps = 0
        self.problems: list[str] = []
        self.position = 0
        try:
            self.total_bytes = os.path.getsize(self.path)
        except OSError as exc:
            raise ReadError(self.path, f"cannot open: {exc.strerror or exc}") from None

    # -- to override ---------------------------------------------------------------
    def records(self) -> Iterator[Step]:
        """Yield ``(step, metrics)`` per record; equal consecutive steps are merged by ``__iter__``."""
        raise NotImplementedError

    # -- shared ----------------------------------------------------------------------
    def skip(self, problem: str, *, line: int | None = None, offset: int | None = None) -> None:
        self.skipped += 1
        if len(self.problems) < MAX_PROBLEMS:
            text = str(ReadError(self.path, problem, line=line, offset=offset))
            self.problems.append(text)
            if len(self.problems) <= 3:
                log.warning("skipped unreadable input: %s", text)

    def __iter__(self) -> Iterator[Step]:
        records = merge_consecutive(self.records()) if self.merge_steps else self.records()
        rl = not self.plain_loss
        for step, metrics in records:
            self.steps += 1
            if not rl:
                rl = is_rl(metrics)
                if not rl and not _LOSS_NAMES.keys().isdisjoint(metrics):
                    metrics = {_LOSS_NAMES.get(k, k): v for k, v in metrics.items()}
            yield step, metrics
        if self.steps == 0 and self.skipped:
            # Everything was unreadable: that is not an empty run, it is the wrong file or format.
            raise ReadError(self.path, f"no step could be read as {self.format}; "
                                       f"{self.skipped} records skipped, first: {self.problems[0]}")

    def stats(self) -> dict:
        return {"format": self.format, "path": self.path, "steps": self.steps, "skipped": self.skipped,
                "ignored": self.ignored, "problems": list(self.problems)}


def merge_consecutive(records: Iterable[Step]) -> Iterator[Step]:
    """Join records of the same step that follow each other (a train log and an eval log of one
    step, one TensorBoard event per tag ...). A step that comes back later (a run resumed from a
    checkpoint) is yielded again, in file order, as the run lived it."""
    current_step: int | None = None
    current: dict[str, float] = {}
    for step, metrics in records:
        if step == current_step:
            current.update(metrics)
            continue
        if current_step is not None and current:
            yield current_step, current
        current_step, current = step, dict(metrics)
    if current_step is not None and current:
        yield current_step, current


class LineReader(StepReader):
    """A reader of a text file line by line (split on ``\\n`` only), tracking byte position."""

    def lines(self) -> Iterator[tuple[int, str]]:
        try:
            f = open_binary(self.path)
        except OSError as exc:
            raise ReadError(self.path, f"cannot open: {exc.strerror or exc}") from None
        with f:
            raw_file = getattr(f, "fileobj", None)  # the compressed file under a GzipFile
            try:
                for number, raw in enumerate(capped_lines(f), 1):
                    self.position = raw_file.tell() if raw_file is not None else f.tell()
                    if raw is None:
                        self.skip(f"line longer than {MAX_LINE_BYTES >> 20} MiB: not a metrics line", line=number)
                        continue
                    yield number, raw.decode("utf-8", errors="replace").rstrip("\r\n")
            except (OSError, EOFError, gzip.BadGzipFile) as exc:
                raise ReadError(self.path, f"read failed: {exc}", offset=self.position) from None
        self.position = self.total_bytes


__all__ = ["ReadError", "StepReader", "is_rl", "PLAIN_LOSS", "LineReader", "Step", "merge_consecutive", "to_float",
           "to_step", "open_binary", "head_bytes", "capped_lines", "MAX_LINE_BYTES"]

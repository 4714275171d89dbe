"""verl console logs (stdout of ``main_ppo`` with the ``console`` logger).

verl's ``LocalLogger`` prints one line per step::

    step:12 - actor/kl_loss:0.001 - critic/score/mean:np.float64(0.42) - timing_s/gen:3.1

built as ``" - ".join([f"step:{step}"] + [f"{k}:{pprint.pformat(v)}" ...])`` (older
versions format values as ``{v:.3f}``). What this reader copes with, because real logs
have it:

- text before ``step:`` (Ray's ``(TaskRunner pid=1234)`` / ``(main_task pid=1234)``
  prefixes, timestamps), ANSI colour codes, Ray's ``[repeated 3x across cluster]`` suffix,
  carriage-return progress bars sharing the line;
- value wrappers: ``np.float64(0.42)``, ``np.float32(..)``, ``np.int64(..)``,
  ``numpy.float64(..)``, ``tensor(0.42)``, ``tensor(0.42, device='cuda:0')``;
- ``nan``, ``inf``, ``-inf``, ``NaN``, ``Infinity``; ``True``/``False`` as 1/0;
- every other line (warnings, tracebacks, progress bars, validation dict dumps) is not a
  metrics line and is passed over silently. A line that starts like a metrics line but
  has no readable ``key:value`` pair is skipped and counted; a single unreadable value in
  an otherwise good line is left out and counted in ``bad_values``.
"""

from __future__ import annotations

import re
from typing import Iterator

from .base import LineReader, Step, to_float

ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
# Matched only where the last "[repeated " starts (see strip_repeated): searched over the whole
# line, a leading \s* would retry from every space of a long run of them (quadratic time).
REPEATED = re.compile(r"\[repeated \d+x across cluster\]")
# "step:12" not preceded by a word character or "/" (so "global_step:3" and
# "training/global_step:3" inside the line are not taken as the step marker).
STEP = re.compile(r"(?<![\w/])step:\s*(\d+)(?:\s+-\s+|\s*$)")
WRAPPER = re.compile(r"^(?:np|numpy|torch)?\.?(?:float\d*|int\d*|uint\d*|bool_?|tensor|array)\((.*)\)$")
_BOOLS = {"True": 1.0, "False": 0.0}


def strip_repeated(text: str) -> str:
    """``text`` without Ray's trailing ``[repeated 3x across cluster]``, stripped; linear time."""
    text = text.strip()
    if text.endswith("]"):
        start = text.rfind("[repeated ")
        if start >= 0 and REPEATED.fullmatch(text, start):
            text = text[:start].rstrip()
    return text


def parse_value(text: str) -> float | None:
    """A printed value as float (``np.float64(0.42)`` -> 0.42, ``tensor(nan, device='cuda:0')`` -> nan)."""
    s = text.strip()
    for _ in range(3):  # np.float64(tensor(..)) is not a thing, but nesting is cheap to allow
        m = WRAPPER.match(s)
        if not m:
            break
        s = m.group(1).split(",", 1)[0].strip()  # drop ", device='cuda:0'", ", dtype=..."
    if s in _BOOLS:
        return _BOOLS[s]
    return to_float(s)


def parse_line(line: str) -> tuple[int, dict[str, float], int] | None:
    """``(step, metrics, unreadable values)`` for a verl metrics line, None for any other line."""
    if "step:" not in line:
        return None
    if "\x1b" in line:
        line = ANSI.sub("", line)
    if "\r" in line:  # a progress bar redrawn on the same line: the last segment with a step wins
        parts = [p for p in line.split("\r") if "step:" in p]
        if not parts:
            return None
        line = parts[-1]
    m = STEP.search(line)
    if m is None:
        return None
    step = int(m.group(1))
    rest = strip_repeated(line[m.end():])
    metrics: dict[str, float] = {}
    bad = 0
    if rest:
        for item in rest.split(" - "):
            key, sep, value = item.partition(":")
            key = key.strip()
            if not sep or not key or " " in key:
                bad += 1
                continue
            v = parse_value(value)
            if v is None:
                bad += 1
                continue
            metrics[key] = v
    return step, metrics, bad


class VerlLogReader(LineReader):
    format = "verl"
    merge_steps = False  # one line, one step

    def __init__(self, path):
        super().__init__(path)
        self.bad_values = 0

    def records(self) -> Iterator[Step]:
        for number, line in self.lines():
            parsed = parse_line(line)
            if parsed is None:
                continue
            step, metrics, bad = parsed
            self.bad_values += bad
            if not metrics:
                if bad:
                    self.skip(f"step:{step} line has no readable key:value pair", line=number)
                continue  # a bare "step:12" line carries nothing to replay
            yield step, metrics

    def stats(self) -> dict:
        return {**super().stats(), "bad_values": self.bad_values}


__all__ = ["VerlLogReader", "parse_line", "parse_value", "strip_repeated"]

"""Hugging Face ``Trainer`` / TRL console output: the logs dict the Trainer prints at every
logging step::

    {'loss': 0.6931, 'grad_norm': 1.23, 'learning_rate': 4.5e-05, 'epoch': 0.1}
    {'loss': nan, 'grad_norm': nan, 'learning_rate': 4.5e-05, 'epoch': 0.12}
    {'eval_loss': 0.71, 'eval_runtime': 0.4, 'epoch': 0.12}
    {'train_runtime': 12.1, 'train_samples_per_second': 42.3, 'train_loss': 0.7, 'epoch': 1.0}

(``str(logs)``: ``ProgressCallback`` writes it with ``tqdm.write``, ``PrinterCallback``
prints it; TRL adds its own keys, ``'reward'``, ``'kl'``, ``'completions/mean_length'`` ...).
The dict is Python literal syntax, read with :mod:`ast` without evaluating anything: numbers,
``nan``/``inf`` as Python prints them, ``None`` (TRL's all-NaN metric) as NaN, numpy or torch
scalar reprs (``np.float64(0.42)``, ``tensor(0.42)``) by their value; strings and lists are
left out. Progress bars sharing the line (``\\r``) and ANSI colours are passed over.

The lines carry no step: the Nth training log line is step N (the Trainer's step when it logs
every step; N x ``logging_steps`` otherwise), unless the dict has a ``step``. An evaluation
line or the final summary belongs to the training step before it. A plain Trainer's ``loss``
(SFT, DPO: no RL keys in the first lines) is named ``total_loss``, as the live callback names
it, so that it is judged as a training loss and not as a policy-gradient loss.
"""

from __future__ import annotations

import ast
import math
from typing import Iterator

from .base import PLAIN_LOSS, LineReader, ReadError, Step, head_bytes, is_rl, to_float
from .verl import ANSI, parse_value

MAX_LINE = 100_000  # a logs dict is a few hundred characters; longer is not one
MAX_SIGNS = 8  # unary signs before one value ("-1.0", "--1.0" at a stretch); more is not a printed number
_NAMES = {"nan": math.nan, "NaN": math.nan, "inf": math.inf, "Infinity": math.inf, "None": math.nan}
_SUMMARY_KEYS = ("train_runtime", "train_loss")


def logs_segment(line: str) -> str | None:
    """The ``{'...}`` part of a console line (after progress bars and colours), or None."""
    if "{'" not in line:
        return None
    if "\x1b" in line:
        line = ANSI.sub("", line)
    segment = line.rsplit("\r", 1)[-1] if "\r" in line else line
    start = segment.find("{'")
    end = segment.rfind("}")
    if start < 0 or end - start > MAX_LINE:
        return None
    if end < start:  # cut short: counted when the line is one, passed over when it merely quotes one
        return segment[start:] if not segment[:start].strip() else None
    return segment[start:end + 1]


def _value(node: ast.AST) -> float | None:
    """A literal number (``nan``, ``-inf``, ``np.float64(x)`` ...) from the parsed dict, or None."""
    sign = 1.0
    for _ in range(MAX_SIGNS + 1):  # a loop, not recursion: "-" * 1500 is valid syntax
        if not (isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd))):
            break
        if isinstance(node.op, ast.USub):
            sign = -sign
        node = node.operand
    else:
        return None  # more signs than any printed number has: not a value
    v = _plain_value(node)
    return None if v is None else sign * v


def _plain_value(node: ast.AST) -> float | None:
    if isinstance(node, ast.Constant):
        v = node.value
        if v is None:
            return math.nan
        if type(v) is int:
            return to_float(v)  # None for an integer past float's range
        if type(v) is float or type(v) is bool:
            return float(v)
        return None
    if isinstance(node, ast.Name):
        return _NAMES.get(node.id)
    if isinstance(node, ast.Call) and node.args:  # np.float64(0.4), tensor(0.4, device='cuda:0')
        return parse_value(ast.unparse(node))
    return None


def parse_logs(segment: str) -> tuple[dict[str, float], int] | None:
    """``(metrics, unreadable values)`` of a printed logs dict; None when it is not one."""
    try:
        tree = ast.parse(segment, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.Dict):
        return None
    metrics: dict[str, float] = {}
    bad = 0
    for key, node in zip(tree.body.keys, tree.body.values, strict=True):
        if not (isinstance(key, ast.Constant) and type(key.value) is str):
            return None  # {**x} or a non-string key: not a logs dict
        v = _value(node)
        if v is None:
            if not (isinstance(node, ast.Constant) and type(node.value) is str):
                bad += 1  # a string is not a metric; anything else unreadable is counted
            continue
        metrics[key.value] = v
    return metrics, bad


def looks_like_console(lines: list[str]) -> bool:
    """Whether any of ``lines`` is a printed logs dict (for format detection)."""
    for line in lines:
        segment = logs_segment(line)
        if segment is not None and parse_logs(segment):
            return True
    return False


class HFConsoleReader(LineReader):
    format = "hflog"

    def __init__(self, path):
        super().__init__(path)
        self.bad_values = 0
        try:
            head = head_bytes(self.path, 1 << 20).decode("utf-8", errors="replace").splitlines()
        except OSError as exc:
            raise ReadError(self.path, f"cannot open: {exc.strerror or exc}") from None
        self.rl = any(is_rl(parsed[0]) for parsed in
                      (parse_logs(s) for s in (logs_segment(ln) for ln in head) if s is not None) if parsed)

    def records(self) -> Iterator[Step]:
        step = 0
        for number, line in self.lines():
            segment = logs_segment(line)
            if segment is None:
                continue  # progress bars, warnings, tracebacks
            parsed = parse_logs(segment)
            if parsed is None:
                self.skip("a line that starts like a logs dict but is not one", line=number)
                continue
            metrics, bad = parsed
            self.bad_values += bad
            explicit = metrics.pop("step", None)
            training = not any(k.startswith("eval_") or k in _SUMMARY_KEYS for k in metrics)
            if explicit is not None and math.isfinite(explicit) and explicit >= 0:
                step = int(explicit)
            elif training or step == 0:
                step += 1
            if not self.rl and "loss" in metrics:
                metrics[PLAIN_LOSS] = metrics.pop("loss")
            if metrics:
                yield step, metrics
            elif bad:
                self.skip("a logs dict with no readable value", line=number)

    def stats(self) -> dict:
        return {**super().stats(), "bad_values": self.bad_values, "rl": self.rl}


__all__ = ["HFConsoleReader", "parse_logs", "logs_segment", "looks_like_console", "is_rl", "PLAIN_LOSS"]

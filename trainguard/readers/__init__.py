"""Readers that turn a recorded run into an ordered stream of ``(step, {metric: float})``.

Used by ``trainguard replay`` to run detectors offline over a run that already happened.

    from trainguard.readers import read_steps, open_reader, estimate_steps

    for step, metrics in read_steps("run.log"):          # format detected from the content
        ...

    reader = open_reader("trainer_state.json")           # the same, with counters
    for step, metrics in reader: ...
    reader.skipped, reader.problems, reader.position / reader.total_bytes

Formats (``fmt`` names, aliases in brackets):

- ``jsonl`` (json, ndjson, events): flat ``{"step": .., "metric": ..}`` lines, or the project's own
  ``metrics/1`` events;
- ``csv`` (tsv): a header with a ``step`` column;
- ``hf`` (trainer_state, huggingface): Hugging Face ``trainer_state.json`` ``log_history``; a
  checkpoint or output directory holding one works too;
- ``tensorboard`` (tb, tfevents): ``events.out.tfevents.*`` files, or a directory of them;
- ``verl`` (log, console, text): verl console output, ``step:12 - key:value - ...``;
- ``hflog`` (transformers, trl, hf_console): Hugging Face ``Trainer`` / TRL console output, the logs
  dicts it prints (``{'loss': 0.69, 'grad_norm': 1.2, ...}``, ``nan`` as Python prints it);
- ``hfnotebook`` (notebook, jupyter): the Trainer's notebook table copied as text;
- ``tqdm`` (openrlhf, postfix): tqdm bars with a metrics postfix (OpenRLHF's trainers);
- ``wandb`` (wb, weights_and_biases): a W&B run's ``run-<id>.wandb`` file, or its run folder (needs ``wandb``);
- ``swanlab``: a SwanLab run's ``run-<id>.swanlab`` file, or its run folder (needs ``swanlab``).

Files may be gzip-compressed. Values are floats with NaN/Inf kept as ``nan``/``inf``
(a NaN loss is the most important thing a replay can find). Steps come in file order, a
step logged again later (a run resumed from a checkpoint) again, as the run lived it. Where a
format splits one step over several records (TensorBoard events, trainer_state train and eval
entries, metric events of several sources), records of one step that follow each other are
merged into one step.

Bad input: line-based formats (jsonl, csv, verl) skip and count unreadable lines
(``reader.skipped``, first descriptions in ``reader.problems``) and never stop on one; a
file where *nothing* could be read, a broken trainer_state.json, or a TensorBoard record
failing its CRC raises :class:`ReadError`, whose message names the file, the line or byte
offset, and the problem.
"""

from __future__ import annotations

import json
import os
import re
from typing import Iterator

from .base import ReadError, Step, StepReader, head_bytes
from .csvfile import CsvReader, step_column
from .hf import TrainerStateReader
from .hfconsole import HFConsoleReader, looks_like_console
from .jsonl import JsonlReader
from .notebook import NotebookTableReader, looks_like_notebook
from .recordlog import run_file
from .swanlab import MAGIC as SWANLAB_MAGIC
from .swanlab import SwanLabReader
from .tensorboard import TensorBoardReader, looks_like_tfrecord
from .tqdmlog import TqdmPostfixReader, looks_like_tqdm
from .verl import VerlLogReader, parse_line
from .wandb import MAGIC as WANDB_MAGIC
from .wandb import WandbReader

# The one table of formats: name, reader, the aliases --format accepts, what it is (for the
# messages that say what replay reads). docs/replay.md's table lists the same.
FORMAT_TABLE: tuple[tuple[str, type[StepReader], tuple[str, ...], str], ...] = (
    ("jsonl", JsonlReader, ("json", "ndjson", "events"),
     "JSON lines with a step (or trainguard's metrics/1 events)"),
    ("csv", CsvReader, ("tsv",), "CSV with a step column"),
    ("hf", TrainerStateReader, ("trainer_state", "huggingface"),
     "a Hugging Face trainer_state.json (or the checkpoint or output directory holding one)"),
    ("tensorboard", TensorBoardReader, ("tb", "tfevents"), "TensorBoard event files (or a log directory)"),
    ("verl", VerlLogReader, ("log", "console", "text"), "a verl console log ('step:12 - actor/kl_loss:0.001 - ...')"),
    ("hflog", HFConsoleReader, ("transformers", "trl", "hf_console"),
     "a Hugging Face Trainer / TRL console log (\"{'loss': 0.69, 'grad_norm': 1.2, ...}\" lines)"),
    ("hfnotebook", NotebookTableReader, ("notebook", "jupyter"),
     "a Hugging Face Trainer's notebook table ('Step<TAB>Training Loss' under a progress line)"),
    ("tqdm", TqdmPostfixReader, ("openrlhf", "postfix"),
     "tqdm bars with a metrics postfix, as OpenRLHF prints them ('... 3.01s/it, act_loss=0.01, kl=0.001]')"),
    ("wandb", WandbReader, ("wb", "weights_and_biases"), "a W&B run file (run-<id>.wandb) or run folder"),
    ("swanlab", SwanLabReader, (), "a SwanLab run file (run-<id>.swanlab) or run folder"),
)
READERS: dict[str, type[StepReader]] = {name: reader for name, reader, _, _ in FORMAT_TABLE}
ALIASES = {alias: name for name, _, aliases, _ in FORMAT_TABLE for alias in aliases}
FORMATS = tuple(READERS)
DESCRIPTIONS = {name: what for name, _, _, what in FORMAT_TABLE}


def formats_read() -> str:
    """The formats, one per line, as the messages list them."""
    return "\n".join(f"  {name}: {what}" for name, what in DESCRIPTIONS.items())

_SNIFF_BYTES = 65536


def canonical_format(fmt: str) -> str | None:
    """The format a ``--format`` name or alias stands for, or None when it is none."""
    name = fmt.strip().lower()
    name = ALIASES.get(name, name)
    return name if name in READERS else None


def format_names() -> str:
    """Every format with its aliases, as the messages list them: ``jsonl (json, ndjson, events), csv (tsv), ...``."""
    return ", ".join(f"{name} ({', '.join(aliases)})" if aliases else name for name, _, aliases, _ in FORMAT_TABLE)


def _canonical(fmt: str, path: str) -> str:
    name = canonical_format(fmt)
    if name is None:
        raise ReadError(path, f"unknown format {fmt!r}; use one of {format_names()}")
    return name


def _strip_gz(name: str) -> str:
    return name[:-3] if name.endswith(".gz") else name


def detect_format(path: str | os.PathLike) -> str:
    """The format of ``path`` from its name and first bytes; ReadError when it cannot tell."""
    path = os.fspath(path)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "trainer_state.json")):
            return "hf"
        from trainguard.readers.tensorboard import run_directories

        if run_directories(path):  # its own event files, or a TensorBoard tree's
            return "tensorboard"
        for fmt, suffix in (("wandb", ".wandb"), ("swanlab", ".swanlab")):
            if run_file(path, suffix):
                return fmt
        raise ReadError(path, "directory holds no trainer_state.json, events.out.tfevents.* files (in it or "
                              "under it), W&B run-*.wandb or SwanLab run-*.swanlab file")
    name = _strip_gz(os.path.basename(path).lower())
    if "tfevents" in name:
        return "tensorboard"
    if name == "trainer_state.json":
        return "hf"
    try:
        head = head_bytes(path, _SNIFF_BYTES)
    except OSError as exc:
        raise ReadError(path, f"cannot open: {exc.strerror or exc}") from None
    if not head.strip():
        raise ReadError(path, "file is empty")
    if looks_like_tfrecord(head):
        return "tensorboard"
    if head.startswith(WANDB_MAGIC):
        return "wandb"
    if head.startswith(SWANLAB_MAGIC):
        return "swanlab"
    text = head.decode("utf-8", errors="replace")
    lines = text.splitlines()
    if len(head) == _SNIFF_BYTES and len(lines) > 1:
        lines = lines[:-1]  # the last line may be cut by the sniff window
    first = next((ln.strip() for ln in lines if ln.strip()), "")
    ext = os.path.splitext(name)[1]
    if first.startswith("{"):
        obj = _json_object(first)
        if obj is not None:  # a whole object on the first line: JSON lines (or a one-line trainer state)
            return "hf" if type(obj.get("log_history")) is list else "jsonl"
        if looks_like_console(lines[:2000]):
            return "hflog"
        if '"log_history"' in text or ext == ".json":
            return "hf"
        return "jsonl"
    if ext in (".jsonl", ".ndjson"):
        return "jsonl"
    if any(parse_line(ln) for ln in lines[:2000]):
        return "verl"
    if looks_like_console(lines[:2000]):
        return "hflog"
    if looks_like_notebook(lines[:2000]):
        return "hfnotebook"
    if looks_like_tqdm(lines[:2000]):
        return "tqdm"
    if ext in (".csv", ".tsv") or (any(d in first for d in ",\t;") and _csv_header_has_step(first)):
        return "csv"
    if ext in (".log", ".txt", ".out", ".err"):
        return "verl"
    raise ReadError(path, "cannot tell the format (not JSON lines, CSV with a step column, trainer_state.json, "
                          "a TensorBoard event file, a verl or Hugging Face console log or notebook table, tqdm bars "
                          f"with a postfix, a W&B or SwanLab run file); pass one with --format: {', '.join(FORMATS)}")


def _json_object(line: str) -> dict | None:
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return obj if type(obj) is dict else None


def _csv_header_has_step(line: str) -> bool:
    cells = re.split(r"[,\t;]", line)
    return step_column([c.strip().strip('"') for c in cells]) is not None


def open_reader(path: str | os.PathLike, fmt: str | None = None) -> StepReader:
    """A reader for ``path`` (iterate it for steps; it keeps the counters)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ReadError(path, "no such file or directory")
    name = _canonical(fmt, path) if fmt else detect_format(path)
    if name == "hf" and os.path.isdir(path):
        path = os.path.join(path, "trainer_state.json")
    elif name in ("wandb", "swanlab") and os.path.isdir(path):
        found = run_file(path, "." + name)
        if found is None:
            raise ReadError(path, f"no run-*.{name} file in this folder or a run folder under it")
        path = found
    return READERS[name](path)


def read_steps(path: str | os.PathLike, fmt: str | None = None) -> Iterator[Step]:
    """``(step, {metric: float})`` in file order; ``fmt`` None detects the format."""
    yield from open_reader(path, fmt)


def count_steps(path: str | os.PathLike, fmt: str | None = None) -> int:
    """The exact number of steps ``read_steps`` will yield (reads the whole file once)."""
    reader = open_reader(path, fmt)
    if isinstance(reader, TensorBoardReader):
        reader.verify_crc = False  # counting only; the replay pass checks them
    n = 0
    for _ in reader:
        n += 1
    return n


def estimate_steps(path: str | os.PathLike, fmt: str | None = None, sample_bytes: int = 1 << 20) -> int:
    """A cheap estimate of the step count for a progress bar: exact for files up to
    ``sample_bytes`` (and for trainer_state.json), else extrapolated from the steps in the
    first ``sample_bytes`` by file size (compressed files: by compressed size)."""
    reader = open_reader(path, fmt)
    if isinstance(reader, TensorBoardReader):
        reader.verify_crc = False
    if isinstance(reader, TrainerStateReader) or reader.total_bytes <= sample_bytes:
        return sum(1 for _ in _quiet(reader))
    n = 0
    for _ in _quiet(reader):
        n += 1
        if reader.position >= sample_bytes:
            break
    if reader.position <= 0:
        return n
    return max(n, round(n * reader.total_bytes / reader.position))


def _quiet(reader: StepReader) -> Iterator[Step]:
    try:
        yield from reader
    except ReadError:
        return


__all__ = ["ReadError", "StepReader", "Step", "FORMATS", "FORMAT_TABLE", "READERS", "ALIASES", "DESCRIPTIONS",
           "formats_read", "canonical_format", "format_names", "NotebookTableReader", "TqdmPostfixReader",
           "detect_format", "open_reader", "read_steps", "count_steps", "estimate_steps", "JsonlReader", "CsvReader",
           "TrainerStateReader", "TensorBoardReader", "VerlLogReader", "HFConsoleReader"]

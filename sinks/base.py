"""Every sink is a small subclass with one method, ``write(batch)``.

Batching, flushing and error isolation live here once: a sink that fails never takes
the others (or the pipeline) down; its failure is counted and reported.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from abc import ABC, abstractmethod
from pathlib import Path

log = logging.getLogger("trainguard.sinks")


class Sink(ABC):
    name = "sink"
    # The TRAINGUARD_* variables the sink's ``from_env`` reads (each named in trainguard/settings.py).
    settings: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.written = 0
        self.failed = 0

    @abstractmethod
    def write(self, batch: list[dict]) -> None:
        """Deliver a batch of decoded events (alerts, commands, acks)."""

    def close(self, timeout: float = 5.0) -> None:  # noqa: B027  # optional hook: most sinks hold nothing
        # to release; ``timeout``: how long one with a queue may take to deliver it
        """Release resources; pending output is flushed."""

    def advance(self, now: float) -> None:  # noqa: B027  # optional hook: only the paging stage has due output
        """Called by the runner at every poll, with or without events: output that is due by
        ``now`` (the paging stage's digests) goes out."""

    def deliver(self, batch: list[dict]) -> None:
        """Write ``batch``, never raising: failures are logged and counted."""
        if not batch:
            return
        try:
            self.write(batch)
            self.written += len(batch)
        except Exception as exc:
            self.failed += len(batch)
            log.error("trainguard: sink %s failed on %d events: %s", self.name, len(batch), exc)


# --------------------------------------------------------------------------- what sinks share


def csv_values(text: str | None) -> tuple[str, ...]:
    """A comma-separated setting as its values (``"P0, P1"`` -> ``("P0", "P1")``)."""
    return tuple(v.strip() for v in (text or "").split(",") if v.strip())


def read_state(path: Path | None, what: str) -> dict | None:
    """The JSON state a sink keeps in ``path`` (an outbox, the pager's); None without one, and
    for one that cannot be read (said in the log: the sink starts empty)."""
    if not path or not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.error("trainguard: %s %s unreadable, starting empty: %s", what, path, exc)
        return None


def write_state(path: Path, state) -> None:
    """``state`` as JSON in ``path``, replaced whole (a crash leaves the old file or the new)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(state, default=str))
    os.replace(tmp, path)


_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
SEGMENT_MAX = 120  # a file name holds 255 bytes: room for a report id's suffixes


def safe_segment(name) -> str:
    """``name`` (a run id, a report id: anyone who can write to a topic chooses them) as one
    path segment that stays inside its folder: ``/`` and every character but letters, digits,
    ``_``, ``.`` and ``-`` become ``_``, and leading dots too (no ``..``, no hidden file). A
    name that had to change keeps its readable form and gains ``~`` and a hash of the
    original, so two names never share a folder (a kept name has no ``~``).

    >>> safe_segment("grpo-qwen-7b"), safe_segment("..")[:3], safe_segment("../../x")[:8]
    ('grpo-qwen-7b', '__~', '___.._x~')
    """
    name = str(name)
    clean = _UNSAFE.sub("_", name)
    clean = "_" * (len(clean) - len(clean.lstrip("."))) + clean.lstrip(".")
    if clean == name and 0 < len(name) <= SEGMENT_MAX:
        return name
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{clean[:SEGMENT_MAX - 17]}~{digest}"

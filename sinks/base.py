"""Every sink is a small subclass with one method, ``write(batch)``.

Batching, flushing and error isolation live here once: a sink that fails never takes
the others (or the pipeline) down; its failure is counted and reported.
"""

from __future__ import annotations

import json
import logging
import os
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

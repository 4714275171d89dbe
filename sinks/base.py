"""Every sink is a small subclass with one method, ``write(batch)``.

Batching, flushing and error isolation live here once: a sink that fails never takes
the others (or the pipeline) down; its failure is counted and reported.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

log = logging.getLogger("trainguard.sinks")


class Sink(ABC):
    name = "sink"

    def __init__(self) -> None:
        self.written = 0
        self.failed = 0

    @abstractmethod
    def write(self, batch: list[dict]) -> None:
        """Deliver a batch of decoded events (alerts, commands, acks)."""

    def close(self) -> None:  # noqa: B027  # optional hook: most sinks hold nothing to release
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

"""Stale: a source gone silent (a hung trainer, a dead node), judged by the engine's clock."""

from __future__ import annotations

from .base import Param, Stateful

__all__ = ["Stale"]


class Stale(Stateful):
    """A source that sent nothing for ``timeout_s`` seconds while its run is live.

    Silence has no samples to learn from: ``Engine.tick`` compares each source's last event with
    the clock (``streams/trackers.py``: ``silent_sources``). This class holds the kind's
    parameters, so rules check a ``stale`` detector like any other and the docs list it.

    >>> Stale(timeout_s=120).timeout_s
    120.0
    """

    kind = "stale"
    params = (Param("timeout_s", 300.0, float, "seconds without an event before the source is silent"),)
    cost = "O(sources) per tick, nothing per sample"

    def __init__(self, timeout_s: float = 300.0):
        if not timeout_s > 0:
            raise ValueError("timeout_s must be > 0")
        self.timeout_s = float(timeout_s)

"""How a guard tells trainguard what it decided: metrics events from a source of kind ``guard``.

A guard takes the trainer's :class:`~trainguard.producers.trainer.TrainerLogger` (or None: then
it only counts). Its events share the logger's producer (no second connection, the same
never-blocking queue) but come from their own source, ``guard:<host>:<rank>:-``, so they do not
count as trainer steps for the worker's breaker or its staleness rule. Decisions go out at once;
counts alone at most every ``interval_s`` (a gate called per prompt must not send per prompt).
"""

from __future__ import annotations

import logging
import time

from trainguard.producers.trainer import TrainerLogger

log = logging.getLogger("trainguard.guards")

MAX_REASON = 200


class GuardEvents:
    def __init__(self, logger: TrainerLogger | None, guard: str, *, interval_s: float = 10.0):
        self.guard = guard
        self.interval_s = interval_s
        self.last_step = 0
        self._last_sent = float("-inf")
        self._out: TrainerLogger | None = None
        if logger is not None:
            try:
                src = logger.source
                self._out = TrainerLogger(logger.run_id, logger.settings, host=src["host"], rank=src["rank"],
                                          kind="guard", publisher=logger.publisher)
            except Exception as exc:  # a guard goes on counting without its events, never raises
                log.warning("trainguard: guard %s publishes nothing: %s: %s", guard, type(exc).__name__, exc)

    def step(self, step: int | None) -> int:
        """The step to report: the one given, else the last one seen."""
        if type(step) is int and step >= 0:
            self.last_step = step
        return self.last_step

    def report(self, counts: dict[str, float], *, step: int | None = None, decision: str | None = None,
               reason: str | None = None) -> bool:
        """Publish ``counts`` (names under ``guard/``); True if an event was queued. Never raises."""
        step = self.step(step)
        if self._out is None:
            return False
        now = time.monotonic()
        if decision is None and now - self._last_sent < self.interval_s:
            return False
        try:
            tags = {"guard": self.guard}
            if decision is not None:
                tags["decision"] = decision
            if reason:
                tags["reason"] = reason[:MAX_REASON]
            queued = self._out.log(counts, step, tags=tags)
            self._last_sent = now
            return queued
        except Exception as exc:  # the training loop never pays for trainguard
            log.debug("trainguard: guard %s could not report: %s", self.guard, exc)
            return False

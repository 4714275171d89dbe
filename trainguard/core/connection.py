"""What a long-running Kafka client says when the broker goes away and comes back.

librdkafka reports every failed connection attempt, and retries every few hundred
milliseconds: printed as they come, an outage of twenty seconds filled a terminal with hundreds
of lines and hid what mattered. A client that runs for hours (the sinks, ``trainguard tail``,
the run page) hands its errors to a :class:`ConnectionNews` instead: one line when the broker
is confirmed out of reach, the errors counted while it is, one line when it answers again.
The trainer's producer says its own two lines (``trainguard.core.publisher``).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable

log = logging.getLogger("trainguard.kafka")

# librdkafka error names that mean "the cluster is out of reach", not a problem with a request.
UNREACHABLE = frozenset({"_TRANSPORT", "_ALL_BROKERS_DOWN", "_RESOLVE", "_TIMED_OUT"})


class ConnectionNews:
    """Turns a client's error callbacks into one line per outage and one when it ends.

    ``on_error`` is the client's ``error_cb``: it only counts and notes (it runs inside the
    client's poll, on the caller's thread). The owner calls :meth:`check` from its loop with a
    probe (a cheap request to the broker): while an error is unexplained, the probe runs at most
    every ``probe_every_s``; a failing probe confirms the outage, which is said once; the first
    probe that answers ends it, said with how long it lasted and how many errors came meanwhile.
    An error that a probe at once answers (an idle connection the broker closed) says nothing."""

    def __init__(self, who: str, bootstrap: str, say: Callable[[str], None] | None = None, *,
                 probe_every_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.who = who
        self.bootstrap = bootstrap
        self.say = say or (lambda line: log.warning("%s", line))
        self.probe_every_s = probe_every_s
        self.clock = clock
        self.errors = 0                        # connection errors since the last outage ended
        self.outages = 0                       # outages said, in all
        self.suspect_since: float | None = None  # an error came that no probe has answered yet
        self.down_since: float | None = None     # the outage said, from its first error
        self._cause = ""
        self._probed = -math.inf
        self._said: set[str] = set()           # other kinds of error, each said once

    # -- librdkafka's callback: counts and notes, nothing else ---------------------------------

    def on_error(self, err) -> None:
        try:
            name, text = err.name(), err.str()
        except AttributeError:  # an exception passed on by the owner
            name, text = type(err).__name__, str(err)
        if name in UNREACHABLE:
            self.errors += 1
            if self.suspect_since is None:
                self.suspect_since = self.clock()
                self._cause = text
            return
        if name not in self._said:  # a credential refused, a topic not allowed ...: each kind once
            self._said.add(name)
            self.say(f"{self.who}: Kafka client problem at {self.bootstrap}: {_short(text)} (further ones of this "
                     f"kind are not shown)")

    # -- the owner's loop -----------------------------------------------------------------------

    @property
    def suspect(self) -> bool:
        """An error came and no probe has answered since: what was fetched may be stale."""
        return self.suspect_since is not None

    def check(self, probe: Callable[[], Any]) -> Any:
        """While an error is unexplained, ``probe()`` when due: its result once the broker answered
        (the outage, if one was said, ends), None while it does not or when nothing was due."""
        if self.suspect_since is None or self.clock() - self._probed < self.probe_every_s:
            return None
        self._probed = self.clock()
        try:
            result = probe()
        except Exception as exc:
            self.failed(exc)
            return None
        self.answered()
        return result

    def failed(self, exc: BaseException | None = None) -> None:
        """A probe failed: the outage is real. Said once, with the first error's cause."""
        if self.suspect_since is None:
            self.suspect_since = self.clock()
        if self.down_since is not None:
            return
        self.down_since = self.suspect_since
        self.outages += 1
        cause = self._cause or (str(exc) if exc is not None else "no answer")
        self.say(f"{self.who}: cannot reach Kafka at {self.bootstrap} ({_short(cause)}); retrying every "
                 f"{self.probe_every_s:.0f} s, further connection errors counted, not shown. Is the broker "
                 f"running (`trainguard broker`), or TRAINGUARD_BOOTSTRAP naming your cluster?")

    def answered(self) -> bool:
        """The broker answered: an outage said ends here (True), said with its length and count."""
        ended = self.down_since is not None
        if ended:
            assert self.down_since is not None
            self.say(f"{self.who}: reconnected to Kafka at {self.bootstrap} after "
                     f"{self.clock() - self.down_since:.0f} s ({self.errors} connection error(s) while it was away)")
        self.suspect_since = self.down_since = None
        self.errors = 0
        self._cause = ""
        return ended


def _short(cause: str, limit: int = 160) -> str:
    """librdkafka's error text without the prefixes naming the connection (``GroupCoordinator: ``,
    ``host:port/id: ``), bounded."""
    while True:
        head, sep, rest = cause.partition(": ")
        if not (sep and rest and " " not in head and (":" in head or "/" in head or head.isalpha())):
            break
        cause = rest
    return cause if len(cause) <= limit else cause[:limit] + "..."

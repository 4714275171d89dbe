"""The trainer side's one guard against trainguard's own failures: the training loop must never
crash because of us. :class:`never_raises` is a decorator of a method (the call returns
``fallback`` instead of raising) and a context manager (the block is left, the code after it
runs)::

    @never_raises("log() failed", fallback=False)
    def log(self, metrics, step): ...

    with never_raises("checkpoint report failed", owner=backend):
        backend.checkpoint_saved(step, folder_of(trainer))

The failure goes to the owner's ``_failed(what, exc)`` (the decorated method's ``self``, or
``owner=``), which counts it and says it; without one it is logged. Only ``Exception`` is
kept back: Ctrl-C and ``SystemExit`` are the user's, and an integration's own signal to leave
the loop (``StopTraining``) is raised outside these guards.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, TypeVar

log = logging.getLogger("trainguard.trainer")

F = TypeVar("F", bound=Callable[..., Any])


def report_failure(owner: Any, what: str, exc: BaseException) -> None:
    """``owner._failed(what, exc)`` where the owner counts its failures, else a warning."""
    failed = getattr(owner, "_failed", None)
    if failed is not None:
        failed(what, exc)
    else:
        log.warning("trainguard: %s (training continues): %s: %s", what, type(exc).__name__, exc)


class never_raises:  # lower case: used as a decorator and in `with`, like contextlib's helpers
    def __init__(self, what: str, fallback: Any = None, *, owner: Any = None):
        self.what = what
        self.fallback = fallback
        self.owner = owner

    def __call__(self, method: F) -> F:
        @functools.wraps(method)
        def guarded(*args, **kwargs):
            try:
                return method(*args, **kwargs)
            except Exception as exc:
                report_failure(self.owner if self.owner is not None else (args[0] if args else None), self.what, exc)
                return self.fallback

        return guarded  # type: ignore[return-value]  # same signature as ``method``

    def __enter__(self) -> "never_raises":
        return self

    def __exit__(self, exc_type, exc, _tb) -> bool:
        if exc_type is None or not issubclass(exc_type, Exception):
            return False
        report_failure(self.owner, self.what, exc)
        return True

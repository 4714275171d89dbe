"""A circuit breaker for any component the training loop calls (a reward model, a verifier, a
sandbox): a call that hangs or fails is abandoned after ``timeout_s`` and answered by a
fallback; after ``failure_threshold`` failures in a row the breaker opens and the component is
not called at all; a health probe (or, without one, a trial call after ``reset_after_s``) lets
one call through half-open, and a success closes it again.

>>> breaker = CircuitBreaker(score, name="reward_model", timeout_s=30,     # doctest: +SKIP
...                          failure_threshold=3, fallback=0.0)
>>> breaker(batch)   # doctest: +SKIP

``breaker(batch)`` is ``score(batch)``, or 0.0 when it hung for 30 s, failed, or the breaker is
open. Calls run on a daemon thread of the breaker's, so a hung call cannot hang the loop or the
process's exit; its thread is left to finish on its own. At most ``max_abandoned`` (16)
abandoned calls may still be running: past that the component is not called, not even by a
trial or a probe (the fallback answers), until one of them returns: a component whose calls
never return costs 16 idle threads, not one per call. A component that hangs while holding the GIL (a C extension that
never releases it) hangs every thread; run such a component in a process of its own.

For TRL: :func:`trl_reward_func`; for verl: :func:`verl_compute_score` (``docs/guards.md``).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from typing import Any, Callable, cast

from trainguard.producers.guards._events import GuardEvents
from trainguard.producers.trainer import TrainerLogger

log = logging.getLogger("trainguard.guards")

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_VALUE = {CLOSED: 0.0, HALF_OPEN: 0.5, OPEN: 1.0}


class CallTimeout(TimeoutError):
    """The component did not answer within the breaker's ``timeout_s``."""


class _Runner:
    """One daemon thread running calls one at a time; abandoned when a call outlives its timeout."""

    def __init__(self, name: str):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=f"trainguard-guard-{name}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            fn, args, kwargs, box, done = job
            try:
                box.append((True, fn(*args, **kwargs)))
            except BaseException as exc:  # noqa: B036  (handed to the caller, which decides)
                box.append((False, exc))
            done.set()

    def run(self, fn, args, kwargs, timeout: float):
        box: list = []
        done = threading.Event()
        self.jobs.put((fn, args, kwargs, box, done))
        if not done.wait(timeout):
            self.jobs.put(None)  # the thread ends once the hung call returns, if it ever does
            raise CallTimeout(f"no answer within {timeout:g} s")
        ok, value = box[0]
        if ok:
            return value
        raise value


class CircuitBreaker:
    """Wrap ``fn``; call the breaker as you would call ``fn``.

    ``fallback``: a callable taking ``fn``'s arguments, or a fixed value (None: raise
    :class:`BreakerOpen` instead). ``probe``: a health check run in the background every
    ``probe_interval_s`` while the breaker is open (a callable returning truthy when healthy,
    within ``timeout_s``); when it passes, the breaker goes half-open. Without a probe, the
    breaker goes half-open ``reset_after_s`` after it opened. Half-open, one call goes through:
    a success closes the breaker, a failure opens it again. ``failure_types``: the exceptions
    that count as the component failing (others propagate: a bug in the caller's arguments
    is not an outage).
    """

    def __init__(self, fn: Callable, *, name: str | None = None, timeout_s: float = 30.0, failure_threshold: int = 3,
                 fallback: Any = None, probe: Callable[[], Any] | None = None, probe_interval_s: float = 10.0,
                 reset_after_s: float = 60.0, max_abandoned: int = 16,
                 failure_types: tuple[type[BaseException], ...] = (Exception,),
                 events: TrainerLogger | None = None, clock: Callable[[], float] = time.monotonic):
        if not callable(fn):
            raise TypeError(f"the component must be callable, got {type(fn).__name__}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        if type(failure_threshold) is not int or failure_threshold < 1:
            raise ValueError(f"failure_threshold must be an int >= 1, got {failure_threshold!r}")
        self.fn = fn
        self.name: str = name or getattr(fn, "__name__", None) or type(fn).__name__
        self.timeout_s, self.failure_threshold = float(timeout_s), failure_threshold
        self.fallback, self.probe = fallback, probe
        self.probe_interval_s, self.reset_after_s = probe_interval_s, reset_after_s
        self.max_abandoned, self.failure_types, self.clock = max_abandoned, failure_types, clock
        self.state = CLOSED
        self.consecutive_failures = 0
        self.last_error = ""
        self._opened_at = 0.0
        self._trial = False            # a half-open trial call is running
        self._runner: _Runner | None = None
        self._abandoned: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._probe_thread: threading.Thread | None = None
        self._closed_event = threading.Event()
        self.events = GuardEvents(events, str(self.name))
        self.prefix = f"guard/breaker/{self.name}/"
        self.counts = {self.prefix + k: 0.0 for k in
                       ("calls", "successes", "failures", "timeouts", "fallbacks", "short_circuited", "opened",
                        "closed")}

    # -- the call -------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        return self.call(*args, **kwargs)

    def at_step(self, step: int | None) -> "CircuitBreaker":
        """The training step the next calls belong to (for the events)."""
        self.events.step(step)
        return self

    def call(self, *args, **kwargs):
        """``fn(*args, **kwargs)`` through the breaker."""
        self.counts[self.prefix + "calls"] += 1
        with self._lock:
            allowed = self._allow()
        if not allowed:
            self.counts[self.prefix + "short_circuited"] += 1
            return self._fall_back(args, kwargs, "open")
        try:
            value = self._run(self.fn, args, kwargs)
        except CallTimeout as exc:
            self.counts[self.prefix + "timeouts"] += 1
            self._failed(f"timeout: {exc}")
            return self._fall_back(args, kwargs, "timeout")
        except self.failure_types as exc:
            self._failed(f"{type(exc).__name__}: {exc}")
            return self._fall_back(args, kwargs, "error")
        except BaseException:
            with self._lock:
                self._trial = False
            raise
        self._succeeded()
        return value

    def _allow(self) -> bool:
        self._reap()
        if len(self._abandoned) >= self.max_abandoned:
            return False
        if self.state == CLOSED:
            return True
        if self.state == OPEN and self.probe is None and self.clock() - self._opened_at >= self.reset_after_s:
            self._transition(HALF_OPEN, "the component was not called for reset_after_s: one trial call")
        if self.state == HALF_OPEN and not self._trial:
            self._trial = True
            return True
        return False

    def _run(self, fn, args, kwargs):
        if self._runner is None:
            self._runner = _Runner(self.name)
        runner = self._runner
        try:
            return runner.run(fn, args, kwargs, self.timeout_s)
        except CallTimeout:
            with self._lock:
                self._abandoned.append(runner.thread)
                if self._runner is runner:
                    self._runner = None
            raise

    def _reap(self) -> None:
        self._abandoned = [t for t in self._abandoned if t.is_alive()]

    def _fall_back(self, args, kwargs, why: str):
        self.counts[self.prefix + "fallbacks"] += 1
        self._report()
        fallback = self.fallback
        if fallback is None:
            raise BreakerOpen(f"{self.name}: {why} ({self.state}); last error: {self.last_error}")
        return fallback(*args, **kwargs) if callable(fallback) else fallback

    def _succeeded(self) -> None:
        self.counts[self.prefix + "successes"] += 1
        with self._lock:
            self.consecutive_failures = 0
            self._trial = False
            if self.state != CLOSED:
                self._transition(CLOSED, "a call succeeded")
                return
        self._report()

    def _failed(self, error: str) -> None:
        self.counts[self.prefix + "failures"] += 1
        with self._lock:
            self.last_error = error
            self.consecutive_failures += 1
            self._trial = False
            tripped = self.state == CLOSED and self.consecutive_failures >= self.failure_threshold
            if self.state == HALF_OPEN or tripped:
                self._opened_at = self.clock()
                self._transition(OPEN, f"{self.consecutive_failures} failure(s) in a row, the last: {error}")

    # -- states and the probe ------------------------------------------------------------------

    def _transition(self, state: str, reason: str) -> None:
        """Called with the lock held."""
        before, self.state = self.state, state
        if state == OPEN:
            self.counts[self.prefix + "opened"] += 1
            self._closed_event.clear()
            if self.probe is not None and (self._probe_thread is None or not self._probe_thread.is_alive()):
                self._probe_thread = threading.Thread(target=self._probe_loop, daemon=True,
                                                      name=f"trainguard-probe-{self.name}")
                self._probe_thread.start()
        elif state == CLOSED:
            self.counts[self.prefix + "closed"] += 1
            self._closed_event.set()
        (log.warning if state == OPEN else log.info)("trainguard: breaker %s %s -> %s: %s", self.name, before,
                                                     state, reason)
        self._report(decision=state, reason=reason)

    def _probe_loop(self) -> None:
        """While open: run the probe every probe_interval_s; healthy -> half-open."""
        probe = self.probe
        assert probe is not None
        while not self._closed_event.wait(self.probe_interval_s):
            with self._lock:
                if self.state != OPEN:
                    return
            try:
                healthy = bool(self._run(probe, (), {}))
            except BaseException as exc:  # noqa: B036  (a probe failing is what it is for)
                healthy, self.last_error = False, f"probe: {type(exc).__name__}: {exc}"
            if healthy:
                with self._lock:
                    if self.state == OPEN:
                        self._transition(HALF_OPEN, "the health probe passed: one trial call")
                return

    def _report(self, *, decision: str | None = None, reason: str | None = None) -> None:
        self.events.report({**self.counts, self.prefix + "state": STATE_VALUE[self.state]}, decision=decision,
                           reason=reason)

    def metrics(self) -> dict[str, float]:
        """The counts and the state (0 closed, 0.5 half-open, 1 open), as published."""
        return {**self.counts, self.prefix + "state": STATE_VALUE[self.state]}


class BreakerOpen(RuntimeError):
    """No fallback was given and the component could not answer."""


# ------------------------------------------------------------------------------ fallbacks


class ScoreCache:
    """Scores of recent samples, to answer for a component that cannot: the mean score of the
    recent samples similar to the one asked about (MinHash LSH over the last ``size``), else
    ``default`` (None: the mean of all recent scores; 0.0 before any)."""

    def __init__(self, *, size: int = 1000, threshold: float = 0.7, default: float | None = None):
        from trainguard.producers.guards.dedup import SimilarTexts

        self.index = SimilarTexts(threshold=threshold, capacity=size)
        self.default = default
        self._sum = 0.0
        self.hits = self.misses = 0

    def add(self, text: str, score) -> None:
        try:
            score = float(score)
        except (TypeError, ValueError):
            return
        if not math.isfinite(score):
            return  # a NaN must not answer for anyone
        if len(self.index) >= self.index.capacity:
            self._sum -= self.index.oldest()
        self.index.add(self.index.hash(text), score)
        self._sum += score

    def lookup(self, text: str) -> float:
        scores = self.index.similar(self.index.hash(text)) if len(self.index) else []
        if scores:
            self.hits += 1
            return sum(cast("list[float]", scores)) / len(scores)
        self.misses += 1
        if self.default is not None:
            return self.default
        return self._sum / len(self.index) if len(self.index) else 0.0


_FALLBACK = object()  # the wrappers' fallback: they answer per sample themselves


def _text(x) -> str:
    """A prompt or completion as text: TRL's conversational form is a list of messages."""
    if isinstance(x, str):
        return x
    if isinstance(x, list):
        return "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in x)
    return str(x)


# ------------------------------------------------------------------------------ TRL


class GuardedRewardFunc:
    """A TRL reward function (``reward_funcs=[...]`` of ``GRPOTrainer``, ``RLOOTrainer``...)
    behind a circuit breaker. TRL calls it as ``f(prompts=, completions=, completion_ids=,
    **dataset_columns, trainer_state=, ...)`` and expects one float (or None) per completion;
    it names the function in its logs (``rewards/<name>/mean``) by ``__name__``, which this
    object carries over from ``fn``. While the component cannot answer, each completion gets
    the score of recent similar prompts (:class:`ScoreCache`), or ``fallback`` when given."""

    def __init__(self, fn: Callable, *, cache: ScoreCache | None = None, fallback: float | None = None,
                 **breaker_options):
        from trl.trainer.utils import is_async_callable  # fails loudly on a TRL without it

        if is_async_callable(fn):
            raise TypeError("an async reward function runs in TRL's event loop; wrap a synchronous one")
        self.fn = fn
        self.__name__ = _trl_name(fn)
        self.cache = cache if cache is not None else ScoreCache()
        self._fixed = fallback
        breaker_options.setdefault("name", self.__name__)
        self.breaker = CircuitBreaker(fn, fallback=_FALLBACK, **breaker_options)

    def __call__(self, prompts, completions, **kwargs) -> list:
        self.breaker.at_step(getattr(kwargs.get("trainer_state"), "global_step", None))
        scores = self.breaker.call(prompts=prompts, completions=completions, **kwargs)
        if scores is _FALLBACK:
            if self._fixed is not None:
                return [self._fixed] * len(completions)
            return [self.cache.lookup(_text(p)) for p in prompts]
        for p, s in zip(prompts, scores, strict=False):  # a wrong length is TRL's to report
            self.cache.add(_text(p), s)
        return scores


def _trl_name(fn) -> str:
    try:
        from trl.trainer.utils import get_callable_name

        return get_callable_name(fn)
    except ImportError:
        return getattr(fn, "__name__", type(fn).__name__)


def trl_reward_func(fn: Callable, **options) -> GuardedRewardFunc:
    """``GRPOTrainer(reward_funcs=[trl_reward_func(my_reward, timeout_s=30)])``."""
    return GuardedRewardFunc(fn, **options)


# ------------------------------------------------------------------------------ verl


class GuardedComputeScore:
    """verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw)``
    (what its reward managers call per sample; a ``custom_reward_function`` in the config) behind
    a circuit breaker. While the scorer cannot answer, a sample gets the mean score of recent
    samples of similar problems (keyed by data source and ground truth), or ``fallback``."""

    def __init__(self, fn: Callable, *, cache: ScoreCache | None = None, fallback: float | None = None,
                 **breaker_options):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.cache = cache if cache is not None else ScoreCache()
        self._fixed = fallback
        breaker_options.setdefault("name", self.__name__)
        self.breaker = CircuitBreaker(fn, fallback=_FALLBACK, **breaker_options)

    def __call__(self, data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        key = f"{data_source}\n{ground_truth}"
        score = self.breaker.call(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                                  extra_info=extra_info, **kwargs)
        if score is _FALLBACK:
            return self._fixed if self._fixed is not None else self.cache.lookup(key)
        self.cache.add(key, score["score"] if isinstance(score, dict) else score)
        return score


def verl_compute_score(fn: Callable, **options) -> GuardedComputeScore:
    """In the file a verl config names as ``custom_reward_function.path``:
    ``compute_score = verl_compute_score(my_score, timeout_s=30)``."""
    return GuardedComputeScore(fn, **options)

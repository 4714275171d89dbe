"""The circuit breaker: turn consecutive critical steps into one control command.

Pure decisions, no I/O. After ``consecutive_critical`` critical steps in a row (3 in the
seed) it asks for a rollback to the newest *safe* checkpoint: saved before the incident's
onset (its first critical step, or the first warning still open on the same metrics when
that came earlier), while no P0/P1 alert was open, and (optionally) at least
``rollback_min_steps_before_onset`` steps before it. It asks to skip the batches that led
into the failure (``skip_batches``: a number, or ``auto`` for the ones between the
checkpoint and the last critical step). With no safe checkpoint or with more than
``max_rollbacks_per_hour`` rollbacks it stops the run instead of looping forever. When the same
incident comes back within ``recurrence_steps`` after a rollback it climbs a bounded ladder
(``ladder``): ``wider_rewinds`` rollbacks each to a healthy checkpoint older than the last one
with twice the skip, then an ``adjust`` (the rules file's ``adjust`` scales, within
``adjust_bounds``) after one more such rollback, and only then a stop. A NaN first asks the
trainer to rerun the step (``rerun_on_nan``): a result that does not reproduce is a transient
(hardware) fault, rolled back plainly; one that does is numeric and goes on the ladder.
It then waits for the trainer to report the rollback (a ``rolled_back`` lifecycle event)
before it counts again, so one incident yields one command, and a replayed event yields
the same command id.

The breaker counts in event time (a replay decides the same); a command is stamped with the
worker's clock (``now``: issued now, expires a TTL later), so a worker catching up on old events
never issues a command born expired. With the worker's key, command ids are keyed MACs of the
stable ids (``ids``): the same across a replay, unpredictable to anyone without the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Callable

from trainguard.schemas.events import ADJUST_LIMITS, command_event, stable_id

ARMED, AWAITING, STOPPED = "armed", "awaiting", "stopped"
RERUN = "rerun"  # waiting for the trainer's verdict on a rerun of the NaN step
# How far before the critical onset a warning on the same metrics may date the incident's start:
# a drift or a spike warns a few steps before it turns critical, not hundreds.
WARNING_LOOKBACK_STEPS = 20

ON_COMMAND_FAILURE = ("rearm", "stop")
RERUN_ON_NAN = ("auto", True, False)
MAX_WIDER_REWINDS = 5
# What a trainer's ``started`` event may say it can apply beyond the basic commands.
ANNOUNCED = ("adjust", "rerun_step")
NUMERIC, HARDWARE = "numeric", "hardware"


def _number(key: str, v, *, integer: bool = False, minimum: float | None = None) -> None:
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok:
        raise ValueError(f"'{key}' must be {'an integer' if integer else 'a number'}, got {v!r}")
    if minimum is not None and v < minimum:
        raise ValueError(f"'{key}' must be >= {minimum}, got {v}")


@dataclass(frozen=True)
class Policy:
    """The breaker's settings (a rules file's ``policy:``), each checked as it is made: a
    ValueError names the setting (``streams/rules.py`` adds the file and line)."""
    consecutive_critical: int = 3
    command_ttl_s: float = 300.0
    skip_batches: int | str = "auto"        # a number, or "auto" (docs/rules.md)
    rollback_min_steps_before_onset: int = 0
    max_rollbacks_per_hour: int = 3
    recurrence_steps: int = 200
    step_sources: tuple[str, ...] = ("trainer",)  # source kinds whose events are the run's steps
    on_command_failure: str = "rearm"       # or "stop": the trainer failed or refused a rollback
    wider_rewinds: int = 1                  # ladder rungs that rewind further, each with twice the skip
    adjust: dict = field(default_factory=lambda: {"lr_scale": 0.5})  # the adjust rung ({}: none)
    adjust_bounds: dict = field(default_factory=lambda: {"lr_scale": [0.1, 1.0], "kl_coef_scale": [1.0, 10.0],
                                                         "clip_range_scale": [0.1, 1.0]})
    rerun_on_nan: bool | str = "auto"       # auto: when the run's trainer announced it can rerun a step

    def __post_init__(self) -> None:
        _number("consecutive_critical", self.consecutive_critical, integer=True, minimum=1)
        _number("command_ttl_s", self.command_ttl_s, minimum=1)
        if self.skip_batches != "auto":
            _number("skip_batches", self.skip_batches, integer=True, minimum=0)
        _number("rollback_min_steps_before_onset", self.rollback_min_steps_before_onset, integer=True, minimum=0)
        _number("max_rollbacks_per_hour", self.max_rollbacks_per_hour, integer=True, minimum=0)
        _number("recurrence_steps", self.recurrence_steps, integer=True, minimum=0)
        if self.on_command_failure not in ON_COMMAND_FAILURE:
            raise ValueError(f"'on_command_failure' must be one of {', '.join(ON_COMMAND_FAILURE)}, "
                             f"got {self.on_command_failure!r}")
        kinds = self.step_sources
        kinds = (kinds,) if isinstance(kinds, str) else kinds
        if not isinstance(kinds, (list, tuple)) or not all(isinstance(k, str) for k in kinds):
            raise ValueError(f"'step_sources' must be a list of source kinds, got {self.step_sources!r}")
        object.__setattr__(self, "step_sources", tuple(kinds))
        _number("wider_rewinds", self.wider_rewinds, integer=True, minimum=0)
        if self.wider_rewinds > MAX_WIDER_REWINDS:
            raise ValueError(f"'wider_rewinds' must be <= {MAX_WIDER_REWINDS}, got {self.wider_rewinds}")
        if self.rerun_on_nan not in RERUN_ON_NAN or (self.rerun_on_nan in (0, 1) and not isinstance(
                self.rerun_on_nan, bool)):
            raise ValueError(f"'rerun_on_nan' must be auto, true or false, got {self.rerun_on_nan!r}")
        object.__setattr__(self, "adjust_bounds", _bounds(self.adjust_bounds))
        object.__setattr__(self, "adjust", _adjust(self.adjust, self.adjust_bounds))

    @property
    def rungs(self) -> int:
        """The recovery ladder's rungs: the rollback, the wider rewinds, the adjust."""
        return 1 + self.wider_rewinds + (1 if self.adjust else 0)

    @classmethod
    def from_settings(cls, settings: dict) -> "Policy":
        """From a rules file's ``policy:`` mapping; a setting it does not know is an error."""
        names = [f.name for f in fields(cls)]
        for key in settings:
            if key not in names:
                raise ValueError(f"unknown policy setting {key!r}; allowed: {', '.join(names)}")
        return cls(**settings)


def _plain_map(key: str, v) -> dict:
    if not isinstance(v, dict):
        raise ValueError(f"'{key}' must be a mapping, got {v!r}")
    return {k: x for k, x in v.items() if k != "__line__"}  # the rules loader's line marks


def _bounds(v) -> dict:
    """``adjust_bounds``: per parameter [low, high], inside the hard limits a trainer enforces."""
    bounds = {}
    for name, pair in _plain_map("adjust_bounds", v).items():
        if name not in ADJUST_LIMITS:
            raise ValueError(f"'adjust_bounds': unknown parameter {name!r}; allowed: {', '.join(ADJUST_LIMITS)}")
        lo, hi = ADJUST_LIMITS[name]
        if (not isinstance(pair, (list, tuple)) or len(pair) != 2
                or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in pair)
                or not lo <= pair[0] <= pair[1] <= hi):
            raise ValueError(f"'adjust_bounds.{name}' must be [low, high] with {lo} <= low <= high <= {hi}, "
                             f"got {pair!r}")
        bounds[name] = [float(pair[0]), float(pair[1])]
    return bounds


def _adjust(v, bounds: dict) -> dict:
    """``adjust``: the scales the adjust rung sends, each inside its ``adjust_bounds``."""
    scales = {}
    for name, x in _plain_map("adjust", v).items():
        if name not in bounds:
            raise ValueError(f"'adjust': {name!r} has no adjust_bounds; bounded: {', '.join(bounds) or 'none'}")
        lo, hi = bounds[name]
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not lo <= x <= hi:
            raise ValueError(f"'adjust.{name}' must be a number in [{lo}, {hi}] (adjust_bounds), got {x!r}")
        scales[name] = float(x)
    return scales


DEFAULTS = Policy()


def _plain(stable: str) -> str:
    return stable


@dataclass
class BreakerState:
    status: str = ARMED
    streak: int = 0
    onset_step: int | None = None
    onset_ts: float | None = None
    last_step: int | None = None
    last_critical: bool = False                          # whether last_step was judged critical
    alert_ids: list[str] = field(default_factory=list)
    rules: list[str] = field(default_factory=list)      # critical rules of the current incident
    command_id: str | None = None
    command_expires: float = 0.0
    attempt: int = 0                                     # rollbacks the run went through
    rollback_ts: list[float] = field(default_factory=list)
    restored_step: int | None = None                     # where the last rollback landed
    last_rules: list[str] = field(default_factory=list)  # the incident behind the last rollback
    began: tuple[int, str] | None = None                 # (step, rule) of the incident's first warning
    immediate: bool = False                              # the incident holds a value that cannot wait (NaN)
    # The recovery ladder so far for the incident that keeps coming back: one entry per rung
    # climbed ({"rung", "action", "step": checkpoint restored, "skip"}); empty for a new incident.
    ladder: list[dict] = field(default_factory=list)
    adjust_id: str | None = None                         # the adjust sent with the last rung
    can: list[str] = field(default_factory=list)         # what the trainer announced it can apply
    verdict: str | None = None                           # numeric | hardware: the last rerun's answer
    suspect: str | None = None                           # the host the NaN step came from
    diagnosis: str = ""                                  # the incident's diagnosis, kept over a rerun
    # The trainer process this state belongs to (its ``started`` event's time): in every command
    # id, so a run started again under the same id (or a restarted trainer, whose listener still
    # reads the old acks) never gets a command that is the copy of one acked before.
    epoch: str | None = None
    saved_step: int | None = None                        # the newest checkpoint reported since a (re)start or rollback

    def to_state(self) -> dict:
        return self.__dict__.copy()

    @classmethod
    def from_state(cls, d: dict) -> "BreakerState":
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in names})  # fields of another release are dropped


@dataclass
class Decision:
    """What the breaker decided and why, for the command and the diagnosis report."""
    command: dict
    why: str
    checkpoint: dict | None
    candidates: list[dict]
    onset: int | None = None       # where the incident began: its first warning, else its first critical step
    then: list[dict] = field(default_factory=list)  # commands that follow it (the ladder's adjust)
    verdict: str | None = None     # numeric | hardware: what a rerun of the NaN step said
    rung: int | None = None        # the recovery ladder's rung this rollback is
    passed_over: int = 0           # checkpoints newer than the target (the candidates list the last 10)


def passed_over(c: dict, onset_step: int, onset_ts: float | None, min_steps_before: int = 0) -> str | None:
    """Why a checkpoint is no target for an incident that began at ``onset_step`` (None: it is one)."""
    if c["step"] >= onset_step or (onset_ts is not None and c["ts"] > onset_ts):
        return "saved after the onset"
    if c.get("refused"):
        return f"the trainer could not load it ({c['refused']})"
    if not c.get("healthy", True):
        return c.get("why") or "saved while a P0/P1 alert was open"
    if c["step"] > onset_step - min_steps_before:
        return f"closer than {min_steps_before} steps to the onset"
    return None


def safe_checkpoint(checkpoints: list[dict], onset_step: int, onset_ts: float | None,
                    min_steps_before: int = 0) -> tuple[dict | None, str]:
    """The newest checkpoint saved before the onset while the run was healthy, and why."""
    best, rejected = None, []
    for c in checkpoints:
        unsafe = passed_over(c, onset_step, onset_ts, min_steps_before)
        if unsafe:
            rejected.append(f"step {c['step']}: {unsafe}")
        elif best is None or c["step"] > best["step"]:
            best = c
    if best is None:
        return None, "no checkpoint was saved before the onset while the run was healthy" + (
            f" ({'; '.join(rejected[-5:])})" if rejected else "")
    return best, (f"newest checkpoint saved before the onset at step {onset_step} while no P0/P1 alert "
                  f"was open: step {best['step']}")


def on_step(state: BreakerState, policy: Policy, *, run_id: str, step: int, ts: float, critical: bool,
            alert_ids: list[str], rules: list[str], checkpoints: list[dict], diagnosis: str,
            immediate: bool = False, now: float | None = None,
            ids: Callable[[str], str] = _plain, began: tuple[int, str] | None = None,
            host: str | None = None, changed: Callable[[int], tuple[int, str] | None] | None = None
            ) -> Decision | None:
    """Feed one trainer step; return a decision (with an unsigned command) when the breaker trips.

    ``immediate``: a critical rule that cannot wait holds (a NaN loss, which the next optimiser
    step turns into NaN weights): with a safe checkpoint the breaker rolls back at once instead
    of after ``consecutive_critical`` steps. Without one it counts as usual, so a run that
    recovers from a one-step NaN by itself is not stopped for it.

    ``began``: the step (and rule) of the earliest alert still open on the critical alerts'
    metrics. The checkpoint must be older than it too: one saved after the warning and before
    the critical step already holds the change.

    ``changed``: asked, with the critical onset, where the critical metrics began to move (a
    change point in their history) when a checkpoint is chosen: one saved during a drift that
    had begun before anything fired already holds it too.

    ``host``: where the step's event came from, named when a rerun says the fault was the hardware's."""
    if state.status == STOPPED:
        return None
    if state.saved_step is not None and step < state.saved_step:
        # Behind a checkpoint the trainer reported: a straggler or a forgery. It counts as the run's
        # next step, so it neither dates the incident back to an older checkpoint nor goes unjudged.
        step = state.saved_step + 1
    if state.status == RERUN:
        if ts <= state.command_expires:
            return None  # the trainer is rerunning the step: its verdict decides
        state.status, state.verdict = ARMED, None  # no verdict in time: decide as before
        return _decide(state, policy, run_id=run_id, step=state.last_step if state.last_step is not None else step,
                       ts=ts, checkpoints=checkpoints, diagnosis=state.diagnosis or diagnosis,
                       now=ts if now is None else now, ids=ids)
    if state.status == AWAITING:
        if ts <= state.command_expires:
            return None
        state.status = ARMED  # the trainer never reported the command: count afresh
        state.streak = 0
    if state.last_step is not None and step == state.last_step:
        # Another event of a step already judged (another rank, a second event of the trainer):
        # it only counts if it makes a healthy step critical.
        if not critical or state.last_critical:
            return None  # (a healthy first judgement reset the streak: this one counts from there)
    state.last_step = step
    state.last_critical = critical
    if not critical:
        state.streak, state.onset_step, state.onset_ts, state.alert_ids, state.rules = 0, None, None, [], []
        state.began, state.immediate = None, False
        return None
    if state.streak == 0:
        state.onset_step, state.onset_ts = step, ts
    assert state.onset_step is not None  # set with the streak's first step
    state.streak += 1
    # one alert naming several metrics (actor/kl_loss and reward/kl_divergence) is one reason
    state.alert_ids += [a for a in dict.fromkeys(alert_ids) if a not in state.alert_ids]
    state.rules += [r for r in rules if r not in state.rules]
    state.immediate = state.immediate or immediate
    if began is not None and (state.began is None or began[0] < state.began[0]):
        state.began = (int(began[0]), str(began[1]))
    if state.streak < policy.consecutive_critical:
        if not immediate or _safe(state, policy, checkpoints)[0] is None:
            return None
    if immediate and _wants_rerun(state, policy) and not _recurred(state, policy):
        state.suspect = host[:256] if isinstance(host, str) and host else None
        return _ask_rerun(state, policy, run_id=run_id, step=step, ts=ts, checkpoints=checkpoints,
                          diagnosis=diagnosis, now=ts if now is None else now, ids=ids)
    return _decide(state, policy, run_id=run_id, step=step, ts=ts, checkpoints=checkpoints, diagnosis=diagnosis,
                   now=ts if now is None else now, ids=ids, changed=changed)


def _safe(state: BreakerState, policy: Policy, checkpoints: list[dict],
          changed: Callable[[int], tuple[int, str] | None] | None = None) -> tuple[dict | None, str, int]:
    """The checkpoint to roll back to: before the critical onset, and before the incident's start
    when it began earlier: the first warning on its metrics, or the change point of their history
    (``changed``), whichever came first. A warning counts only within WARNING_LOOKBACK_STEPS of
    the critical onset (an event stamped with an old step must not choose an old checkpoint), a
    change point within the history kept (HISTORY_POINTS values); neither ever costs the
    rollback: with no checkpoint before it, the next start, then the critical onset decides.
    Returns the target, why, and the onset it was chosen against."""
    onset = state.onset_step
    assert onset is not None
    min_before = policy.rollback_min_steps_before_onset
    critical = safe_checkpoint(checkpoints, onset, state.onset_ts, min_before)
    moved = changed(onset) if changed is not None else None
    # the earliest first; a warning before a change point of the same step (it names the rule)
    starts = [s for s in (_earlier_warning(state), moved) if s is not None and s[0] < onset]
    for began, what in sorted(starts, key=lambda s: s[0]):
        target, why = safe_checkpoint(checkpoints, began, None, min_before)
        if target is not None:
            return target, why + (f" (the change began with {what} at step {began}, before the critical "
                                  f"step {onset})"), began
    return critical[0], critical[1], onset


def _earlier_warning(state: BreakerState) -> tuple[int, str] | None:
    began, onset = state.began, state.onset_step
    if began is None or onset is None or not onset - WARNING_LOOKBACK_STEPS <= began[0] < onset:
        return None
    return int(began[0]), str(began[1])


def _furthest(checkpoints: list[dict]) -> float:
    """The furthest step the trainer's own checkpoints vouch for: two of its checkpoint intervals
    past the newest. An event stamped with a later step (10**15) is no proof that the run got there,
    so the batches an ``auto`` skip names stop here (the loop draws every one of them). Without a
    known interval (one checkpoint, at step 0) there is no bound."""
    steps = sorted({int(c["step"]) for c in checkpoints} | {0})
    interval = max((b - a for a, b in zip(steps, steps[1:], strict=False)), default=0)
    return steps[-1] + 2 * interval if interval > 0 else math.inf


def _recurred(state: BreakerState, policy: Policy) -> bool:
    """Whether the incident is the one the last rollback was for, back within recurrence_steps: the
    same rule again, or any NaN/Inf (a run rolled back for a KL explosion that turns NaN got worse)."""
    return bool(state.restored_step is not None and state.onset_step is not None and state.last_rules
                and (set(state.rules) & set(state.last_rules) or state.immediate)
                and state.onset_step - state.restored_step <= policy.recurrence_steps)


def _wants_rerun(state: BreakerState, policy: Policy) -> bool:
    if policy.rerun_on_nan == "auto":
        return "rerun_step" in state.can
    return policy.rerun_on_nan is True


def _checkpoint_at(checkpoints: list[dict], step: int) -> dict | None:
    return next((c for c in reversed(checkpoints) if c["step"] == step and c.get("healthy", True)), None)


def skipping(n: int) -> str:
    """"skipping 1 batch", "skipping 4 batches": how reports and replay say a skip."""
    return f"skipping {n} batch{'' if n == 1 else 'es'}"


def _ladder_skip(policy: Policy, twice: int, step: int, target: dict, checkpoints: list[dict]) -> int:
    """A rung's skip: twice the last one; with ``skip_batches: auto`` also past every batch from the
    rung's checkpoint to the step that failed, and at least twice those (bad data comes in runs of
    consecutive batches: a wider rewind that replays them meets the fault again)."""
    if policy.skip_batches != "auto":
        return twice
    back = max(0, int(min(step, _furthest(checkpoints))) - int(target["step"]))
    return max(twice + back, 2 * back)


def _climb(state: BreakerState, policy: Policy, checkpoints: list[dict], step: int
           ) -> tuple[int, dict | None, int, bool, str]:
    """The next rung for an incident that came back: (rung, target, skip, with adjust, why)."""
    assert state.restored_step is not None and state.onset_step is not None
    again = ", ".join(sorted(set(state.rules) & set(state.last_rules)))
    came = (f"the same incident ({again}) came back at step {state.onset_step}, "
            f"{state.onset_step - state.restored_step} steps after the rollback to step {state.restored_step}")
    # A state saved before the ladder existed knows only where the last rollback landed.
    last = state.ladder[-1] if state.ladder else {"rung": 1, "step": state.restored_step,
                                                  "skip": max(0, step - state.restored_step)}
    rung = int(last["rung"]) + 1
    if rung > policy.rungs:
        return rung, None, 0, False, (f"{came}; the recovery ladder's {policy.rungs} rung(s) are spent: "
                                      f"rolling back again would loop")
    twice = 2 * max(1, int(last.get("skip") or 0))
    adjust = bool(policy.adjust) and rung == policy.rungs
    if not adjust:
        older, _ = safe_checkpoint(checkpoints, int(last["step"]), None)
        if older is not None:
            skip = _ladder_skip(policy, twice, step, older, checkpoints)
            return rung, older, skip, False, (f"rung {rung} of {policy.rungs}: wider rewind to step "
                                              f"{older['step']}, {skipping(skip)}, because {came}")
        if not policy.adjust:
            return rung, None, 0, False, (f"{came}, and no healthy checkpoint is older than step {last['step']}: "
                                          f"rolling back again would loop")
        rung, adjust = policy.rungs, True  # nothing older to rewind to: on to the adjust
    target = _checkpoint_at(checkpoints, int(last["step"])) or safe_checkpoint(checkpoints, int(last["step"]), None)[0]
    if target is None:
        return rung, None, 0, False, f"{came}, and the checkpoint of step {last['step']} is gone: stopping"
    skip = _ladder_skip(policy, twice, step, target, checkpoints)
    if state.epoch is not None and "adjust" not in state.can:  # it said what it applies: no adjust
        return rung, target, skip, False, (f"rung {rung} of {policy.rungs}: rollback to step {target['step']}, "
                                           f"{skipping(skip)} (its trainer applies no adjust), because {came}")
    scales = ", ".join(f"{k} {v:g}" for k, v in policy.adjust.items())
    return rung, target, skip, True, (f"rung {rung} of {policy.rungs}: adjust ({scales}) and rewind to step "
                                      f"{target['step']}, {skipping(skip)}, because {came}")


def recent_rollbacks(state: BreakerState, ts: float) -> list[float]:
    """The run's rollbacks within the hour before ``ts`` (what ``max_rollbacks_per_hour`` counts)."""
    return [t for t in state.rollback_ts if ts - t < 3600]


def _decide(state: BreakerState, policy: Policy, *, run_id, step, ts, checkpoints, diagnosis, now,
            ids, changed: Callable[[int], tuple[int, str] | None] | None = None) -> Decision:
    onset = state.onset_step
    assert onset is not None  # on_step set it with the streak's first step
    recent = recent_rollbacks(state, ts)
    target, why, began = _safe(state, policy, checkpoints, changed)
    verdict, state.verdict = state.verdict, None
    rung, skip, adjust = 1, None, False
    if _recurred(state, policy):
        rung, target, skip, adjust, why = _climb(state, policy, checkpoints, step)
    elif target is not None:
        skip = (int(min(step, _furthest(checkpoints))) - target["step"] if policy.skip_batches == "auto"
                else int(policy.skip_batches))
        if verdict == HARDWARE:
            skip = 0  # the same batch came out finite on the rerun: the data is not the cause
        state.ladder = []
        plain = f"rung 1 of {policy.rungs}: rollback to step {target['step']}"
        why = f"{plain}, {skipping(skip)}; {why}" if skip and skip > 0 else f"{plain}; {why}"
    if verdict == HARDWARE:
        why += ("; the rerun did not reproduce the NaN: a transient (hardware) fault"
                + (f" on host {state.suspect}: cordon it" if state.suspect else "")
                + ", so no escalation and no batch skipped (the same batch came out finite)")
    elif verdict == NUMERIC:
        why += "; the rerun reproduced the NaN: numeric (the state and the data), not the hardware"
    if target is not None and len(recent) >= policy.max_rollbacks_per_hour:
        target, why = None, (f"{len(recent)} rollbacks in the last hour reached max_rollbacks_per_hour="
                             f"{policy.max_rollbacks_per_hour}")
    action = "rollback" if target is not None else "stop"
    reason = state.alert_ids[-20:]
    command = command_event(
        run_id, action, command_id=ids(_command_key(state, run_id, action, onset)), issued=now,
        ttl_s=float(policy.command_ttl_s), reason=reason,
        target={"step": target["step"], "path": target["path"]} if target else None,
        skip_batches=skip if target is not None and skip and skip > 0 else None,
        detail=(f"{state.streak} consecutive critical steps from step {onset}" if state.streak > 1 else
                f"a critical step that cannot wait at step {onset}") + f": {diagnosis}. {why}.")
    then: list[dict] = []
    state.adjust_id = None
    if action == "rollback" and adjust:  # after the restore, which loads the checkpoint's learning rates
        then.append(command_event(
            run_id, "adjust", command_id=ids(_command_key(state, run_id, "adjust", onset)), issued=now,
            ttl_s=float(policy.command_ttl_s), reason=reason, params=dict(policy.adjust),
            detail=f"{why}; applied after the rollback to step {target['step'] if target else '?'}"))
        state.adjust_id = then[0]["id"]
    # the newest checkpoints, each newer than the target saying why it was passed over
    candidates = [{**c, "passed_over": passed_over(c, began, None, policy.rollback_min_steps_before_onset)
                   or "the recovery ladder rewinds further back this time"}
                  if target is None or c["step"] > target["step"] else dict(c) for c in checkpoints[-10:]]
    newer = sum(1 for c in checkpoints if target is None or c["step"] > target["step"])
    state.command_id = command["id"]
    state.command_expires = ts + float(policy.command_ttl_s)  # event time: replays wait the same
    if action == "rollback":
        assert target is not None
        state.status = AWAITING
        state.rollback_ts = recent + [ts]
        state.last_rules = list(state.rules)
        state.ladder = (state.ladder + [{"rung": rung, "action": "adjust" if adjust else "rollback",
                                         "step": int(target["step"]), "skip": int(skip or 0)}])[-(policy.rungs + 1):]
    else:
        state.status = STOPPED
    state.streak, state.alert_ids, state.began, state.immediate = 0, [], None, False
    return Decision(command, why, target, candidates, onset=began, then=then, verdict=verdict,
                    rung=rung if action == "rollback" else None, passed_over=newer)


def _ask_rerun(state: BreakerState, policy: Policy, *, run_id, step, ts, checkpoints, diagnosis, now,
               ids) -> Decision:
    """Before rolling back a NaN, ask the trainer to repeat the step on the same batch and seed."""
    onset = state.onset_step
    assert onset is not None
    why = (f"asking the trainer to rerun step {step} on the same batch and seed: a NaN that reproduces is "
           f"numeric (the ladder of rollbacks), one that does not is a transient hardware fault"
           + (f" (host {state.suspect})" if state.suspect else "") + "; the rollback follows the verdict, or "
           f"the command's expiry ({float(policy.command_ttl_s):g} s) without one")
    command = command_event(
        run_id, "rerun_step", command_id=ids(_command_key(state, run_id, "rerun_step", onset)), issued=now,
        ttl_s=float(policy.command_ttl_s), reason=state.alert_ids[-20:], params={"step": int(step)},
        detail=f"a critical step that cannot wait at step {onset}: {diagnosis}. {why}.")
    state.status, state.command_id = RERUN, command["id"]
    state.command_expires = ts + float(policy.command_ttl_s)
    state.diagnosis = diagnosis[:1000]
    return Decision(command, why, None, [c for c in checkpoints][-10:], onset=onset)


def on_rerun_verdict(state: BreakerState, policy: Policy, *, run_id: str, command_id: str, status: str,
                     result: dict | None, ts: float, checkpoints: list[dict], now: float | None = None,
                     ids: Callable[[str], str] = _plain) -> tuple[bool, Decision | None]:
    """The trainer answered the rerun the breaker waits for: ``applied`` with ``result.reproduced``
    labels the incident numeric or hardware; anything else is no verdict. Either way the breaker
    now decides as it would have (a hardware verdict: a plain rollback, no escalation). Returns
    ``(handled, decision)``; not handled when it is not the rerun the breaker waits for."""
    if state.status != RERUN or command_id != state.command_id or state.onset_step is None:
        return False, None
    reproduced = result.get("reproduced") if status == "applied" and isinstance(result, dict) else None
    state.verdict = NUMERIC if reproduced is True else HARDWARE if reproduced is False else None
    if state.verdict == HARDWARE and _recurred(state, policy):
        state.verdict = None  # back at its step after a rollback: that is not a transient fault
    state.status = ARMED
    step = state.last_step if state.last_step is not None else state.onset_step
    return True, _decide(state, policy, run_id=run_id, step=step, ts=ts, checkpoints=checkpoints,
                         diagnosis=state.diagnosis, now=ts if now is None else now, ids=ids)


def _command_key(state: BreakerState, run_id: str, action: str, onset) -> str:
    """A decision's id: the same when a replay decides it again, another for another trainer process."""
    parts = (run_id, action, onset, state.attempt)
    return stable_id(*parts) if state.epoch is None else stable_id(*parts, state.epoch)


def on_started(state: BreakerState, detail: dict | None, ts: float | None = None) -> None:
    """The trainer's ``started`` event: what it says it can apply (``detail.can``), bounded, and
    which trainer process this is (``ts``: the event's time); a restarted trainer may resume from
    any checkpoint, so its steps are not held to the last one."""
    can = (detail or {}).get("can")
    state.can = [c for c in ANNOUNCED if isinstance(can, list) and c in can]
    state.saved_step = None
    if ts is not None:
        state.epoch = repr(ts)


def on_checkpoint(state: BreakerState, step: int) -> None:
    """The trainer reported a checkpoint: the run is past ``step``."""
    state.saved_step = step if state.saved_step is None else max(state.saved_step, step)


def on_command_refused(state: BreakerState, policy: Policy, *, run_id: str, command_id: str, status: str,
                       detail: str, ts: float, now: float | None = None,
                       ids: Callable[[str], str] = _plain) -> tuple[bool, dict | None]:
    """The trainer acked the breaker's command ``failed`` or ``rejected``: without this the run
    would have no breaker until the command expired. Returns ``(handled, stop command or None)``:
    not handled when it is not the command the breaker waits for (an old one, a hand-sent one,
    an ack read twice). ``on_command_failure: rearm`` counts critical steps afresh at once;
    ``stop`` asks the trainer to stop (a rollback it cannot apply will not get better).
    The ladder's ``adjust`` refused: its next rung, a stop, whatever ``on_command_failure`` says."""
    if state.adjust_id is not None and command_id == state.adjust_id and state.status != STOPPED:
        state.adjust_id, state.status = None, STOPPED
        command = command_event(run_id, "stop", command_id=ids(stable_id(run_id, "stop", command_id)),
                                issued=ts if now is None else now, ttl_s=float(policy.command_ttl_s),
                                detail=f"the trainer {status} the adjust {command_id} ({detail}): the recovery "
                                       f"ladder's last rung is a stop")
        state.command_id = command["id"]
        return True, command
    if state.status != AWAITING or command_id != state.command_id:
        return False, None
    if state.ladder:
        state.ladder.pop()  # a rung the trainer did not apply was not climbed
        state.adjust_id = None
    state.streak, state.onset_step, state.onset_ts, state.alert_ids, state.rules = 0, None, None, [], []
    state.last_step, state.began, state.immediate = None, None, False
    if policy.on_command_failure != "stop":
        state.status = ARMED
        return True, None
    state.status = STOPPED
    command = command_event(run_id, "stop", command_id=ids(stable_id(run_id, "stop", command_id)),
                            issued=ts if now is None else now,
                            ttl_s=float(policy.command_ttl_s),
                            detail=f"the trainer {status} command {command_id} ({detail}); on_command_failure is stop")
    state.command_id = command["id"]
    return True, command


def on_rolled_back(state: BreakerState, restored_step: int | None) -> None:
    """The trainer restored a checkpoint: count again from a clean slate."""
    state.status = ARMED
    state.streak, state.onset_step, state.onset_ts, state.last_step = 0, None, None, None
    state.alert_ids, state.rules, state.began, state.immediate = [], [], None, False
    state.attempt += 1
    state.restored_step = restored_step
    state.saved_step = None

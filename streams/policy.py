"""The circuit breaker: turn consecutive critical steps into one control command.

Pure decisions, no I/O. After ``consecutive_critical`` critical steps in a row (3 in the
seed) it asks for a rollback to the newest *safe* checkpoint: saved before the incident's
onset (its first critical step, or the first warning still open on the same metrics when
that came earlier), while no critical alert was open, and (optionally) at least
``rollback_min_steps_before_onset`` steps before it. It asks to skip the batches that led
into the failure (``skip_batches``: a number, or ``auto`` for the ones between the
checkpoint and the last critical step). With no safe checkpoint, with more than
``max_rollbacks_per_hour`` rollbacks, or when the same incident comes back within
``recurrence_steps`` after a rollback, it stops the run instead of looping forever.
It then waits for the trainer to report the rollback (a ``rolled_back`` lifecycle event)
before it counts again, so one incident yields one command, and a replayed event yields
the same command id.

The breaker counts in event time (a replay decides the same); a command is stamped with the
worker's clock (``now``: issued now, expires a TTL later), so a worker catching up on old events
never issues a command born expired. With the worker's key, command ids are keyed MACs of the
stable ids (``ids``): the same across a replay, unpredictable to anyone without the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable

from trainguard.schemas.events import command_event, stable_id

ARMED, AWAITING, STOPPED = "armed", "awaiting", "stopped"
# How far before the critical onset a warning on the same metrics may date the incident's start:
# a drift or a spike warns a few steps before it turns critical, not hundreds.
WARNING_LOOKBACK_STEPS = 20

ON_COMMAND_FAILURE = ("rearm", "stop")


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

    @classmethod
    def from_settings(cls, settings: dict) -> "Policy":
        """From a rules file's ``policy:`` mapping; a setting it does not know is an error."""
        names = [f.name for f in fields(cls)]
        for key in settings:
            if key not in names:
                raise ValueError(f"unknown policy setting {key!r}; allowed: {', '.join(names)}")
        return cls(**settings)


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


def safe_checkpoint(checkpoints: list[dict], onset_step: int, onset_ts: float | None,
                    min_steps_before: int = 0) -> tuple[dict | None, str]:
    """The newest checkpoint saved before the onset while the run was healthy, and why."""
    best, rejected = None, []
    for c in checkpoints:
        if c["step"] >= onset_step or (onset_ts is not None and c["ts"] > onset_ts):
            rejected.append(f"step {c['step']}: saved after the onset")
        elif not c.get("healthy", True):
            rejected.append(f"step {c['step']}: saved while a critical alert was open")
        elif c["step"] > onset_step - min_steps_before:
            rejected.append(f"step {c['step']}: closer than {min_steps_before} steps to the onset")
        elif best is None or c["step"] > best["step"]:
            best = c
    if best is None:
        return None, "no checkpoint was saved before the onset while the run was healthy" + (
            f" ({'; '.join(rejected[-5:])})" if rejected else "")
    return best, (f"newest checkpoint saved before the onset at step {onset_step} while no critical alert "
                  f"was open: step {best['step']}")


def on_step(state: BreakerState, policy: Policy, *, run_id: str, step: int, ts: float, critical: bool,
            alert_ids: list[str], rules: list[str], checkpoints: list[dict], diagnosis: str,
            immediate: bool = False, now: float | None = None,
            ids: Callable[[str], str] = _plain, began: tuple[int, str] | None = None) -> Decision | None:
    """Feed one trainer step; return a decision (with an unsigned command) when the breaker trips.

    ``immediate``: a critical rule that cannot wait holds (a NaN loss, which the next optimiser
    step turns into NaN weights): with a safe checkpoint the breaker rolls back at once instead
    of after ``consecutive_critical`` steps. Without one it counts as usual, so a run that
    recovers from a one-step NaN by itself is not stopped for it.

    ``began``: the step (and rule) of the earliest alert still open on the critical alerts'
    metrics. The checkpoint must be older than it too: one saved after the warning and before
    the critical step already holds the change."""
    if state.status == STOPPED:
        return None
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
        state.began = None
        return None
    if state.streak == 0:
        state.onset_step, state.onset_ts = step, ts
    assert state.onset_step is not None  # set with the streak's first step
    state.streak += 1
    # one alert naming several metrics (actor/kl_loss and reward/kl_divergence) is one reason
    state.alert_ids += [a for a in dict.fromkeys(alert_ids) if a not in state.alert_ids]
    state.rules += [r for r in rules if r not in state.rules]
    if began is not None and (state.began is None or began[0] < state.began[0]):
        state.began = (int(began[0]), str(began[1]))
    if state.streak < policy.consecutive_critical:
        if not immediate or _safe(state, policy, checkpoints)[0] is None:
            return None
    return _decide(state, policy, run_id=run_id, step=step, ts=ts, checkpoints=checkpoints, diagnosis=diagnosis,
                   now=ts if now is None else now, ids=ids)


def _safe(state: BreakerState, policy: Policy, checkpoints: list[dict]) -> tuple[dict | None, str, int]:
    """The checkpoint to roll back to: before the critical onset, and before the first warning
    on its metrics when one came earlier. A warning counts only within WARNING_LOOKBACK_STEPS of
    the critical onset (an event stamped with an old step must not choose an old checkpoint), and
    it never costs the rollback: with no checkpoint before it, the critical onset decides.
    Returns the target, why, and the onset it was chosen against."""
    assert state.onset_step is not None
    min_before = policy.rollback_min_steps_before_onset
    critical = safe_checkpoint(checkpoints, state.onset_step, state.onset_ts, min_before)
    warned = _earlier_warning(state)
    if warned is not None:
        target, why = safe_checkpoint(checkpoints, warned[0], None, min_before)
        if target is not None:
            return target, why + (f" (the change began with {warned[1]} at step {warned[0]}, before the critical "
                                  f"step {state.onset_step})"), warned[0]
    return critical[0], critical[1], state.onset_step


def _earlier_warning(state: BreakerState) -> tuple[int, str] | None:
    began, onset = state.began, state.onset_step
    if began is None or onset is None or not onset - WARNING_LOOKBACK_STEPS <= began[0] < onset:
        return None
    return int(began[0]), str(began[1])


def _decide(state: BreakerState, policy: Policy, *, run_id, step, ts, checkpoints, diagnosis, now,
            ids) -> Decision:
    onset = state.onset_step
    assert onset is not None  # on_step set it with the streak's first step
    recent = [t for t in state.rollback_ts if ts - t < 3600]
    recurred = (state.restored_step is not None and set(state.rules) & set(state.last_rules)
                and onset - state.restored_step <= policy.recurrence_steps)
    target, why, began = _safe(state, policy, checkpoints)
    if recurred:
        assert state.restored_step is not None  # recurred implies it
        target, why = None, (f"the same incident ({', '.join(sorted(set(state.rules) & set(state.last_rules)))}) "
                             f"came back {onset - state.restored_step} steps after the rollback to step "
                             f"{state.restored_step}: rolling back again would loop")
    elif len(recent) >= policy.max_rollbacks_per_hour:
        target, why = None, (f"{len(recent)} rollbacks in the last hour reached max_rollbacks_per_hour="
                             f"{policy.max_rollbacks_per_hour}")
    action = "rollback" if target is not None else "stop"
    skip: int | None = None
    if target is not None:
        skip = step - target["step"] if policy.skip_batches == "auto" else int(policy.skip_batches)
    command = command_event(
        run_id, action, command_id=ids(stable_id(run_id, action, onset, state.attempt)), issued=now,
        ttl_s=float(policy.command_ttl_s), reason=state.alert_ids[-20:],
        target={"step": target["step"], "path": target["path"]} if target else None,
        skip_batches=skip if skip and skip > 0 else None,
        detail=(f"{state.streak} consecutive critical steps from step {onset}" if state.streak > 1 else
                f"a critical step that cannot wait at step {onset}") + f": {diagnosis}. {why}.")
    candidates = [c for c in checkpoints][-10:]
    state.command_id = command["id"]
    state.command_expires = ts + float(policy.command_ttl_s)  # event time: replays wait the same
    if action == "rollback":
        state.status = AWAITING
        state.rollback_ts = recent + [ts]
        state.last_rules = list(state.rules)
    else:
        state.status = STOPPED
    state.streak, state.alert_ids, state.began = 0, [], None
    return Decision(command, why, target, candidates, onset=began)


def on_command_refused(state: BreakerState, policy: Policy, *, run_id: str, command_id: str, status: str,
                       detail: str, ts: float, now: float | None = None,
                       ids: Callable[[str], str] = _plain) -> tuple[bool, dict | None]:
    """The trainer acked the breaker's command ``failed`` or ``rejected``: without this the run
    would have no breaker until the command expired. Returns ``(handled, stop command or None)``:
    not handled when it is not the command the breaker waits for (an old one, a hand-sent one,
    an ack read twice). ``on_command_failure: rearm`` counts critical steps afresh at once;
    ``stop`` asks the trainer to stop (a rollback it cannot apply will not get better)."""
    if state.status != AWAITING or command_id != state.command_id:
        return False, None
    state.streak, state.onset_step, state.onset_ts, state.alert_ids, state.rules = 0, None, None, [], []
    state.last_step, state.began = None, None
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
    state.alert_ids, state.rules, state.began = [], [], None
    state.attempt += 1
    state.restored_step = restored_step

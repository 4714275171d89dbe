"""The circuit breaker: turn consecutive critical steps into one control command.

Pure decisions, no I/O. After ``consecutive_critical`` critical steps in a row (3 in the
seed) it asks for a rollback to the newest checkpoint saved before the anomaly began;
with no such checkpoint it asks the trainer to stop. It then waits for the trainer to
report the rollback (a ``rolled_back`` lifecycle event) before it counts again, so one
incident yields one command, and a replayed event yields the same command id.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

ARMED, AWAITING, STOPPED = "armed", "awaiting", "stopped"


def stable_id(*parts) -> str:
    return hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=10).hexdigest()


@dataclass
class BreakerState:
    status: str = ARMED
    streak: int = 0
    onset_step: int | None = None
    onset_ts: float | None = None
    last_step: int | None = None
    alert_ids: list[str] = field(default_factory=list)
    command_id: str | None = None
    command_expires: float = 0.0
    attempt: int = 0           # how many rollbacks the run went through (part of alert ids)
    rollbacks: int = 0

    def to_state(self) -> dict:
        return self.__dict__.copy()

    @classmethod
    def from_state(cls, d: dict) -> "BreakerState":
        return cls(**d)


def newest_safe_checkpoint(checkpoints: list[dict], onset_step: int, onset_ts: float | None) -> dict | None:
    """The newest checkpoint saved before the anomaly began."""
    best = None
    for c in checkpoints:
        if c["step"] < onset_step and (onset_ts is None or c["ts"] <= onset_ts):
            if best is None or c["step"] > best["step"]:
                best = c
    return best


def on_step(state: BreakerState, policy: dict, *, run_id: str, step: int, ts: float, critical: bool,
            alert_ids: list[str], checkpoints: list[dict], diagnosis: str) -> dict | None:
    """Feed one trainer step; return an unsigned command when the breaker trips."""
    if state.status == STOPPED:
        return None
    if state.status == AWAITING:
        if ts <= state.command_expires:
            return None
        state.status = ARMED  # the trainer never reported the command: count afresh
        state.streak = 0
    if state.last_step is not None and step == state.last_step:
        return None  # another source of the same step: the step was already judged
    state.last_step = step
    if not critical:
        state.streak, state.onset_step, state.onset_ts, state.alert_ids = 0, None, None, []
        return None
    if state.streak == 0:
        state.onset_step, state.onset_ts = step, ts
    state.streak += 1
    for a in alert_ids:
        if a not in state.alert_ids:
            state.alert_ids.append(a)
    if state.streak < int(policy["consecutive_critical"]):
        return None

    target = newest_safe_checkpoint(checkpoints, state.onset_step, state.onset_ts)
    action = "rollback" if target is not None else "stop"
    command = {
        "schema": "command/1",
        "id": stable_id(run_id, action, state.onset_step, state.attempt),
        "run_id": run_id,
        "action": action,
        "target": {"step": target["step"], "path": target["path"]} if target else None,
        "reason": state.alert_ids[-20:],
        "issued": ts,
        "expires": ts + float(policy["command_ttl_s"]),
        "detail": (f"{state.streak} consecutive critical steps from step {state.onset_step}: {diagnosis}"
                   + ("" if target else " No checkpoint was saved before the onset, so the run is stopped.")),
    }
    if action == "rollback" and policy.get("skip_batches"):
        command["skip_batches"] = int(policy["skip_batches"])
    state.command_id = command["id"]
    state.command_expires = command["expires"]
    state.status = AWAITING if action == "rollback" else STOPPED
    state.streak, state.alert_ids = 0, []
    return command


def on_rolled_back(state: BreakerState) -> None:
    """The trainer restored a checkpoint: count again from a clean slate."""
    state.status = ARMED
    state.streak, state.onset_step, state.onset_ts, state.last_step, state.alert_ids = 0, None, None, None, []
    state.attempt += 1
    state.rollbacks += 1

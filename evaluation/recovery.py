#!/usr/bin/env python3
"""Recovery in a closed loop: simulated runs hit by faults the breaker acts on, its commands
applied by the simulated trainer as an integration applies them; ``make eval``'s ``recovery``.

    python evaluation/recovery.py [--seeds N] [--rules FILE]

Each run trains ``STEPS`` steps of :class:`~trainguard.simulator.SimulatedPPO` through a fresh
engine (in process, simulated clock, a worker's tick every simulated second), saving a
checkpoint every ``CHECKPOINT_EVERY`` steps. The trainer says at its start that it can adjust
and rerun a step, and applies what the engine sends: a rollback restores the checkpoint (the
simulator's model and its noise state), reports ``rolled_back`` and acks ``applied``; an
``adjust`` scales its learning rate; a ``rerun_step`` acks whether the NaN reproduced; a stop
ends the run. The faults, from step ``ONSET``:

- ``nan_transient``: a NaN loss that does not come back after a rollback (a transient fault,
  a flipped bit): a rerun does not reproduce it (the "hardware" verdict) and one rollback
  should cure it;
- ``nan_recurring``: a NaN loss that comes back at the same step after any rollback (the
  state and the step, not the data: skipping batches does not help), and reproduces on a
  rerun (numeric). Its model: the step overflows at the run's learning rate, so it clears only
  once an ``adjust`` scales the rate down (``lr_scale`` < 1); a wider rewind alone never cures
  it here (the worst case for the ladder, whose wider rewind only costs steps);
- ``reward_model_hang``: the reward model hangs for ``HANG_STEPS`` steps: the trainer's guard
  breaker (``producers/guards``) times out three calls, opens, scores on its fallback and
  closes when the model answers again; it publishes its state as the guard does. Nothing
  there needs a rollback;
- ``kl_explosion`` and ``grad_norm_explosion``: sudden faults that a rollback cures.

Figures: ``runs``; ``recovered_without_human`` (reached the last step without a stop, the fault
no longer shaping it, and no P0/P1 alert fired in its last 20 steps); ``median_steps_lost``
(steps trained and then undone by rollbacks, plus the steps a stop left untrained);
``rollbacks_per_incident`` (each run is one incident). The simulator has no data, so a
rollback's ``skip_batches`` changes nothing here: a fault that recurs at its step recurs
whatever is skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from trainguard.schemas import events as ev  # noqa: E402
from trainguard.simulator import SimulatedPPO  # noqa: E402
from trainguard.streams import rules as rules_mod  # noqa: E402
from trainguard.streams.engine import Engine  # noqa: E402

STEPS = 200
ONSET = 60
CHECKPOINT_EVERY = 10
HANG_STEPS = 40
CALL_TIMEOUT_S = 30.0   # the guard's timeout per reward call; three in a row open it
QUIET_TAIL = 20         # the last steps that must be free of pages for a run to count as recovered
LOUD = {"P0", "P1"}

# fault -> (simulator fault kind or None, recurs after a rollback)
# faults whose step overflows at the run's learning rate: an adjust with lr_scale < 1 clears them
LR_DRIVEN = {"nan_recurring"}
FAULTS: dict[str, tuple[str | None, bool]] = {
    "nan_transient": ("nan_loss", False),
    "nan_recurring": ("nan_loss", True),
    "reward_model_hang": (None, False),
    "kl_explosion": ("kl_explosion", False),
    "grad_norm_explosion": ("grad_norm_explosion", False),
}


@dataclass
class Outcome:
    fault: str
    seed: int
    last_step: int = 0
    stopped: bool = False
    rollbacks: int = 0
    undone: int = 0                              # steps trained, then undone by rollbacks
    loud: list = field(default_factory=list)     # (step, rule) of each P0/P1 that fired
    commands: list = field(default_factory=list)
    verdicts: list = field(default_factory=list)  # what each rerun said: numeric | hardware
    lr_scale: float = 1.0                        # the product of the adjusts applied
    faulty_at_end: bool = False                  # the simulator's fault still shaping the last step

    @property
    def steps_lost(self) -> int:
        return self.undone + (STEPS - self.last_step if self.stopped else 0)

    @property
    def recovered(self) -> bool:
        return (not self.stopped and self.last_step >= STEPS and not self.faulty_at_end
                and not any(s > STEPS - QUIET_TAIL for s, _ in self.loud))


class GuardedReward:
    """What the trainer's reward-model breaker publishes while the model hangs from ``start``
    for ``HANG_STEPS`` steps: three calls time out (``CALL_TIMEOUT_S`` each, paid by the step),
    the breaker opens and the trainer scores on its fallback; once the model answers again
    the next trial call closes it. State values as ``producers/guards/breaker.py`` reports."""

    def __init__(self, start: int):
        self.start, self.end = start, start + HANG_STEPS
        self.failures = 0

    def step(self, step: int) -> tuple[float, dict | None]:
        """(extra seconds the step took, the guard's metrics to publish or None)."""
        if self.start <= step < self.end:
            if self.failures < 3:
                self.failures += 1
                state = 1.0 if self.failures == 3 else 0.0
                return CALL_TIMEOUT_S, {"guard/breaker/reward_model/state": state,
                                        "guard/breaker/reward_model/timeouts": float(self.failures)}
            return 0.0, None
        if step == self.end and self.failures:
            self.failures = 0
            return 0.0, {"guard/breaker/reward_model/state": 0.0, "guard/breaker/reward_model/closed": 1.0}
        return 0.0, None


def run_one(fault: str, seed: int, rules) -> Outcome:
    kind, recur = FAULTS[fault]
    sim = SimulatedPPO(seed=seed, host=f"rec-{seed}")
    if kind is not None:
        sim.inject(kind, at_step=ONSET, recur=recur)
    guard = GuardedReward(ONSET) if fault == "reward_model_hang" else None
    engine = Engine(rules)
    clock = [sim.ts]
    engine.clock = lambda: clock[0]  # "received at" is simulated time here
    run_id = f"recovery-{fault}-{seed}"
    trainer, node = ev.source("trainer", sim.host, 0), ev.source("node", sim.host)
    guard_src = ev.source("guard", sim.host, 0)
    out = Outcome(fault, seed)
    offset = [0]
    next_tick = math.floor(sim.ts) + 1

    def send(event) -> list:
        outputs = engine.handle(ev.encode(event), 0, offset[0])
        offset[0] += 1
        return outputs

    def ack(command, status, step, result=None) -> list:
        outputs = engine.handle_ack(ev.encode(ev.ack_event(command["id"], run_id, status, step=step, ts=sim.ts,
                                                           result=result)), 0, offset[0])
        offset[0] += 1
        return outputs

    def judge(outputs, step: int) -> list[dict]:
        commands = []
        for o in outputs or ():
            v = getattr(o, "value", None)
            if not isinstance(v, dict):
                continue
            if o.kind == "command":
                commands.append(v)
            elif v.get("status") == "firing" and v.get("severity") in LOUD:
                out.loud.append((step, v.get("rule")))
            if o.kind == "alert" and v.get("rule") == "rerun_verdict" and v.get("status") == "firing":
                out.verdicts.append(v["evidence"]["verdict"])
        return commands

    send(ev.lifecycle_event(run_id, "started", step=0, ts=sim.ts, src=trainer,
                            detail={"can": ["adjust", "rerun_step"]}))

    while sim.current_step < STEPS and not out.stopped:
        extra_s, guard_metrics = guard.step(sim.current_step + 1) if guard else (0.0, None)
        sim.ts += extra_s
        m = sim.step()
        now, step = sim.ts, sim.current_step
        commands = []
        while next_tick <= now:  # the worker's clock: a tick every simulated second
            clock[0] = float(next_tick)
            commands += judge(engine.tick(float(next_tick)), step - 1)
            next_tick += 1
        clock[0] = now
        if m is not None:
            commands += judge(send(ev.metrics_event(run_id, step, m, src=trainer, ts=now)), step)
        if guard_metrics:
            commands += judge(send(ev.metrics_event(run_id, step, guard_metrics, src=guard_src, ts=now)), step)
        commands += judge(send(ev.metrics_event(run_id, step, sim.node_metrics(), src=node, ts=now,
                                                layer="resource")), step)
        if m is not None and step % CHECKPOINT_EVERY == 0:
            send(ev.checkpoint_event(run_id, step, sim.save_checkpoint(), ts=now))
        out.last_step = max(out.last_step, step)
        restored_by = None  # the report of the rollback applied at this boundary
        while commands:  # applied at the step boundary, as the integrations do
            command = commands.pop(0)
            if restored_by is not None and command.get("report") != restored_by:
                continue  # the rest of this step's commands belong to the state it rolled back
            out.commands.append(command["action"])
            if command["action"] == "rollback":
                restored = command["target"]["step"]
                out.undone += step - restored
                sim.restore(restored)
                out.rollbacks += 1
                send(ev.lifecycle_event(run_id, "rolled_back", step=restored, ts=sim.ts, src=trainer,
                                        detail={"command_id": command["id"]}))
                ack(command, "applied", step)
                restored_by = command.get("report")
            elif command["action"] == "adjust":
                scale = float(command["params"].get("lr_scale", 1.0))
                out.lr_scale *= scale
                if scale < 1.0 and fault in LR_DRIVEN:
                    for f in sim.faults:
                        f.active = False  # the step no longer overflows at the lower rate
                ack(command, "applied", step)
            elif command["action"] == "rerun_step":
                # A fault of the state reproduces on the same batch and seed; a transient one does not.
                commands += judge(ack(command, "applied", step, {"reproduced": recur, "step": step}), step)
            elif command["action"] == "stop":
                out.stopped = True
                break
    out.faulty_at_end = any(f.active and sim.current_step >= f.at_step for f in sim.faults)
    return out


def summary(outcomes: list[Outcome]) -> dict:
    if not outcomes:
        return {}
    per_fault: dict[str, dict] = {}
    for o in outcomes:
        f = per_fault.setdefault(o.fault, {"runs": 0, "recovered": 0, "rollbacks": 0, "stops": 0, "adjusts": 0,
                                           "hardware": 0, "numeric": 0, "steps_lost": []})
        f["runs"] += 1
        f["adjusts"] += o.commands.count("adjust")
        f["hardware"] += o.verdicts.count("hardware")
        f["numeric"] += o.verdicts.count("numeric")
        f["recovered"] += o.recovered
        f["rollbacks"] += o.rollbacks
        f["stops"] += o.stopped
        f["steps_lost"].append(o.steps_lost)
    for f in per_fault.values():
        f["median_steps_lost"] = statistics.median(f.pop("steps_lost"))
    return {"runs": len(outcomes), "recovered_without_human": sum(o.recovered for o in outcomes),
            "median_steps_lost": statistics.median(o.steps_lost for o in outcomes),
            "rollbacks_per_incident": round(sum(o.rollbacks for o in outcomes) / len(outcomes), 3),
            "per_fault": per_fault}


def evaluate(seeds: int = 3, rules=None) -> dict:
    rules = rules or rules_mod.default()
    return summary([run_one(fault, seed, rules) for fault in FAULTS for seed in range(seeds)])


def table(result: dict) -> str:
    lines = [f"{'fault':<22} {'runs':>4} {'recovered':>9} {'rollbacks':>9} {'adjusts':>7} {'stops':>5} "
             f"{'median lost':>11} {'verdicts':>10}"]
    for fault, f in result["per_fault"].items():
        said = ", ".join(f"{f[v]} {v}" for v in ("hardware", "numeric") if f[v]) or "-"
        lines.append(f"{fault:<22} {f['runs']:>4} {f['recovered']:>9} {f['rollbacks']:>9} {f['adjusts']:>7} "
                     f"{f['stops']:>5} {f['median_steps_lost']:>11} {said:>10}")
    lines.append(f"{result['recovered_without_human']} of {result['runs']} runs recovered without a human; "
                 f"median {result['median_steps_lost']} steps lost, {result['rollbacks_per_incident']} rollbacks "
                 f"per incident")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rules", help="rules file (default: the packaged rules/default.yaml)")
    args = ap.parse_args(argv)
    result = evaluate(args.seeds, rules_mod.load(args.rules) if args.rules else None)
    print(table(result))
    print(json.dumps({k: v for k, v in result.items() if k != "per_fault"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Recovery in a closed loop: simulated runs hit by faults, the breaker's commands applied by the
simulated trainer as an integration applies them; ``make eval``'s ``recovery``.

    python evaluation/recovery.py [--seeds N] [--rules FILE] [--only SCENARIO,...]

Each run trains ``STEPS`` steps of :class:`~trainguard.simulator.SimulatedPPO` (or
:class:`~trainguard.simulator.SimulatedSFT`) through a fresh engine (in process, simulated clock,
a worker's tick every simulated second), saving a checkpoint every ``CHECKPOINT_EVERY`` steps. The
trainer says at its start that it can adjust and rerun a step, and applies what the engine sends: a
rollback restores the checkpoint (the simulator's model, its weights' finiteness and its noise state,
and the data position saved with it), skips ``skip_batches`` batches, reports ``rolled_back`` and acks
``applied``; an ``adjust`` scales its learning rate; a ``rerun_step`` acks whether the NaN
reproduced; a stop ends the run. Step N trains on batch N plus the batches skipped so far; a batch
listed as poisoned writes NaN into the weights, and NaN weights stay NaN (every later step, every
checkpoint saved from them) until a finite checkpoint is restored. The scenarios (``SCENARIOS``),
each saying whether a rollback can cure it and why:

- ``nan_transient``: a NaN that a rerun does not reproduce (a flipped bit): one rollback cures it;
- ``nan_recurring``: a NaN that comes back at its step after any rollback (the state and the step,
  not the data) and reproduces on a rerun; it clears only once an ``adjust`` scales the learning
  rate down (the ladder's adjust rung);
- ``reward_model_hang``: the reward model hangs for ``HANG_STEPS`` steps; the trainer's guard
  breaker (``producers/guards``) opens, scores on its fallback and closes when the model answers.
  Nothing there needs a rollback;
- ``kl_explosion``, ``grad_norm_explosion``: sudden faults of the weights that a rollback cures;
- ``nan_batches_2``, ``_3``, ``_5``: that many bad batches in a row: each rollback's first step
  may land on the next one, and only skipping past all of them cures it;
- ``nan_after_rollback``: a bad batch, and the first step after the first rollback goes NaN again
  (an overflow the restored optimiser state carries): a wider rewind cures it;
- ``sft_loss_divergence``: an SFT run (the HF callback's names) whose learning rate is far too
  high for 4 steps: the loss jumps ~17x and stays ~7x up;
- ``grad_explosion_entropy_collapse``: the gradient norm explodes, then entropy collapses;
- ``reward_collapse_after_spike``: one corrupt batch spikes the gradient norm 200x, then the
  reward collapses;
- ``trainer_refuses``: KL explodes in a trainer started without its key: it refuses every command,
  and its refusals, unsigned, never reach the worker. No rollback can cure what is never applied:
  the loop must say so, not claim it acted.

Figures: ``runs``; ``recovered_without_human`` (reached the last step without a stop, the fault
no longer shaping it, finite weights, and no P0/P1 alert fired in its last 20 steps);
``curable_runs`` and ``curable_recovered`` (the same among the runs a rollback can cure; the target
is 95% of them); ``median_steps_lost`` (steps trained and then undone by rollbacks, plus the steps a
stop left untrained); ``rollbacks_per_incident`` (each run is one incident);
``steps_on_nonfinite_weights`` (steps trained on weights that were already NaN: 0 when every NaN
is rolled back at its step); ``unsafe_checkpoints_called_healthy`` (checkpoints holding NaN weights
that the worker listed as healthy, a rollback target); ``untruthful_status`` (runs whose status
said the run was stopped, or rolled back, while the trainer had applied no such command).
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

from trainguard.operate import format_status  # noqa: E402
from trainguard.schemas import events as ev  # noqa: E402
from trainguard.simulator import Fault, SimulatedPPO, SimulatedSFT  # noqa: E402
from trainguard.streams import rules as rules_mod  # noqa: E402
from trainguard.streams.engine import Engine  # noqa: E402

STEPS = 200
ONSET = 60
CHECKPOINT_EVERY = 10
HANG_STEPS = 40
CALL_TIMEOUT_S = 30.0   # the guard's timeout per reward call; three in a row open it
QUIET_TAIL = 20         # the last steps that must be free of pages for a run to count as recovered
LOUD = {"P0", "P1"}
SPIKE = 200.0           # a corrupt batch's gradient norm against the run's
# What the worker says when a command was not applied (a refusal it could not read, a TTL run out).
NOT_APPLIED_RULES = ("command_not_applied", "command_failed")


@dataclass(frozen=True)
class Scenario:
    curable: bool                            # whether the closed loop (a rollback, the ladder) can cure it
    why: str
    faults: tuple = ()                       # (simulator fault, at step, recurs after a rollback)
    trainer: str = "ppo"                     # ppo | sft
    poison: tuple[int, ...] = ()             # batches whose data writes NaN into the weights
    nan_after_first_rollback: bool = False   # the first step after the first restore overflows
    spike_batch: int | None = None           # a corrupt batch: its step's gradient norm SPIKE x
    lr_driven: bool = False                  # clears once an adjust scales the learning rate down
    refuses: bool = False                    # refuses every command; the refusals never reach the worker
    hang: bool = False                       # the reward model hangs (GuardedReward)
    reruns_reproduce: bool = False           # a rerun of the NaN step reproduces it


SCENARIOS: dict[str, Scenario] = {
    "nan_transient": Scenario(True, "a transient NaN (a flipped bit): one rollback past it cures it",
                              faults=(("nan_loss", ONSET, False),)),
    "nan_recurring": Scenario(True, "the step overflows at the run's learning rate: the ladder's adjust rung "
                                    "(a rollback with the rate halved) cures it",
                              faults=(("nan_loss", ONSET, True),), lr_driven=True, reruns_reproduce=True),
    "reward_model_hang": Scenario(False, "nothing to roll back: the trainer's guard scores on its fallback "
                                         "until the reward model answers again", hang=True),
    "kl_explosion": Scenario(True, "a sudden fault of the weights: a rollback to before it cures it",
                             faults=(("kl_explosion", ONSET, False),)),
    "grad_norm_explosion": Scenario(True, "a sudden fault of the weights: a rollback to before it cures it",
                                    faults=(("grad_norm_explosion", ONSET, False),)),
    "nan_batches_2": Scenario(True, "2 bad batches in a row: a rollback that skips past both cures it",
                              poison=tuple(range(ONSET, ONSET + 2)), reruns_reproduce=True),
    "nan_batches_3": Scenario(True, "3 bad batches in a row: a rollback that skips past all of them cures it",
                              poison=tuple(range(ONSET, ONSET + 3)), reruns_reproduce=True),
    "nan_batches_5": Scenario(True, "5 bad batches in a row: a rollback that skips past all of them cures it",
                              poison=tuple(range(ONSET, ONSET + 5)), reruns_reproduce=True),
    "nan_after_rollback": Scenario(True, "a bad batch, then a NaN on the first step after the rollback: the "
                                         "ladder's wider rewind cures it",
                                   poison=(ONSET,), nan_after_first_rollback=True, reruns_reproduce=True),
    "sft_loss_divergence": Scenario(True, "an SFT loss pushed up by 4 steps at a far too high learning rate, "
                                          "staying up: a rollback to before them cures it",
                                    faults=(("loss_divergence", ONSET, False),), trainer="sft"),
    "grad_explosion_entropy_collapse": Scenario(True, "the gradient norm explodes, entropy collapses after it: "
                                                      "a rollback to before the explosion cures both",
                                                faults=(("grad_norm_explosion", ONSET, False),
                                                        ("entropy_collapse", ONSET + 2, False))),
    "reward_collapse_after_spike": Scenario(True, "one corrupt batch spikes the gradient and the reward "
                                                  "collapses after it: a rollback past that batch cures it",
                                            faults=(("reward_collapse", 101, False),), spike_batch=100),
    "trainer_refuses": Scenario(False, "the trainer refuses every command (started without its key): nothing "
                                       "sent is applied, so the loop must say so, not claim it acted",
                                faults=(("kl_explosion", ONSET, False),), refuses=True),
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
    nonfinite_steps: int = 0                     # steps trained on weights that were already NaN
    unsafe_healthy: set = field(default_factory=set)  # (step, save) of NaN checkpoints listed as healthy
    untruthful: list = field(default_factory=list)    # (step, what the status claimed)
    refused: int = 0                             # commands the trainer refused
    said_not_applied: bool = False               # the worker alerted that a command was not applied

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


def _untruthful(status: dict | None, out: Outcome) -> str | None:
    """What the worker's status claims that the trainer did not do, or None."""
    if not status:
        return None
    # What a person reads (`trainguard status`), not the breaker's own state: a breaker that sent a
    # stop has stopped acting, which is no claim that the run stopped.
    if not out.stopped and "stopped" in format_status(status).splitlines()[0]:
        return "stopped"
    if out.rollbacks == 0 and status["breaker"].get("restored_step") is not None:
        return "rolled back"
    return None


def run_one(fault: str, seed: int, rules) -> Outcome:
    sc = SCENARIOS[fault]
    sim = (SimulatedSFT if sc.trainer == "sft" else SimulatedPPO)(seed=seed, host=f"rec-{seed}")
    for kind, at, recur in sc.faults:
        sim.inject(kind, at_step=at, recur=recur)
    bad_data = Fault("nan_loss", 0, active=False)  # switched on for the steps that read a poisoned batch
    sim.faults.append(bad_data)
    guard = GuardedReward(ONSET) if sc.hang else None
    engine = Engine(rules)
    clock = [sim.ts]
    engine.clock = lambda: clock[0]  # "received at" is simulated time here
    run_id = f"recovery-{fault}-{seed}"
    trainer, node = ev.source("trainer", sim.host, 0), ev.source("node", sim.host)
    guard_src = ev.source("guard", sim.host, 0)
    out = Outcome(fault, seed)
    offset = [0]
    next_tick = math.floor(sim.ts) + 1
    skipped = 0                  # batches skipped so far: step N reads batch N + skipped
    saved_skips: dict[int, int] = {}
    saves: dict[int, int] = {}   # checkpoint step -> which save wrote it last
    overflow_after_restore = False

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
            if o.kind == "alert" and v.get("status") == "firing":
                if v.get("rule") == "rerun_verdict":
                    out.verdicts.append(v["evidence"]["verdict"])
                elif v.get("rule") in NOT_APPLIED_RULES:
                    out.said_not_applied = True
        return commands

    def check_checkpoints() -> None:
        status = engine.status(run_id) or {}
        for c in status.get("saved_checkpoints", ()):
            held = sim.checkpoints.get(c["step"])
            if c.get("healthy") and held is not None and not held[0].finite:
                out.unsafe_healthy.add((c["step"], saves[c["step"]]))

    send(ev.lifecycle_event(run_id, "started", step=0, ts=sim.ts, src=trainer,
                            detail={"can": ["adjust", "rerun_step"]}))

    while sim.current_step < STEPS and not out.stopped:
        extra_s, guard_metrics = guard.step(sim.current_step + 1) if guard else (0.0, None)
        sim.ts += extra_s
        batch = sim.current_step + 1 + skipped
        bad_data.active = batch in sc.poison or overflow_after_restore
        overflow_after_restore = False
        if not sim.model.finite:
            out.nonfinite_steps += 1
        m = sim.step()
        now, step = sim.ts, sim.current_step
        if m is not None and batch == sc.spike_batch:
            m["actor/grad_norm"] *= SPIKE
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
            saved_skips[step] = skipped
            saves[step] = saves.get(step, 0) + 1
            check_checkpoints()
        out.last_step = max(out.last_step, step)
        restored_by = None  # the report of the rollback applied at this boundary
        while commands:  # applied at the step boundary, as the integrations do
            command = commands.pop(0)
            if restored_by is not None and command.get("report") != restored_by:
                continue  # the rest of this step's commands belong to the state it rolled back
            out.commands.append(command["action"])
            if sc.refuses:  # its refusal is unsigned: the worker never reads it
                out.refused += 1
                continue
            if command["action"] == "rollback":
                restored = command["target"]["step"]
                out.undone += step - restored
                sim.restore(restored)
                skipped = saved_skips.get(restored, 0) + int(command.get("skip_batches") or 0)
                if sc.nan_after_first_rollback and out.rollbacks == 0:
                    overflow_after_restore = True
                out.rollbacks += 1
                send(ev.lifecycle_event(run_id, "rolled_back", step=restored, ts=sim.ts, src=trainer,
                                        detail={"command_id": command["id"]}))
                ack(command, "applied", step)
                restored_by = command.get("report")
            elif command["action"] == "adjust":
                scale = float(command["params"].get("lr_scale", 1.0))
                out.lr_scale *= scale
                if scale < 1.0 and sc.lr_driven:
                    for f in sim.faults:
                        f.active = False  # the step no longer overflows at the lower rate
                ack(command, "applied", step)
            elif command["action"] == "rerun_step":
                # A fault of the state or the data reproduces on the same batch and seed; a transient one does not.
                commands += judge(ack(command, "applied", step, {"reproduced": sc.reruns_reproduce, "step": step}),
                                  step)
            elif command["action"] == "stop":
                out.stopped = True
                break
        claim = _untruthful(engine.status(run_id), out)
        if claim and not out.untruthful:
            out.untruthful.append((step, claim))
    check_checkpoints()
    out.faulty_at_end = not sim.model.finite or any(
        f.active and sim.current_step >= f.at_step for f in sim.faults if f is not bad_data)
    return out


def summary(outcomes: list[Outcome]) -> dict:
    if not outcomes:
        return {}
    per_fault: dict[str, dict] = {}
    for o in outcomes:
        sc = SCENARIOS[o.fault]
        f = per_fault.setdefault(o.fault, {"runs": 0, "recovered": 0, "rollbacks": 0, "stops": 0, "adjusts": 0,
                                           "hardware": 0, "numeric": 0, "steps_lost": [], "curable": sc.curable,
                                           "why": sc.why, "steps_on_nonfinite_weights": 0,
                                           "unsafe_checkpoints_called_healthy": 0, "untruthful_status": 0,
                                           "said_not_applied": 0})
        f["runs"] += 1
        f["adjusts"] += o.commands.count("adjust")
        f["hardware"] += o.verdicts.count("hardware")
        f["numeric"] += o.verdicts.count("numeric")
        f["recovered"] += o.recovered
        f["rollbacks"] += o.rollbacks
        f["stops"] += o.stopped
        f["steps_lost"].append(o.steps_lost)
        f["steps_on_nonfinite_weights"] += o.nonfinite_steps
        f["unsafe_checkpoints_called_healthy"] += len(o.unsafe_healthy)
        f["untruthful_status"] += bool(o.untruthful)
        f["said_not_applied"] += o.said_not_applied
    for f in per_fault.values():
        f["median_steps_lost"] = statistics.median(f.pop("steps_lost"))
    curable = [o for o in outcomes if SCENARIOS[o.fault].curable]
    return {"runs": len(outcomes), "recovered_without_human": sum(o.recovered for o in outcomes),
            "curable_runs": len(curable), "curable_recovered": sum(o.recovered for o in curable),
            "median_steps_lost": statistics.median(o.steps_lost for o in outcomes),
            "rollbacks_per_incident": round(sum(o.rollbacks for o in outcomes) / len(outcomes), 3),
            "steps_on_nonfinite_weights": sum(o.nonfinite_steps for o in outcomes),
            "unsafe_checkpoints_called_healthy": sum(len(o.unsafe_healthy) for o in outcomes),
            "untruthful_status": sum(bool(o.untruthful) for o in outcomes),
            "per_fault": per_fault}


def evaluate(seeds: int = 3, rules=None, only: list[str] | None = None) -> dict:
    rules = rules or rules_mod.default()
    return summary([run_one(fault, seed, rules) for fault in (only or SCENARIOS) for seed in range(seeds)])


def table(result: dict) -> str:
    lines = [f"{'scenario':<32} {'curable':>7} {'runs':>4} {'recovered':>9} {'rollbacks':>9} {'adjusts':>7} "
             f"{'stops':>5} {'median lost':>11} {'NaN-weight steps':>16} {'unsafe ckpts':>12} "
             f"{'untruthful':>10} {'verdicts':>10}"]
    for fault, f in result["per_fault"].items():
        said = ", ".join(f"{f[v]} {v}" for v in ("hardware", "numeric") if f[v]) or "-"
        lines.append(f"{fault:<32} {'yes' if f['curable'] else 'no':>7} {f['runs']:>4} {f['recovered']:>9} "
                     f"{f['rollbacks']:>9} {f['adjusts']:>7} {f['stops']:>5} {f['median_steps_lost']:>11} "
                     f"{f['steps_on_nonfinite_weights']:>16} {f['unsafe_checkpoints_called_healthy']:>12} "
                     f"{f['untruthful_status']:>10} {said:>10}")
    lines.append(f"{result['recovered_without_human']} of {result['runs']} runs recovered without a human "
                 f"({result['curable_recovered']} of the {result['curable_runs']} a rollback can cure); "
                 f"median {result['median_steps_lost']} steps lost, {result['rollbacks_per_incident']} rollbacks "
                 f"per incident; {result['steps_on_nonfinite_weights']} steps on NaN weights, "
                 f"{result['unsafe_checkpoints_called_healthy']} NaN checkpoints called healthy, "
                 f"{result['untruthful_status']} runs with an untruthful status")
    lines.extend(f"  {fault}: {'curable' if f['curable'] else 'not curable'}, {f['why']}"
                 for fault, f in result["per_fault"].items())
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rules", help="rules file (default: the packaged rules/default.yaml)")
    ap.add_argument("--only", help="comma-separated scenarios (default: all): " + ", ".join(SCENARIOS))
    args = ap.parse_args(argv)
    only = [s.strip() for s in args.only.split(",")] if args.only else None
    unknown = [s for s in only or () if s not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    result = evaluate(args.seeds, rules_mod.load(args.rules) if args.rules else None, only)
    print(table(result))
    print(json.dumps({k: v for k, v in result.items() if k != "per_fault"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

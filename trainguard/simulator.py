"""A simulated PPO run with verl's metric names, realistic magnitudes and noise.

It stands in for a real trainer in the demo, the tests and the evaluation: it produces
one step's metrics at a time, node metrics for its GPUs, saves checkpoints, restores
them (state and random stream, so a rolled-back run continues as the real one would),
and can be given faults that begin at a chosen step. After a rollback past a fault's
onset the fault is gone unless it was asked to recur.

>>> sim = SimulatedPPO(seed=1)
>>> m = sim.step()
>>> sorted(m)[:3]
['actor/entropy', 'actor/forward_latency_ms', 'actor/grad_norm']
>>> sim.inject("nan_loss", at_step=3); _ = sim.step(); _ = sim.step(); sim.step()["actor/pg_loss"]
nan
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass, field

FAULTS = ("kl_explosion", "empty_responses", "rollout_stall", "nan_loss")


@dataclass
class Fault:
    kind: str
    at_step: int
    recur: bool = False
    active: bool = True


@dataclass
class _Model:
    """The slowly moving 'true' state of the run, restored with a checkpoint."""
    step: int = 0
    kl: float = 0.002
    entropy: float = 0.65
    score: float = 0.15
    length: float = 320.0


@dataclass
class SimulatedPPO:
    seed: int = 0
    gpus: int = 8
    host: str = "sim-node-0"
    model: _Model = field(default_factory=_Model)
    faults: list[Fault] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self._gpu_util = 88.0
        self.checkpoints: dict[int, tuple[_Model, object]] = {}

    @property
    def current_step(self) -> int:
        return self.model.step

    def inject(self, kind: str, at_step: int, recur: bool = False) -> None:
        if kind not in FAULTS:
            raise ValueError(f"unknown fault {kind!r}; choose from {', '.join(FAULTS)}")
        self.faults.append(Fault(kind, at_step, recur))

    def _active(self, kind: str) -> bool:
        return any(f.kind == kind and f.active and self.model.step >= f.at_step for f in self.faults)

    def _since(self, kind: str) -> int:
        return max((self.model.step - f.at_step for f in self.faults if f.kind == kind and f.active), default=0)

    def step(self) -> dict[str, float]:
        """Advance one training step and return its metrics."""
        g = self.rng.gauss
        m = self.model
        m.step += 1
        # Healthy dynamics: KL creeps up, entropy decays, reward rises and saturates.
        m.kl = min(0.05, m.kl + 0.00004 + g(0, 0.00002))
        m.entropy = max(0.3, m.entropy - 0.0004)
        m.score += (0.65 - m.score) * 0.004
        m.length += (420 - m.length) * 0.003

        kl = max(1e-5, m.kl * (1 + g(0, 0.06)))
        entropy = m.entropy * (1 + g(0, 0.015))
        latency = max(200.0, g(1800, 120))
        empty = max(0.0, g(0.01, 0.004))
        pg_loss = g(-0.01, 0.015)
        grad_norm = max(0.01, g(0.35, 0.06))
        gpu_util = min(100.0, g(88, 3))

        if self._active("kl_explosion"):
            kl = min(8.0, 0.05 * 1.9 ** (self._since("kl_explosion") + 1)) * (1 + g(0, 0.05))
            entropy *= 0.7
            grad_norm *= 3
        if self._active("empty_responses"):
            empty = min(0.9, 0.35 + g(0, 0.03))
        if self._active("rollout_stall"):
            latency = 12000 + abs(g(0, 1500))
            gpu_util = max(0.0, g(25, 5))
        if self._active("nan_loss"):
            pg_loss = math.nan
            grad_norm = math.inf

        self._gpu_util = gpu_util  # the node metrics of this step follow the rollout's health
        gen_s = latency / 1000 * 12 * (1 + g(0, 0.02))
        update_s = g(14.0, 0.6)
        step_s = gen_s + update_s + g(6.0, 0.3)
        return {
            "actor/kl_loss": kl,
            "actor/kl_coef": 0.001,
            "actor/entropy": entropy,
            "actor/pg_loss": pg_loss,
            "actor/pg_clipfrac": max(0.0, g(0.003, 0.001)),
            "actor/ppo_kl": kl * 0.1,
            "actor/grad_norm": grad_norm,
            "actor/lr": 1e-6,
            "actor/forward_latency_ms": g(120, 6),
            "actor/reduce_grad_ms": g(45, 3),
            "critic/score/mean": m.score + g(0, 0.01),
            "critic/score/std": max(0.05, g(0.36, 0.015)),
            "critic/rewards/mean": m.score + g(0, 0.01),
            "critic/advantages/mean": g(0, 0.01),
            "critic/advantages/max": g(3.2, 0.2),
            "critic/advantages/min": g(-3.1, 0.2),
            "critic/vf_loss": max(0.0, g(0.05, 0.006)),
            "critic/vf_explained_var": min(1.0, g(0.6, 0.03)),
            "response_length/mean": m.length * (1 + g(0, 0.02)),
            "response_length/max": 1024.0,
            "response_length/clip_ratio": max(0.0, g(0.012, 0.003)),
            "prompt_length/mean": g(180, 4),
            "rollout/latency_ms": latency,
            "rollout/empty_response_ratio": empty,
            "reward/kl_divergence": kl,
            "timing_s/gen": gen_s,
            "timing_s/update_actor": update_s,
            "timing_s/step": step_s,
            "perf/throughput": max(1.0, 1500 * 60 / step_s * (1 + g(0, 0.02))),
            "perf/max_memory_allocated_gb": g(52, 0.2),
            "memory/actor_peak_gb": g(52, 0.2),
        }

    def node_metrics(self) -> dict[str, float]:
        """One node's GPUs and host for the current step, in the node agent's naming."""
        g = self.rng.gauss
        util = self._gpu_util
        out = {}
        for i in range(self.gpus):
            out[f"gpu/utilization_pct[{i}]"] = min(100.0, max(0.0, util + g(0, 2)))
            out[f"gpu/memory_used_gb[{i}]"] = g(61.0, 0.3)
            out[f"gpu/memory_total_gb[{i}]"] = 80.0
            out[f"gpu/temperature_c[{i}]"] = g(64, 1.5)
            out[f"gpu/power_w[{i}]"] = g(540, 20)
        out.update({"system/cpu_pct": g(35, 4), "system/cpu_load_avg": g(12, 0.5),
                    "system/memory_used_pct": g(48, 0.5), "system/disk_io_wait_ms": max(0.0, g(2, 0.5))})
        return out

    def save_checkpoint(self) -> str:
        self.checkpoints[self.model.step] = (copy.deepcopy(self.model), self.rng.getstate())
        return f"/checkpoints/global_step_{self.model.step}"

    def restore(self, step: int) -> None:
        """Roll back to the checkpoint saved at ``step``; faults after it end unless they recur."""
        if step not in self.checkpoints:
            raise KeyError(f"no checkpoint at step {step}")
        model, rng_state = self.checkpoints[step]
        self.model = copy.deepcopy(model)
        self.rng.setstate(rng_state)
        self.rng.random()  # a restarted run does not draw the very same batch noise
        for f in self.faults:
            if not f.recur and f.at_step > step:
                f.active = False

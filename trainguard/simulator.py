"""A simulated PPO/GRPO run with verl's metric names, realistic magnitudes and noise.

It stands in for a real trainer in the demo, the tests and the evaluation: it produces
one step's metrics at a time, node metrics for its GPUs (and, with ``ranks=N``, each
rank's own step time and throughput), saves checkpoints, restores them (state and random
stream, so a rolled-back run continues as the real one would), and can be given faults
that begin at a chosen step. After a rollback past a fault's onset the fault is gone
unless it was asked to recur.

A simulated clock runs with it: ``sim.ts`` is the wall time (seconds since the epoch) at
the end of the latest step; every step advances it by that step's ``timing_s/step``
(about ``step_seconds``, longer for checkpoint pauses, evaluations and slow faults). Use
it as the events' ``ts``.

Healthy runs are not clean: the noise has heavy-ish tails (``outlier_rate`` of samples
are 3-4 sigma outliers), and benign events happen that a good monitor must not page on:
a noisy warm-up (first ``warmup_steps``: learning-rate warm-up, KL near 0), step decays
of the learning rate (every ``lr_decay_every`` steps, with a mild shift in grad norm),
checkpoint pauses (the step after ``save_checkpoint()`` is long and the GPUs idle),
evaluation pauses (every ``eval_every`` steps, a few steps of low GPU utilisation with
rollout latency unchanged) and single-sample CPU spikes.

``FAULTS`` are the seed's four faults; ``FAULT_KINDS`` every fault this simulator knows
(see ``FAULT_INFO`` for a one-line signature of each).

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

FAULT_INFO = {
    "kl_explosion": "KL to the reference grows ~1.9x per step from 0.05 up to 8; entropy down, grad norm 3x",
    "empty_responses": "rollout/empty_response_ratio jumps from ~1% to ~35%",
    "rollout_stall": "rollout latency 1.8 s -> 12+ s, GPU utilisation 88% -> 25%, steps 4-5x longer",
    "nan_loss": "actor/pg_loss NaN and actor/grad_norm Inf; the weights stay NaN (so does every later step) until "
                "a checkpoint saved before is restored",
    "kl_drift": "KL creeps linearly +0.06 per simulated hour (0.02 -> 0.08 in 1 h, 0.1 after ~80 min)",
    "kl_spike": "KL jumps to ~0.16 (always > 0.1) and stays; entropy 10% down",
    "reward_collapse": "critic/score/mean decays 15%/step toward 0 while critic/score/std shrinks 0.36 -> 0.04",
    "reward_std_high": "critic/score/std climbs 0.36 -> ~0.92 within 3 steps and stays above 0.8",
    "reward_variance_jump": "critic/score/std jumps 3x at once (0.36 -> ~1.08), mean unchanged",
    "gpu_memory_leak": "gpu/memory_used_gb on every GPU grows 80-115 MB/min steadily until ~79 of 80 GB",
    "cpu_bottleneck": "system/cpu_pct ~97% sustained, GPU memory swings 2.5-6.5 GB either way (CV ~8%), "
                      "GPU util ~60%, steps 1.4x",
    "data_loading_bottleneck": "rollout latency 1.8 -> 4.2 s, GPU util 88 -> 42%, actor forward 120 -> 80 ms, "
                               "disk wait up",
    "dataflow_collapse": "reward_model/oom_count 1-3 per step, rollout/worker_crashes, buffer/size down 55-90%",
    "throughput_drop": "perf/throughput halves, timing_s/step doubles, GPU utilisation stays ~88%",
    "entropy_collapse": "actor/entropy decays 10%/step toward 0.03; responses shorten a little",
    "grad_norm_explosion": "actor/grad_norm 8x at once, then x1.35 per step up to 500; pg_loss noisier",
    "loss_spike": "critic/vf_loss 20x and |actor/pg_loss| +0.4, decaying 30%/step back to normal",
    "response_length_collapse": "response_length/mean decays 12%/step to ~25 tokens; empty ratio ~5%",
    "clip_ratio_high": "response_length/clip_ratio climbs to ~0.93 over 8 steps, mean length near the 1024 cap",
    "trainer_hung": "the trainer stops publishing (step() returns None); the node keeps reporting: GPUs 100% busy "
                    "spinning in a collective at low power",
    "straggler_rank": "with ranks=N, one rank (not 0) runs 1.9-2.2x slower: its timing_s/step doubles, "
                      "throughput halves",
}
FAULT_KINDS = tuple(FAULT_INFO)

NOMINAL_TOKENS_PER_S = 12000.0


@dataclass
class Fault:
    kind: str
    at_step: int
    recur: bool = False
    active: bool = True
    onset_ts: float | None = None   # simulated time the fault began (set on its first step)


@dataclass
class _Model:
    """The slowly moving 'true' state of the run, restored with a checkpoint."""
    step: int = 0
    kl: float = 0.002
    entropy: float = 0.65
    score: float = 0.15
    length: float = 320.0
    finite: bool = True     # the weights: a NaN step writes NaN into them, and every later step is NaN too
    loss: float = 2.9       # SimulatedSFT's noise-free training loss
    damage: float = 1.0     # SimulatedSFT: how far a divergence has pushed the loss up (1: none)


@dataclass
class SimulatedPPO:
    seed: int = 0
    gpus: int = 8
    host: str = "sim-node-0"
    model: _Model = field(default_factory=_Model)
    faults: list[Fault] = field(default_factory=list)
    step_seconds: float = 10.0      # nominal step duration on the simulated clock
    ranks: int = 1                  # >1: rank_metrics() gives ranks 1..N-1 their own step time
    t0: float = 1_700_000_000.0     # simulated clock at step 0
    benign: bool = True             # warm-up, lr decay steps, checkpoint and evaluation pauses, CPU spikes
    outlier_rate: float = 0.005     # share of noise samples that are 3-4 sigma outliers
    warmup_steps: int = 30
    lr_decay_every: int = 400
    eval_every: int = 200
    eval_steps: int = 3

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.ts = float(self.t0)
        self._gpu_util = 88.0
        self._node: dict = {}          # what the node sees this step (set by step())
        self._ranks: dict = {}         # per-rank metrics of this step
        self._pause_s = 0.0            # a checkpoint save to be paid by the next step
        self._hung = False
        self.checkpoints: dict[int, tuple[_Model, tuple]] = {}  # the model and random.getstate()

    @property
    def current_step(self) -> int:
        return self.model.step

    @property
    def hung(self) -> bool:
        """Whether the trainer is hung (its last step() returned None)."""
        return self._hung

    def inject(self, kind: str, at_step: int, recur: bool = False) -> None:
        if kind not in FAULT_INFO:
            raise ValueError(f"unknown fault {kind!r}; choose from {', '.join(FAULT_KINDS)}")
        if kind == "straggler_rank" and self.ranks < 2:
            raise ValueError("straggler_rank needs ranks >= 2")
        self.faults.append(Fault(kind, at_step, recur))

    def _fault(self, kind: str) -> Fault | None:
        for f in self.faults:
            if f.kind == kind and f.active and self.model.step >= f.at_step:
                return f
        return None

    def _active(self, kind: str) -> bool:
        return self._fault(kind) is not None

    def _since(self, kind: str) -> int:
        return max((self.model.step - f.at_step for f in self.faults if f.kind == kind and f.active), default=0)

    def _since_s(self, kind: str) -> float:
        f = self._fault(kind)
        return 0.0 if f is None or f.onset_ts is None else self.ts - f.onset_ts

    @property
    def kl_level(self) -> float:
        """The run's noise-free KL to the reference now (with a kl_drift fault's creep)."""
        drift = 0.06 * self._since("kl_drift") * self.step_seconds / 3600.0 if self._active("kl_drift") else 0.0
        return self.model.kl + drift

    @property
    def straggler(self) -> int | None:
        """The rank that a straggler_rank fault slows down (never rank 0)."""
        return 1 + self.seed % (self.ranks - 1) if self.ranks > 1 else None

    def _n(self, sigma: float) -> float:
        """Gaussian noise with heavy-ish tails: a few samples are 3-4 sigma outliers."""
        rng = self.rng
        if self.outlier_rate and rng.random() < self.outlier_rate:
            return sigma * rng.uniform(3.0, 4.0) * (1.0 if rng.random() < 0.5 else -1.0)
        return rng.gauss(0, sigma)

    def step(self) -> dict[str, float] | None:
        """Advance one training step and return its metrics (None while the trainer is hung)."""
        g = self.rng.gauss
        n = self._n
        m = self.model
        S = self.step_seconds
        # A hung trainer never finishes the step it is in: time passes, nothing is published.
        for f in self.faults:
            if f.kind == "trainer_hung" and f.active and m.step + 1 >= f.at_step:
                if f.onset_ts is None:
                    f.onset_ts = self.ts
                self._hung = True
                self.ts += S * (1 + 0.02 * g(0, 1))
                self._gpu_util = 100.0
                self._node = {"hung": True}
                self._ranks = {}
                return None
        self._hung = False
        m.step += 1
        for f in self.faults:
            if f.active and f.onset_ts is None and m.step >= f.at_step:
                f.onset_ts = self.ts
        step = m.step
        warm = self.benign and step <= self.warmup_steps
        wn = 2.0 if warm else 1.0  # warm-up is noisier

        # Healthy dynamics: KL settles near 0.02 and creeps up slowly, entropy decays gently,
        # reward rises and saturates, responses lengthen.
        kl_target = 0.02 + 0.005 * step / 1000
        m.kl = max(1e-4, m.kl + (kl_target - m.kl) * 0.03 + g(0, 0.00002))
        m.entropy += (0.4 - m.entropy) * 0.001
        m.score += (0.65 - m.score) * 0.004
        m.length += (420 - m.length) * 0.003

        lr = 1e-6
        grad_scale = 1.0
        if self.benign:
            if self.lr_decay_every:
                decays = step // self.lr_decay_every
                lr *= 0.7 ** decays
                grad_scale = 0.93 ** decays
            if step <= self.warmup_steps:
                lr *= step / self.warmup_steps

        kl = max(1e-5, m.kl * (1 + n(0.06) * wn))
        entropy = m.entropy * (1 + n(0.015) * wn)
        latency = max(200.0, 1800 + n(120))
        empty = max(0.0, 0.01 + n(0.004))
        pg_loss = -0.01 + n(0.015) * wn
        vf_loss = max(0.0, 0.05 + n(0.006) * wn)
        grad_norm = max(0.01, (0.35 + n(0.06) * wn) * grad_scale)
        clipfrac = max(0.0, (0.003 + n(0.001)) * grad_scale)
        gpu_util = min(100.0, 88 + n(3))
        score_mean = m.score + n(0.01) * wn
        score_std = max(0.05, 0.36 + n(0.015))
        length = m.length * (1 + n(0.02))
        clip_ratio = max(0.0, 0.012 + n(0.003))
        forward_ms = 120 + n(6)
        disk_wait = max(0.0, 2 + n(0.5))
        cpu = 35 + n(4)
        if self.benign and self.rng.random() < 0.005:
            cpu = self.rng.uniform(97, 99.5)  # a one-sample spike (a log rotation, a GC): not a bottleneck
        mem_swing = 0.0
        slow = 1.0          # multiplies the whole step time
        extra_s = 0.0       # seconds added to the step outside generation and update
        oom = 0.0
        crashes = 0.0
        buffer = 4096 + n(40)
        power = 540 + n(20)

        if self._active("kl_explosion"):
            kl = min(8.0, 0.05 * 1.9 ** (self._since("kl_explosion") + 1)) * (1 + g(0, 0.05))
            entropy *= 0.7
            grad_norm *= 3
        if self._active("empty_responses"):
            empty = min(0.9, 0.35 + g(0, 0.03))
        if self._active("rollout_stall"):
            latency = 12000 + abs(g(0, 1500))
            gpu_util = max(0.0, g(25, 5))
        if self._active("nan_loss") or not m.finite:
            m.finite = False
            pg_loss = math.nan
            grad_norm = math.inf
        if self._active("kl_drift"):
            kl += 0.06 * self._since("kl_drift") * S / 3600.0
        if self._active("kl_spike"):
            kl = max(0.105, 0.16 * (1 + g(0, 0.1)))
            entropy *= 0.9
            grad_norm *= 1.5
        if self._active("reward_collapse"):
            decay = 0.85 ** (self._since("reward_collapse") + 1)
            score_mean = max(0.0, m.score * decay + 0.02 + g(0, 0.005))
            score_std = max(0.03, 0.36 * decay + 0.03 + g(0, 0.005))
        if self._active("reward_std_high"):
            ramp = min(1.0, (self._since("reward_std_high") + 1) / 3)
            score_std = 0.36 + (0.92 - 0.36) * ramp + g(0, 0.03)
            if ramp >= 1.0:
                score_std = max(0.82, score_std)
        if self._active("reward_variance_jump"):
            score_std = 3 * 0.36 * (1 + g(0, 0.05))
        if self._active("cpu_bottleneck"):
            cpu = min(100.0, 97.5 + g(0, 1.2))
            mem_swing = self.rng.uniform(2.5, 6.5) * (1 if self.rng.random() < 0.5 else -1)
            gpu_util = max(0.0, g(60, 10))
            slow *= 1.4
        if self._active("data_loading_bottleneck"):
            latency = 4200 + g(0, 300)
            gpu_util = max(0.0, g(42, 5))
            forward_ms = 80 + g(0, 5)
            disk_wait = 25 + abs(g(0, 6))
        if self._active("dataflow_collapse"):
            s = self._since("dataflow_collapse")
            oom = float(self.rng.randint(1, 3))
            crashes = 1.0 if s < 2 or self.rng.random() < 0.5 else 0.0
            buffer = 4096 * max(0.1, 0.45 - 0.02 * s) * (1 + g(0, 0.03))
            latency *= 1.5
            gpu_util = max(0.0, gpu_util - 20)
        if self._active("throughput_drop"):
            slow *= 2.0
        if self._active("entropy_collapse"):
            entropy = max(0.03, entropy * 0.9 ** (self._since("entropy_collapse") + 1))
            length *= 0.995 ** self._since("entropy_collapse")
        if self._active("grad_norm_explosion"):
            grad_norm = min(500.0, 0.35 * 8 * 1.35 ** self._since("grad_norm_explosion")) * (1 + g(0, 0.1))
            pg_loss = -0.01 + g(0, 0.075)
        if self._active("loss_spike"):
            k = 0.7 ** self._since("loss_spike")
            vf_loss *= 1 + 19 * k
            pg_loss += 0.4 * k * (1 if self.rng.random() < 0.5 else -1)
            grad_norm *= 1 + 4 * k
        if self._active("response_length_collapse"):
            length = max(25.0, length * 0.88 ** (self._since("response_length_collapse") + 1))
            empty = max(empty, 0.05 + g(0, 0.01))
            clip_ratio = 0.0
        if self._active("clip_ratio_high"):
            ramp = min(1.0, (self._since("clip_ratio_high") + 1) / 8)
            clip_ratio = min(1.0, max(0.0, 0.012 + (0.93 - 0.012) * ramp + g(0, 0.02)))
            length = length + (1000 - length) * ramp
        if self._active("straggler_rank"):
            pass  # only the slow rank's own numbers change (rank_metrics)

        # Step time: generation follows the rollout latency, plus update and the rest.
        gen_s = S * 0.52 * latency / 1800 * (1 + g(0, 0.02))
        update_s = S * 0.34 * (1 + n(0.04))
        other_s = S * 0.14 * (1 + n(0.05))
        step_s = (gen_s + update_s + other_s) * slow + extra_s
        gpu_node = gpu_util
        if self.benign and self._pause_s:
            step_s += self._pause_s  # saving the checkpoint: GPUs idle while the shards are written
            gpu_node = max(0.0, g(12, 4))
        self._pause_s = 0.0
        if self.benign and self.eval_every and step > self.warmup_steps and step % self.eval_every < self.eval_steps:
            step_s *= 1.15 + g(0, 0.02)  # validation generation: lighter on the GPUs, rollouts unaffected
            gpu_node = max(0.0, g(45, 5))
        tokens = NOMINAL_TOKENS_PER_S * S
        throughput = max(1.0, tokens / step_s * (1 + n(0.02)))
        mem_leak = 0.0
        if self._active("gpu_memory_leak"):
            mem_leak = self._leak_gb_per_s() * (self._since_s("gpu_memory_leak") + step_s)

        self._gpu_util = gpu_node  # the node metrics of this step follow the rollout's health
        self._node = {"cpu": cpu, "mem_swing": mem_swing, "disk_wait": disk_wait, "power": power,
                      "cpu_load": 12 + (50 if self._active("cpu_bottleneck") else 0)}
        self._ranks = self._rank_values(step_s, tokens)
        self.ts += step_s
        return {
            "actor/kl_loss": kl,
            "actor/kl_coef": 0.001,
            "actor/entropy": entropy,
            "actor/pg_loss": pg_loss,
            "actor/pg_clipfrac": clipfrac,
            "actor/ppo_kl": kl * 0.1,
            "actor/grad_norm": grad_norm,
            "actor/lr": lr,
            "actor/forward_latency_ms": forward_ms,
            "actor/reduce_grad_ms": 45 + n(3),
            "critic/score/mean": score_mean,
            "critic/score/std": score_std,
            "critic/rewards/mean": score_mean + g(0, 0.005),
            "critic/advantages/mean": g(0, 0.01),
            "critic/advantages/max": 3.2 + n(0.2),
            "critic/advantages/min": -3.1 + n(0.2),
            "critic/vf_loss": vf_loss,
            "critic/vf_explained_var": min(1.0, 0.6 + n(0.03)),
            "response_length/mean": length,
            "response_length/max": 1024.0,
            "response_length/clip_ratio": clip_ratio,
            "prompt_length/mean": 180 + n(4),
            "rollout/latency_ms": latency,
            "rollout/empty_response_ratio": empty,
            "rollout/worker_crashes": crashes,
            "reward/kl_divergence": kl,
            "reward_model/oom_count": oom,
            "buffer/size": buffer,
            "timing_s/gen": gen_s * slow,
            "timing_s/update_actor": update_s * slow,
            "timing_s/step": step_s,
            "perf/throughput": throughput,
            "perf/max_memory_allocated_gb": 52 + n(0.2) + mem_leak,
            "memory/actor_peak_gb": 52 + n(0.2) + mem_leak,
        }

    def _leak_gb_per_s(self, gpu: int = 0) -> float:
        return (80 + 5 * (gpu % 8)) / 1024 / 60  # 80-115 MB per minute

    def _rank_values(self, step_s: float, tokens: float) -> dict[int, dict[str, float]]:
        out: dict[int, dict[str, float]] = {}
        if self.ranks < 2:
            return out
        slow_rank = self.straggler if self._active("straggler_rank") else None
        for r in range(1, self.ranks):
            t = step_s * (1 + self._n(0.02))
            if r == slow_rank:
                t *= self.rng.uniform(1.9, 2.2)
            out[r] = {"timing_s/step": t, "perf/throughput": tokens / t}
        return out

    def rank_metrics(self) -> dict[int, dict[str, float]]:
        """Ranks 1..N-1's own ``timing_s/step`` and ``perf/throughput`` for the current step.

        Rank 0's are the trainer's main metrics (``step()``); empty with ``ranks=1`` or while hung.
        """
        return self._ranks

    def node_metrics(self) -> dict[str, float]:
        """One node's GPUs and host for the current step, in the node agent's naming."""
        g = self.rng.gauss
        n = self._n
        util = self._gpu_util
        node = self._node
        hung = node.get("hung", False)
        leak = self._active("gpu_memory_leak") and not hung
        since = self._since_s("gpu_memory_leak") if leak else 0.0
        out = {}
        for i in range(self.gpus):
            mem = 61.0 + n(0.05) + node.get("mem_swing", 0.0) * (1 + g(0, 0.1))
            if leak:
                mem = min(79.3, mem + self._leak_gb_per_s(i) * since)
            out[f"gpu/utilization_pct[{i}]"] = 100.0 if hung else min(100.0, max(0.0, util + n(2)))
            out[f"gpu/memory_used_gb[{i}]"] = mem
            out[f"gpu/memory_total_gb[{i}]"] = 80.0
            out[f"gpu/temperature_c[{i}]"] = (52 if hung else 64) + n(1.5)
            out[f"gpu/power_w[{i}]"] = g(150, 8) if hung else node.get("power", 540.0) + n(20)
        cpu = node.get("cpu", 35 + n(4)) if not hung else 8 + n(2)
        out.update({"system/cpu_pct": min(100.0, max(0.0, cpu)),
                    "system/cpu_load_avg": node.get("cpu_load", 12) + n(0.5),
                    "system/memory_used_pct": 48 + n(0.5),
                    "system/disk_io_wait_ms": node.get("disk_wait", max(0.0, 2 + n(0.5)))})
        return out

    def save_checkpoint(self) -> str:
        self.checkpoints[self.model.step] = (copy.deepcopy(self.model), self.rng.getstate())
        self._pause_s = self.rng.uniform(25, 45)  # paid by the next step
        return f"/checkpoints/global_step_{self.model.step}"

    def restore(self, step: int) -> None:
        """Roll back to the checkpoint saved at ``step``; faults after it end unless they recur."""
        if step not in self.checkpoints:
            raise KeyError(f"no checkpoint at step {step}")
        model, rng_state = self.checkpoints[step]
        self.model = copy.deepcopy(model)
        self.rng.setstate(rng_state)
        self.rng.random()  # a restarted run does not draw the very same batch noise
        self._pause_s = self.rng.uniform(15, 30)  # loading the checkpoint
        for f in self.faults:
            if not f.recur and f.at_step > step:
                f.active = False
            elif f.at_step > step:
                f.onset_ts = None  # it will begin again when the run reaches its step


SFT_FAULTS = {
    "loss_divergence": "a learning rate far too high for 4 steps: the loss jumps ~17x (2.9 -> ~50), then settles "
                       "near 7x its healthy level and stays there; the gradient norm triples",
    "nan_loss": "the loss NaN and the gradient norm Inf; the weights stay NaN until a checkpoint saved before is "
                "restored",
}


@dataclass
class SimulatedSFT(SimulatedPPO):
    """A supervised fine-tuning run as the Hugging Face Trainer logs it through trainguard's
    callback (``train/total_loss``, ``train/grad_norm``, ``train/learning_rate``, ``train/epoch``):
    a loss that falls from ~2.9 towards ~1.4 with batch noise. Checkpoints, restores, the clock
    and the node's metrics are :class:`SimulatedPPO`'s; its faults are ``SFT_FAULTS``.

    >>> sim = SimulatedSFT(seed=1)
    >>> sim.inject("loss_divergence", at_step=20)
    >>> before = [sim.step()["train/total_loss"] for _ in range(19)][-1]
    >>> after = [sim.step()["train/total_loss"] for _ in range(30)]
    >>> max(after) > 10 * before and after[-1] > 4 * before
    True
    """

    steps_per_epoch: int = 500

    def inject(self, kind: str, at_step: int, recur: bool = False) -> None:
        if kind not in SFT_FAULTS:
            raise ValueError(f"unknown SFT fault {kind!r}; choose from {', '.join(SFT_FAULTS)}")
        self.faults.append(Fault(kind, at_step, recur))

    def step(self) -> dict[str, float] | None:
        m, n = self.model, self._n
        m.step += 1
        for f in self.faults:
            if f.active and f.onset_ts is None and m.step >= f.at_step:
                f.onset_ts = self.ts
        m.loss += (1.4 - m.loss) * 0.01
        grad_norm = max(0.05, 1.0 + n(0.08))
        lr = 2e-5 * min(1.0, m.step / 20)
        if self._active("loss_divergence"):
            since = self._since("loss_divergence")
            if since < 4:  # the steps at the bad learning rate push the weights away
                m.damage = max(m.damage, 17.0 * (1 + 0.05 * self.rng.gauss(0, 1)))
                lr *= 500
            else:  # then the loss settles, far above where it was, and stays
                m.damage = max(7.0, m.damage * 0.8)
            grad_norm *= 3.0
        loss = max(0.05, m.loss * m.damage * (1 + n(0.03)))
        if self._active("nan_loss") or not m.finite:
            m.finite = False
            loss, grad_norm = math.nan, math.inf
        step_s = self.step_seconds * (1 + n(0.03)) + self._pause_s
        self._pause_s = 0.0
        self._gpu_util = min(100.0, 90 + n(2))
        self._node = {}
        self.ts += step_s
        return {"train/total_loss": loss, "train/grad_norm": grad_norm, "train/learning_rate": lr,
                "train/epoch": m.step / self.steps_per_epoch}

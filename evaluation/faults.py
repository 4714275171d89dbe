"""The fault-injection scenarios that ``evaluation/run.py`` replays through the engine.

Edit ``EXPECTED_RULES`` when a rule is renamed: it is the one place that says which alert
counts as detecting which fault. A detection is a *firing* alert whose ``rule`` is one of
the fault's expected names, raised at or after the onset and before the scenario ends.
Any other rule that fires during the fault is neither credited nor charged; any firing
alert before the onset (or anywhere in a healthy run) is a false alert.

Classes: ``sudden`` faults are there in full from their first step (the median delay over
them is a headline number); ``gradual`` ones build up over tens to hundreds of steps or,
by definition, need a sustained condition (e.g. reward std above 0.8 for minutes).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainguard.simulator import FAULT_INFO

# fault kind -> rule names (or incident names) whose firing alert counts as a detection
EXPECTED_RULES: dict[str, tuple[str, ...]] = {
    "kl_explosion": ("kl_explosion",),
    "empty_responses": ("empty_responses",),
    "rollout_stall": ("rollout_stall",),
    "nan_loss": ("non_finite",),
    "kl_drift": ("kl_drift",),
    "kl_spike": ("kl_spike", "kl_high"),
    "reward_collapse": ("reward_collapse",),
    "reward_std_high": ("reward_std_high",),
    "reward_variance_jump": ("reward_variance_jump", "reward_std_high"),
    "gpu_memory_leak": ("gpu_memory_leak",),
    "cpu_bottleneck": ("cpu_bottleneck", "cpu_bound_bottleneck"),
    "data_loading_bottleneck": ("data_loading_bottleneck",),
    "dataflow_collapse": ("dataflow_collapse",),
    "throughput_drop": ("throughput_drop",),
    "entropy_collapse": ("entropy_collapse",),
    "grad_norm_explosion": ("grad_norm_explosion", "grad_norm_spike"),
    "loss_spike": ("loss_spike",),
    "response_length_collapse": ("response_length_collapse",),
    "clip_ratio_high": ("clip_ratio_high",),
    "trainer_hung": ("trainer_hung",),
    "straggler_rank": ("straggler_rank",),
}

SUDDEN = "sudden"
GRADUAL = "gradual"

# fault kind -> (class, steps the scenario runs after the onset, with the fault active throughout)
# At the simulator's nominal 10 s per step: 40 steps ~ 7 min, 360 steps = 1 h.
SHAPE: dict[str, tuple[str, int]] = {
    "kl_explosion": (SUDDEN, 40),
    "empty_responses": (SUDDEN, 40),
    "rollout_stall": (SUDDEN, 40),
    "nan_loss": (SUDDEN, 40),
    "kl_drift": (GRADUAL, 600),        # 0.02 -> 0.08 in 360 steps (1 h), 0.1 at ~480
    "kl_spike": (SUDDEN, 40),
    "reward_collapse": (GRADUAL, 100),
    "reward_std_high": (GRADUAL, 90),  # "std > 0.8 for 5 minutes" needs 30 steps by definition
    "reward_variance_jump": (SUDDEN, 40),
    "gpu_memory_leak": (GRADUAL, 360),  # ~6 GB in an hour
    "cpu_bottleneck": (SUDDEN, 40),
    "data_loading_bottleneck": (SUDDEN, 40),
    "dataflow_collapse": (SUDDEN, 40),
    "throughput_drop": (SUDDEN, 40),
    "entropy_collapse": (GRADUAL, 120),
    "grad_norm_explosion": (SUDDEN, 40),
    "loss_spike": (SUDDEN, 20),        # the spike itself decays back within ~10 steps
    "response_length_collapse": (GRADUAL, 100),
    "clip_ratio_high": (GRADUAL, 60),
    "trainer_hung": (SUDDEN, 60),      # 60 step-durations (10 min) of silence, node still reporting
    "straggler_rank": (SUDDEN, 40),
}

RANKS = 8                 # straggler scenarios and healthy runs publish 8 ranks' step times
HEALTHY_STEPS = 2000      # per healthy seed (~5.5 simulated hours)
CHECKPOINT_EVERY = 50


@dataclass(frozen=True)
class Scenario:
    name: str
    fault: str | None          # None for a healthy run
    seed: int
    onset: int                 # first faulty step (the simulator's at_step)
    steps: int                 # the run ends after this step (or, when hung, this many step-durations)
    klass: str                 # sudden | gradual | healthy
    expected: tuple[str, ...]
    ranks: int = 1


def onset_for(seed: int) -> int:
    """Past the warm-up and a full baseline window, and not aligned with checkpoints."""
    return 110 + (seed * 17) % 40


def fault_scenarios(seeds: int, kinds: list[str] | None = None) -> list[Scenario]:
    out = []
    for kind in kinds or list(EXPECTED_RULES):
        klass, duration = SHAPE[kind]
        for seed in range(seeds):
            onset = onset_for(seed)
            out.append(Scenario(f"{kind}#{seed}", kind, 1000 + seed, onset, onset + duration - 1, klass,
                                EXPECTED_RULES[kind], RANKS if kind == "straggler_rank" else 1))
    return out


def healthy_scenarios(seeds: int, steps: int = HEALTHY_STEPS) -> list[Scenario]:
    return [Scenario(f"healthy#{seed}", None, 2000 + seed, steps + 1, steps, "healthy", (), RANKS)
            for seed in range(seeds)]


def check() -> None:
    """Every simulated fault has an expected rule and a shape, and nothing else does."""
    assert set(EXPECTED_RULES) == set(FAULT_INFO) == set(SHAPE), set(FAULT_INFO) ^ set(EXPECTED_RULES)
    assert all(EXPECTED_RULES[k] for k in EXPECTED_RULES)


check()

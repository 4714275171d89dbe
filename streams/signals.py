"""Canonical training signals and the metric names each framework logs for them.

Every trainer speaks its own dialect: verl logs ``actor/kl_loss``, TRL ``kl`` (``train/kl``
in its TensorBoard and W&B output), OpenRLHF ``kl``, ms-swift ``kl``, the seed documents
``reward/kl_divergence``. Rules speak of *signals* (``kl``), so one rule bites on every
framework; metric names still travel as the trainer logged them and alerts name them.

Each framework's names are a file of ``streams/dialects/``, read from its source
(``docs/vocabulary.md`` cites the file behind every dialect). Resolution is by exact name
after dropping a logging prefix (``train/``), so ``train/kl`` is ``kl`` but ``eval/kl`` is not a training signal. A name
that no dialect knows resolves to ``None`` and is reported as unwatched, never guessed.

>>> signal_of("actor/kl_loss"), signal_of("train/kl"), signal_of("completions/clipped_ratio")
('kl', 'kl', 'response_clip_ratio')
>>> signal_of("eval/kl") is None and signal_of("my/own_metric") is None
True
>>> recognise(["actor/pg_loss", "critic/score/mean", "timing_s/step"])
'verl'
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterable

from trainguard.streams import dialects

# signal -> what it means (the docs table and ``trainguard check-rules`` list these)
SIGNALS: dict[str, str] = {
    "kl": "KL divergence of the policy to the reference model (the KL loss or its estimate)",
    "kl_penalty": "KL to the reference folded into the reward (verl use_kl_in_reward)",
    "kl_seq": "KL to the reference summed over each sequence (grows with length: TRL PPO, online DPO)",
    "ppo_kl": "approximate KL between the old and the updated policy within one PPO update",
    "entropy": "mean per-token entropy of the policy, in nats",
    "policy_loss": "policy-gradient loss (GRPO's reported loss)",
    "value_loss": "critic / value-function loss",
    "loss": "total training loss of a trainer that reports one number",
    "grad_norm": "gradient norm of the policy before clipping",
    "critic_grad_norm": "gradient norm of the critic before clipping",
    "reward_mean": "mean reward (score) of the batch",
    "reward_std": "reward spread: within-group std for GRPO trainers, batch std otherwise",
    "reward_min": "lowest reward in the batch",
    "reward_max": "highest reward in the batch",
    "frac_zero_std": "fraction of prompt groups whose completions all got the same reward",
    "advantage_mean": "mean advantage",
    "advantage_min": "lowest advantage in the batch",
    "advantage_max": "highest advantage in the batch",
    "response_length_mean": "mean completion length, tokens",
    "response_length_min": "shortest completion, tokens",
    "response_length_max": "longest completion, tokens",
    "response_clip_ratio": "fraction of completions truncated at the length cap",
    "pg_clipfrac": "fraction of tokens whose PPO ratio was clipped",
    "learning_rate": "policy learning rate",
    "step_time": "seconds per training step",
    "gen_time": "seconds spent generating rollouts per step",
    "throughput": "training throughput (tokens or iterations per second)",
    "memory_gb": "peak accelerator memory of the trainer process, GB",
    # training-inference mismatch: the rollout engine's probabilities of the sampled tokens against
    # the trainer's, same tokens and weights (docs/vocabulary.md gives each framework's levels)
    "mismatch_prob_diff": "mean abs(p_train - p_rollout) over the sampled tokens (0 when they agree)",
    "mismatch_prob_diff_max": "largest abs(p_train - p_rollout) of one token in the batch",
    "mismatch_prob_corr": "Pearson correlation of p_train and p_rollout over the sampled tokens (1 when they agree)",
    "mismatch_mult_prob_error": "mean exp(abs(log p_train - log p_rollout)) per sampled token (1 when they agree)",
    "mismatch_kl": "KL of the rollout engine's to the trainer's probabilities, k3 per sampled token (0 when alike)",
    # the seed documents' own names (a dialect of their own)
    "rollout_latency_ms": "rollout latency, ms",
    "empty_response_ratio": "fraction of empty responses",
    "reward_extreme_ratio": "fraction of the batch with extreme rewards",
    "forward_latency_ms": "actor forward latency, ms",
    "reduce_grad_ms": "gradient all-reduce time, ms",
    "reward_model_oom": "reward-model out-of-memory count",
    "rollout_worker_crashes": "rollout worker crash count",
    "buffer_size": "replay buffer size",
}

# Signals of the compute layer; every other signal is data flow (the node agent's metrics
# are the resource layer and keep their own names).
COMPUTE = frozenset({"step_time", "gen_time", "throughput", "memory_gb", "forward_latency_ms", "reduce_grad_ms"})

# framework -> {metric name as logged (prefix dropped): signal}, and where each was read: one file
# per framework in streams/dialects/. Names that look like a signal but measure something else are
# left out on purpose (docs/vocabulary.md says why): TRL's ``objective/entropy`` is a sequence-summed
# NLL, ``actor/ppo_kl`` is old-vs-new drift.
DIALECTS, SOURCES = dialects.DIALECTS, dialects.SOURCES

# Logging prefixes that do not change what a metric is (TRL / HF Trainer in TensorBoard and W&B).
PREFIXES = ("train/",)


def _merged() -> dict[str, str]:
    merged: dict[str, str] = {}
    for dialect in DIALECTS.values():
        for name, signal in dialect.items():
            if not signal:
                continue
            if merged.get(name, signal) != signal:  # pragma: no cover - guarded by a test
                raise ValueError(f"{name!r} means {merged[name]!r} in one dialect and {signal!r} in another")
            if signal not in SIGNALS:  # pragma: no cover - guarded by a test
                raise ValueError(f"{name!r} maps to unknown signal {signal!r}")
            merged[name] = signal
    return merged


_BY_NAME = _merged()


@lru_cache(maxsize=8192)
def signal_of(name: str) -> str | None:
    """The canonical signal a logged metric name stands for, or None.

    Per-device suffixes (``gpu/util[3]``) are not training signals and never resolve."""
    found = _BY_NAME.get(name)
    if found is None:
        for prefix in PREFIXES:
            if name.startswith(prefix):
                found = _BY_NAME.get(name[len(prefix):])
                break
    return found


def _stripped(name: str) -> str:
    for prefix in PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def recognise(names: Iterable[str]) -> str | None:
    """The framework whose dialect covers most of ``names`` (None when no dialect knows two).

    Names shared by several dialects (``kl``, ``grad_norm``) count for each; a tie goes to
    the dialect of lower ``ORDER``, so verl names beat the seed's and TRL's beat ms-swift's
    (which extends TRL's GRPO vocabulary)."""
    keys = {_stripped(n) for n in names}
    best, best_hits = None, 1
    for framework, dialect in DIALECTS.items():
        hits = len(keys & dialect.keys())
        if hits > best_hits:
            best, best_hits = framework, hits
    return best


def names_for(signal: str) -> list[str]:
    """Every logged name (without prefix) that stands for ``signal``, for docs and messages."""
    return sorted(name for name, s in _BY_NAME.items() if s == signal)


def markdown() -> str:
    """The vocabulary as the tables of docs/vocabulary.md (a test keeps the page in step)."""
    by_signal: dict[str, dict[str, list[str]]] = {}
    for framework, dialect in DIALECTS.items():
        for name, signal in dialect.items():
            by_signal.setdefault(signal, {}).setdefault(framework, []).append(name)
    lines = ["| signal | meaning | " + " | ".join(DIALECTS) + " |",
             "|---|---|" + "---|" * len(DIALECTS)]
    for signal, meaning in SIGNALS.items():
        cells = [", ".join(f"`{n}`" for n in by_signal.get(signal, {}).get(f, [])) for f in DIALECTS]
        lines.append(f"| `{signal}` | {meaning} | " + " | ".join(cells) + " |")
    lines += ["", "Sources read:", ""]
    lines += [f"- **{framework}**: {SOURCES[framework]}" for framework in DIALECTS]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")


def base_name(metric: str) -> str:
    """``gpu/utilization_pct[3]`` -> ``gpu/utilization_pct``: rules match per-device metrics by base name."""
    i = metric.find("[")
    return metric if i < 0 else metric[:i]


def rank_of(metric: str) -> str | None:
    """``timing_s/step[12]`` -> ``"12"``: the index of a per-device (or, folded, per-rank) metric.

    >>> rank_of("timing_s/step[12]"), rank_of("timing_s/step")
    ('12', None)
    """
    i = metric.find("[")
    return metric[i + 1:-1] if i > 0 and metric.endswith("]") and metric[i + 1:-1].isdigit() else None

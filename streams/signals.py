"""Canonical training signals and the metric names each framework logs for them.

Every trainer speaks its own dialect: verl logs ``actor/kl_loss``, TRL ``kl`` (``train/kl``
in its TensorBoard and W&B output), OpenRLHF ``kl``, ms-swift ``kl``, the seed documents
``reward/kl_divergence``. Rules speak of *signals* (``kl``), so one rule bites on every
framework; metric names still travel as the trainer logged them and alerts name them.

The tables below were read from each framework's source (``docs/vocabulary.md`` cites the
file behind every dialect). Resolution is by exact name after dropping a logging prefix
(``train/``), so ``train/kl`` is ``kl`` but ``eval/kl`` is not a training signal. A name
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

# framework -> {metric name as logged (prefix dropped): signal}. Names that look like a
# signal but measure something else are left out on purpose (docs/vocabulary.md says why):
# TRL's ``objective/entropy`` is a sequence-summed NLL, ``actor/ppo_kl`` is old-vs-new drift.
DIALECTS: dict[str, dict[str, str]] = {
    "verl": {
        "actor/kl_loss": "kl",                          # with actor.use_kl_loss
        "actor/reward_kl_penalty": "kl_penalty",        # with algorithm.use_kl_in_reward
        "critic/kl": "kl_penalty",                      # its name before 0.4
        "actor/ppo_kl": "ppo_kl",
        "actor/entropy": "entropy",
        "actor/entropy_loss": "entropy",                # before 0.4.1; update-time entropy from 0.8
        "actor/pg_loss": "policy_loss",
        "critic/vf_loss": "value_loss",
        "critic/loss": "value_loss",
        "actor/grad_norm": "grad_norm",
        "critic/grad_norm": "critic_grad_norm",
        "critic/score/mean": "reward_mean",
        "critic/score/min": "reward_min",
        "critic/score/max": "reward_max",
        "critic/advantages/mean": "advantage_mean",
        "critic/advantages/min": "advantage_min",
        "critic/advantages/max": "advantage_max",
        "response_length/mean": "response_length_mean",
        "response_length/min": "response_length_min",
        "response_length/max": "response_length_max",
        "response_length/clip_ratio": "response_clip_ratio",
        "actor/pg_clipfrac": "pg_clipfrac",
        "actor/lr": "learning_rate",
        "timing_s/step": "step_time",
        "timing/step": "step_time",                     # before 0.3
        "perf/time_per_step": "step_time",
        "timing_s/gen": "gen_time",
        "timing/gen": "gen_time",
        "perf/throughput": "throughput",
        "perf/max_memory_allocated_gb": "memory_gb",
        "actor/perf/max_memory_allocated_gb": "memory_gb",  # 0.8+
    },
    "trl": {
        # GRPOTrainer, RLOOTrainer (0.22+) and the HF Trainer's own keys
        "kl": "kl",
        "entropy": "entropy",
        "loss": "policy_loss",
        "policy_loss": "policy_loss",                   # 1.7+, with an entropy coefficient
        "total_loss": "loss",                           # a plain (SFT, DPO) Trainer's loss: the callback's name
        "grad_norm": "grad_norm",
        "learning_rate": "learning_rate",
        "reward": "reward_mean",
        "reward_std": "reward_std",
        "frac_reward_zero_std": "frac_zero_std",
        "completions/mean_length": "response_length_mean",
        "completions/min_length": "response_length_min",
        "completions/max_length": "response_length_max",
        "completions/clipped_ratio": "response_clip_ratio",
        "completion_length": "response_length_mean",   # 0.14-0.16
        "clip_ratio/region_mean": "pg_clipfrac",
        "clip_ratio": "pg_clipfrac",                    # 0.16
        "step_time": "step_time",                       # 0.27+
        # PPOTrainer 0.12+, RLOOTrainer before 0.22, OnlineDPOTrainer
        "objective/kl": "kl_seq",
        "objective/scores": "reward_mean",
        "loss/policy_avg": "policy_loss",
        "loss/value_avg": "value_loss",
        "policy/clipfrac_avg": "pg_clipfrac",
        "policy/approxkl_avg": "ppo_kl",
        "policy/entropy_avg": "entropy",
        "lr": "learning_rate",
        "eps": "throughput",
        # PPOTrainer before 0.12
        "ppo/policy/entropy": "entropy",
        "ppo/loss/policy": "policy_loss",
        "ppo/loss/value": "value_loss",
        "ppo/loss/total": "loss",
        "ppo/mean_scores": "reward_mean",
        "ppo/std_scores": "reward_std",
        "env/reward_mean": "reward_mean",
        "env/reward_std": "reward_std",
        "ppo/policy/clipfrac": "pg_clipfrac",
        "ppo/policy/approxkl": "ppo_kl",
        "ppo/policy/advantages_mean": "advantage_mean",
        "ppo/learning_rate": "learning_rate",
        "tokens/responses_len_mean": "response_length_mean",
        "time/ppo/total": "step_time",
    },
    "openrlhf": {
        "policy_loss": "policy_loss",
        "critic_loss": "value_loss",
        "kl": "kl",
        "reward": "reward_mean",
        "group_reward_std": "reward_std",
        "response_length": "response_length_mean",
        "response_clip_ratio": "response_clip_ratio",
        "actor_lr": "learning_rate",
        "actor_grad_norm": "grad_norm",
        "critic_grad_norm": "critic_grad_norm",
        "entropy_loss": "entropy",
        "ppo_clip_ratio": "pg_clipfrac",
        "ppo_kl": "ppo_kl",
        "timing/generation": "gen_time",
        "timing/step_total": "step_time",
        "rollout/reward_mean": "reward_mean",
        "rollout/reward_std": "reward_std",
        "rollout/response_length_mean": "response_length_mean",
        "rollout/truncated_rate": "response_clip_ratio",
    },
    "ms-swift": {
        "kl": "kl",
        "loss": "policy_loss",
        "grad_norm": "grad_norm",
        "learning_rate": "learning_rate",
        "reward": "reward_mean",
        "reward_std": "reward_std",
        "frac_reward_zero_std": "frac_zero_std",
        "completions/mean_length": "response_length_mean",
        "completions/min_length": "response_length_min",
        "completions/max_length": "response_length_max",
        "completions/clipped_ratio": "response_clip_ratio",
        "clip_ratio/region_mean": "pg_clipfrac",
        "entropy/mean": "entropy",                      # with --log_entropy
        "memory(GiB)": "memory_gb",
        "train_speed(iter/s)": "throughput",            # 3.x
        "train_speed(s/it)": "step_time",               # 4.x: the inverse
    },
    "mlx-lm": {
        # mlx_lm.lora console lines as printed ("Iter 10: Train loss 2.662, Learning Rate ...")
        "Train loss": "loss",
        "Learning Rate": "learning_rate",
        "It/sec": "throughput",
        "Tokens/sec": "throughput",
        "Peak mem": "memory_gb",
        # ... and the same figures as its logging callbacks (W&B, SwanLab) name them
        "train_loss": "loss",
        "iterations_per_second": "throughput",
        "tokens_per_second": "throughput",
        "peak_memory": "memory_gb",
        # mlx-lm-lora GRPO: console lines of the 0.1 line, then of the 0.4-0.9 line, then callbacks
        "Total rewards mean": "reward_mean",
        "Total rewards std": "reward_std",
        "Grouped rewards std": "reward_std",
        "Average Generated Tokens": "response_length_mean",
        "KL": "kl",
        "total_r_mean": "reward_mean",
        "total_r_std": "reward_std",
        "group_r_std": "reward_std",
        "it/s": "throughput",
        "tok/s": "throughput",
        "peak_mem": "memory_gb",
        "total_rewards_mean": "reward_mean",
        "total_rewards_std": "reward_std",
        "grouped_rewards_std": "reward_std",
        "average_generated_tokens": "response_length_mean",
        "hit_max_tokens_ratio": "response_clip_ratio",
        "clip_ratio_total": "pg_clipfrac",
        "train_total_rewards_mean": "reward_mean",
        "train_total_rewards_std": "reward_std",
        "train_grouped_rewards_std": "reward_std",
        "train_kl": "kl",
        "train_average_generated_tokens": "response_length_mean",
        "train_hit_max_tokens_ratio": "response_clip_ratio",
        "train_clip_ratio_total": "pg_clipfrac",
    },
    "deepspeed-chat": {
        "Actor Loss": "policy_loss",
        "Critic Loss": "value_loss",
        "Average reward score": "reward_mean",
        "act_loss": "policy_loss",                      # before August 2023
        "cri_loss": "value_loss",
        "average reward score": "reward_mean",
        "actor_loss": "policy_loss",                    # its TensorBoard scalars
        "critic_loss": "value_loss",
    },
    "seed": {
        "reward/kl_divergence": "kl",
        "critic/score/std": "reward_std",
        "rollout/latency_ms": "rollout_latency_ms",
        "rollout/empty_response_ratio": "empty_response_ratio",
        "reward/extreme_ratio": "reward_extreme_ratio",
        "actor/forward_latency_ms": "forward_latency_ms",
        "actor/reduce_grad_ms": "reduce_grad_ms",
        "reward_model/oom_count": "reward_model_oom",
        "rollout/worker_crashes": "rollout_worker_crashes",
        "buffer/size": "buffer_size",
        "memory/actor_peak_gb": "memory_gb",
    },
}

# Where each dialect was read (docs/vocabulary.md prints these beside the tables).
SOURCES: dict[str, str] = {
    "verl": "verl-project/verl (formerly volcengine/verl) 0.10.0.dev @1dda039b, compared back to v0.2.0: "
            "verl/trainer/ppo/metric_utils.py (compute_data_metrics, compute_timing_metrics, "
            "compute_throughout_metrics), verl/trainer/ppo/ray_trainer.py (apply_kl_penalty, fit), "
            "verl/workers/utils/losses.py, verl/workers/engine_workers.py; before 0.8 "
            "verl/workers/actor/dp_actor.py and verl/workers/critic/dp_critic.py",
    "trl": "huggingface/trl 1.10.0.dev @f2cd5771, compared back to v0.11.0: trl/trainer/grpo_trainer.py "
           "(_metrics, log), trl/trainer/rloo_trainer.py, trl/experimental/ppo/ppo_trainer.py, "
           "trl/experimental/online_dpo/online_dpo_trainer.py, v0.11.0 trl/trainer/ppo_trainer.py "
           "(record_step_stats); transformers integrations/integration_utils.py (rewrite_logs: the train/ prefix)",
    "openrlhf": "OpenRLHF/OpenRLHF v0.11.0 @3c3be623, compared with v0.5.9-v0.9.10: "
                "openrlhf/trainer/ppo_trainer.py (train_step, save_logs_and_checkpoints), "
                "openrlhf/trainer/ray/ppo_actor.py, openrlhf/trainer/ray/ppo_critic.py, "
                "openrlhf/utils/logging_utils.py (train/<key> in W&B and TensorBoard)",
    "ms-swift": "modelscope/ms-swift 4.6.0.dev @3602360a, compared with v3.12.0 and v4.5.2: "
                "swift/rlhf_trainers/grpo_trainer.py (3.x: swift/trainers/rlhf_trainer/grpo_trainer.py), "
                "swift/rl_core/advantage.py, swift/trainers/patcher.py (memory(GiB), train_speed)",
    "mlx-lm": "ml-explore/mlx-lm v0.31.3 @ed1fca4c: mlx_lm/tuner/trainer.py (the Iter lines), "
              "mlx_lm/tuner/callbacks.py; Goekdeniz-Guelmez/mlx-lm-lora v3.1.2 @dfaaaed5, compared back to "
              "v0.1.9: mlx_lm_lora/trainer/grpo_trainer.py",
    "deepspeed-chat": "deepspeedai/DeepSpeedExamples @45b4b715: applications/DeepSpeed-Chat/training/"
                      "step3_rlhf_finetuning/main.py (both console formats, TensorBoard scalars)",
    "seed": "the seed documents' own names (shared/seeds), which the simulator speaks",
}

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
    the dialect listed first, so verl names beat the seed's and TRL's beat ms-swift's
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

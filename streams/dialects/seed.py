"""The seed documents' own names (shared/seeds), which the simulator speaks."""

NAME = "seed"
ORDER = 70  # where it stands in the tables; on a tie, recognise() picks the lower
# where the names were read (docs/vocabulary.md prints it beside the tables)
SOURCE = "the seed documents' own names (shared/seeds), which the simulator speaks"

NAMES: dict[str, str] = {
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
}

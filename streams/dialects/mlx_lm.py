"""mlx-lm's and mlx-lm-lora's names (Apple silicon): console lines and logging callbacks."""

NAME = "mlx-lm"
ORDER = 50  # where it stands in the tables; on a tie, recognise() picks the lower
# where the names were read (docs/vocabulary.md prints it beside the tables)
SOURCE = ("ml-explore/mlx-lm v0.31.3 @ed1fca4c: mlx_lm/tuner/trainer.py (the Iter lines), "
          "mlx_lm/tuner/callbacks.py; Goekdeniz-Guelmez/mlx-lm-lora v3.1.2 @dfaaaed5, compared back to "
          "v0.1.9: mlx_lm_lora/trainer/grpo_trainer.py")

NAMES: dict[str, str] = {
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
}

"""TRL's names (huggingface/trl): GRPO, RLOO, PPO, online DPO, and the HF Trainer's keys."""

NAME = "trl"
ORDER = 20  # where it stands in the tables; on a tie, recognise() picks the lower
# where the names were read (docs/vocabulary.md prints it beside the tables)
SOURCE = ("huggingface/trl 1.10.0.dev @f2cd5771, compared back to v0.11.0: trl/trainer/grpo_trainer.py "
          "(_metrics, log), trl/trainer/rloo_trainer.py, trl/experimental/ppo/ppo_trainer.py, "
          "trl/experimental/online_dpo/online_dpo_trainer.py, v0.11.0 trl/trainer/ppo_trainer.py "
          "(record_step_stats); transformers integrations/integration_utils.py (rewrite_logs: the train/ prefix)")

# GRPOTrainer's names that ms-swift's GRPO trainer (built on it) logs too: ms_swift.py extends these.
GRPO: dict[str, str] = {
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
}

NAMES: dict[str, str] = {
    # GRPOTrainer, RLOOTrainer (0.22+) and the HF Trainer's own keys
    **GRPO,
    "entropy": "entropy",
    "policy_loss": "policy_loss",                   # 1.7+, with an entropy coefficient
    "total_loss": "loss",                           # a plain (SFT, DPO) Trainer's loss: the callback's name
    "completion_length": "response_length_mean",   # 0.14-0.16
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
}

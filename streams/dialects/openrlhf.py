"""OpenRLHF's names (OpenRLHF/OpenRLHF)."""

NAME = "openrlhf"
ORDER = 30  # where it stands in the tables; on a tie, recognise() picks the lower
# where the names were read (docs/vocabulary.md prints it beside the tables)
SOURCE = ("OpenRLHF/OpenRLHF v0.11.0 @3c3be623, compared with v0.5.9-v0.9.10: "
          "openrlhf/trainer/ppo_trainer.py (train_step, save_logs_and_checkpoints), "
          "openrlhf/trainer/ray/ppo_actor.py, openrlhf/trainer/ray/ppo_critic.py, "
          "openrlhf/utils/logging_utils.py (train/<key> in W&B and TensorBoard)")

NAMES: dict[str, str] = {
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
}

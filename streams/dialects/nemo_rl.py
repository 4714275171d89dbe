"""NeMo-RL's names (NVIDIA-NeMo/RL, formerly NVIDIA/NeMo-RL): GRPO and its loss function."""

NAME = "nemo-rl"
ORDER = 45  # where it stands in the tables; on a tie, recognise() picks the lower
# where the names were read (docs/vocabulary.md prints it beside the tables)
SOURCE = ("NVIDIA-NeMo/RL (formerly NVIDIA/NeMo-RL) @7ea279ab, compared back to v0.3.0: "
          "nemo_rl/algorithms/grpo.py (grpo_train: metrics logged with prefix train, timing_metrics "
          "with timing/train), nemo_rl/algorithms/loss/loss_functions.py (ClippedPGLossFn; "
          "nemo_rl/algorithms/loss_functions.py before 0.7; gen_kl_error since 0.4), "
          "nemo_rl/algorithms/utils.py (calculate_kl: k3 by default), nemo_rl/experience/rollouts.py "
          "(rollout metrics), nemo_rl/utils/logger.py (prefix/name); docs/guides/grpo.md (Metrics: "
          "KL errors below 1e-3 acceptable) and docs/adding-new-models.md (token_mult_prob_error: "
          "1.0 exact, above 1.05 investigate)")

NAMES: dict[str, str] = {
    # ClippedPGLossFn's metrics, summed over micro-batches that are each normalised by the
    # global token count: the batch's token means
    "loss": "policy_loss",                          # the clipped PG loss plus the KL term
    "kl_penalty": "kl",                             # the KL estimate itself (divided by its coefficient)
    "approx_entropy": "entropy",
    "token_mult_prob_error": "mismatch_mult_prob_error",
    "gen_kl_error": "mismatch_kl",                  # KL(P_gen || P_train), reference_policy_kl_type (k3)
    # grpo_train's own
    "grad_norm": "grad_norm",
    "reward": "reward_mean",
    "lr": "learning_rate",
    "advantages/mean": "advantage_mean",
    "advantages/min": "advantage_min",
    "advantages/max": "advantage_max",
    # rollout metrics, logged with the same prefix
    "mean_gen_tokens_per_sample": "response_length_mean",
    "truncation_rate": "response_clip_ratio",       # samples that hit max_seq_len
    "timing/train/total_step_time": "step_time",
    "timing/train/generation": "gen_time",
}

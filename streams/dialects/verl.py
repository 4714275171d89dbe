"""verl's names (verl-project/verl, formerly volcengine/verl)."""

NAME = "verl"
ORDER = 10  # where it stands in the tables; on a tie, recognise() picks the lower
# where the names were read (docs/vocabulary.md prints it beside the tables)
SOURCE = ("verl-project/verl (formerly volcengine/verl) 0.10.0.dev @1dda039b, compared back to v0.2.0: "
          "verl/trainer/ppo/metric_utils.py (compute_data_metrics, compute_timing_metrics, "
          "compute_throughout_metrics), verl/trainer/ppo/ray_trainer.py (apply_kl_penalty, fit), "
          "verl/workers/utils/losses.py, verl/workers/engine_workers.py; before 0.8 "
          "verl/workers/actor/dp_actor.py and verl/workers/critic/dp_critic.py; the mismatch: "
          "verl/utils/debug/metrics.py (calculate_debug_metrics, 0.6+; ray_trainer.py fit in 0.4-0.5), "
          "verl/trainer/ppo/rollout_corr_helper.py (compute_offpolicy_metrics, 0.6.1+; 0.6.0 mismatch_helper.py), "
          "docs/faq/faq.rst (rollout_probs_diff_mean below 0.005, above 0.01 a precision issue)")

NAMES: dict[str, str] = {
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
    # with actor_rollout_ref.rollout.calculate_log_probs=True (0.4+; the correlation 0.6+); the
    # "log_prob diff" of the docstring is taken between probabilities (exp of the log-probs)
    "training/rollout_probs_diff_mean": "mismatch_prob_diff",
    "training/rollout_probs_diff_max": "mismatch_prob_diff_max",
    "training/rollout_actor_probs_pearson_corr": "mismatch_prob_corr",
    # with algorithm.rollout_correction (0.6.1+); 0.6.0 named it mismatch/mismatch_k3_kl. Its
    # rollout_corr/kl is the plain log-ratio mean (k1, can be negative): left out
    "rollout_corr/k3_kl": "mismatch_kl",
    "mismatch/mismatch_k3_kl": "mismatch_kl",
}

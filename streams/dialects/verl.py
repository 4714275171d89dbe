"""verl's names (verl-project/verl, formerly volcengine/verl)."""

NAME = "verl"
ORDER = 10  # where it stands in the tables; on a tie, recognise() picks the lower
# where the names were read (docs/vocabulary.md prints it beside the tables)
SOURCE = ("verl-project/verl (formerly volcengine/verl) 0.10.0.dev @1dda039b, compared back to v0.2.0: "
          "verl/trainer/ppo/metric_utils.py (compute_data_metrics, compute_timing_metrics, "
          "compute_throughout_metrics), verl/trainer/ppo/ray_trainer.py (apply_kl_penalty, fit), "
          "verl/workers/utils/losses.py, verl/workers/engine_workers.py; before 0.8 "
          "verl/workers/actor/dp_actor.py and verl/workers/critic/dp_critic.py")

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
}

"""ms-swift's names (modelscope/ms-swift): TRL's GRPO vocabulary, extended."""

from .trl import GRPO

NAME = "ms-swift"
ORDER = 40  # where it stands in the tables; on a tie, recognise() picks the lower
# where the names were read (docs/vocabulary.md prints it beside the tables)
SOURCE = ("modelscope/ms-swift 4.6.0.dev @3602360a, compared with v3.12.0 and v4.5.2: "
          "swift/rlhf_trainers/grpo_trainer.py (3.x: swift/trainers/rlhf_trainer/grpo_trainer.py), "
          "swift/rl_core/advantage.py, swift/trainers/patcher.py (memory(GiB), train_speed)")

NAMES: dict[str, str] = {
    **GRPO,                                         # its GRPO trainer is TRL's, extended
    "entropy/mean": "entropy",                      # with --log_entropy
    "memory(GiB)": "memory_gb",
    "train_speed(iter/s)": "throughput",            # 3.x
    "train_speed(s/it)": "step_time",               # 4.x: the inverse
}

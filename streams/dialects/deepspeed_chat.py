"""DeepSpeed-Chat's names (DeepSpeedExamples, step 3: RLHF fine-tuning)."""

NAME = "deepspeed-chat"
ORDER = 60  # where it stands in the tables; on a tie, recognise() picks the lower
# where the names were read (docs/vocabulary.md prints it beside the tables)
SOURCE = ("deepspeedai/DeepSpeedExamples @45b4b715: applications/DeepSpeed-Chat/training/"
          "step3_rlhf_finetuning/main.py (both console formats, TensorBoard scalars)")

NAMES: dict[str, str] = {
    "Actor Loss": "policy_loss",
    "Critic Loss": "value_loss",
    "Average reward score": "reward_mean",
    "act_loss": "policy_loss",                      # before August 2023
    "cri_loss": "value_loss",
    "average reward score": "reward_mean",
    "actor_loss": "policy_loss",                    # its TensorBoard scalars
    "critic_loss": "value_loss",
}

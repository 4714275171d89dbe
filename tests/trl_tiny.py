"""A real TRL ``GRPOTrainer`` small enough for a CPU test: a one-layer Qwen2 built in code,
a word-level tokenizer built in code (no download), a toy reward. Faults are injected in
the reward function or around the optimiser, as they happen in real runs."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import trl  # noqa: F401  (deliberately not importorskip: CI must have it)

WORDS = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(61)]
REWARDED = ("w3", "w5")


def build_model(folder: Path) -> str:
    """Save a tiny randomly initialised Qwen2 and its tokenizer to ``folder``; its path.

    GRPO with a KL term loads its reference model from a path, so the model goes to disk."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>", padding_side="left")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True,
        pad_token_id=0, eos_token_id=1, bos_token_id=1))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def warm_start(model_path: str, example, *, steps: int = 60, batch: int = 32, learning_rate: float = 1e-2,
               seed: int = 0) -> str:
    """Supervised steps on one-word answers (``example(rng)`` gives a prompt and its answer word), saved
    over the model: a policy that already does the task some of the time, as an instruct model does
    before RL. Returns ``model_path``."""
    import random

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
    for _ in range(steps):
        pairs = [example(rng) for _ in range(batch)]
        enc = tokenizer([f"{p} {a}" for p, a in pairs], return_tensors="pt", padding=True)  # padded on the left
        loss = torch.nn.functional.cross_entropy(model(**enc).logits[:, -2, :], enc.input_ids[:, -1])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(model_path)
    return model_path


def toy_reward(completions, **kwargs) -> list[float]:
    """One point per rewarded word: spread within every group, most of the time."""
    return [float(sum(w in REWARDED for w in c.split())) for c in completions]


def prompts(n: int = 256):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [" ".join(f"w{(i * 7 + j) % 61}" for j in range(4)) for i in range(n)]})


def grpo_trainer(model_path: str, out: Path, *, reward=toy_reward, max_steps: int = 16, callbacks=(),
                 report_to=("tensorboard",), learning_rate: float = 1e-3, save_steps: int | None = None,
                 dataset=None, **config):
    """A GRPOTrainer on the CPU: 4 completions of up to 32 tokens per prompt, logging every step.
    ``reward``: one function or a list (TRL logs each as ``rewards/<name>/mean``); ``config``
    overrides GRPOConfig's arguments."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_DISABLED", "true")
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(**{**dict(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=32, logging_steps=1, report_to=list(report_to), use_cpu=True,
        learning_rate=learning_rate, seed=0, beta=0.04, disable_tqdm=True,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, save_only_model=False,
        logging_dir=str(out / "tb")), **config})
    return GRPOTrainer(model=model_path, reward_funcs=reward, args=args,
                       train_dataset=prompts() if dataset is None else dataset,
                       callbacks=list(callbacks))

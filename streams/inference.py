"""The signal a metric name no dialect knows most likely stands for, read from its words.

A research loop, a course notebook or a cookbook logs entropy, KL, reward and response length
under its authors' own names (``policy_ent``, ``kl_div``, ``avg_reward``, ``mean_gen_len``). A
dialect cannot list them all, and a collapse logged under such a name used to pass in silence.
The engine asks :func:`infer_signal` for a name that no dialect maps, and judges it with that
signal's rules only where the source logs no dialect name of the same signal (a verl run's
``response_length_non_aborted/mean`` is not judged again as the response length it already
sends). A rules file's ``names:`` pins a name to a signal or refuses an inference
(``docs/rules.md``).

Inference is deliberately narrow: a name is read as a signal only when its words say one
thing. Validation and test metrics, learning rates, coefficients and targets, counts and
per-token maxima of a signal are left alone, and a name whose words point at two signals
(``entropy_loss``, ``reward_model_loss``) is not guessed. A plain ``loss`` is never inferred:
in an RL loop it is a policy loss of any sign, in SFT a training loss, and names alone cannot
tell them apart (``loss_spike_by_name`` judges loss-like names by their pattern).

>>> [infer_signal(n) for n in ("policy_entropy", "train/kl_div", "avg_reward", "mean_gen_len")]
['entropy', 'kl', 'reward_mean', 'response_length_mean']
>>> [infer_signal(n) for n in ("Rewards/Accuracy", "gradNorm", "reward_std", "pg_loss", "approx_kl")]
['reward_mean', 'grad_norm', 'reward_std', 'policy_loss', 'ppo_kl']
>>> [infer_signal(n) for n in ("val/reward", "kl_coef", "entropy_loss", "loss", "prompt_len", "lr")]
[None, None, None, None, None, None]
"""

from __future__ import annotations

import re
from functools import lru_cache

# camelCase and digits split from words; every other non-letter separates words
_CAMEL = re.compile(r"(?<=[a-z])(?=[A-Z])|(?<=[A-Za-z])(?=[0-9])|(?<=[0-9])(?=[A-Za-z])")
_SPLIT = re.compile(r"[^a-z0-9]+")

# A name with one of these words is not a training signal of the step (or not the signal itself).
_NOT_A_SIGNAL = frozenset({
    "val", "valid", "validation", "eval", "evaluation", "test", "heldout", "holdout",
    "coef", "coeff", "coefficient", "beta", "alpha", "target", "weight", "budget", "lr", "learning",
    "count", "num", "number", "total", "sum", "step", "steps", "epoch", "time", "timing", "ms", "sec", "seconds",
    "threshold", "clip", "clipped", "clipfrac", "delta", "diff", "change", "ratio", "pct", "percent", "frac",
    "fraction", "zero", "prompt", "ref", "reference", "model", "rm", "baseline", "estimate", "p50", "p90", "p99",
})
_STAT = {"min": "min", "minimum": "min", "max": "max", "maximum": "max", "std": "std", "stdev": "std",
         "stddev": "std"}

# signal family -> the words any one of which names it
_FAMILIES: dict[str, frozenset[str]] = {
    "entropy": frozenset({"entropy", "ent"}),
    "kl": frozenset({"kl", "kld", "kldiv"}),
    "reward": frozenset({"reward", "rewards", "score", "scores", "accuracy"}),
    "length": frozenset({"length", "len", "lengths"}),
    "grad_norm": frozenset({"gradnorm"}),
    "loss": frozenset({"loss", "losses"}),
}
_RESPONSE = frozenset({"response", "responses", "completion", "completions", "generation", "gen", "output",
                       "answer", "resp", "sampled"})
_POLICY = frozenset({"policy", "pg", "actor", "surrogate", "ppo", "grpo", "clip"})
_VALUE = frozenset({"value", "critic", "vf"})


def words(name: str) -> list[str]:
    """``"train/policyEntropy_mean"`` -> ``['train', 'policy', 'entropy', 'mean']``."""
    return [w for w in _SPLIT.split(_CAMEL.sub(" ", name).lower()) if w]


@lru_cache(maxsize=8192)
def infer_signal(name: str) -> str | None:
    """The canonical signal (``streams/signals.py``) ``name``'s words say, or None when they
    say none or more than one."""
    ws = words(name)
    joined = set(ws)
    # "grad norm", "gradient_norm", "gnorm": one family word
    for i in range(len(ws) - 1):
        if ws[i] in ("grad", "gradient", "grads") and ws[i + 1] in ("norm", "norms", "l2"):
            joined.add("gradnorm")
    if "kl" in joined and "div" in joined:
        joined.add("kldiv")
    families = {f for f, vocab in _FAMILIES.items() if joined & vocab}
    if "length" in families and not joined & _RESPONSE:
        families.discard("length")  # a prompt's, a sequence's, a queue's length
    if "kl" in families and "loss" in families:
        families.discard("loss")  # a KL loss is the KL term the trainer adds
    if "grad_norm" in families:
        families &= {"grad_norm"}
    if len(families) != 1:
        return None
    family = families.pop()
    if family == "loss":
        if joined & _VALUE and not joined & _POLICY:
            return "value_loss"
        if joined & _POLICY and not joined & _VALUE:
            return "policy_loss"
        return None
    if joined & _NOT_A_SIGNAL:
        return None
    stats = {_STAT[w] for w in ws if w in _STAT}
    if len(stats) > 1:
        return None
    stat = stats.pop() if stats else "mean"
    if family == "grad_norm":
        if stat != "mean":
            return None
        return "critic_grad_norm" if joined & _VALUE else "grad_norm"
    if family == "kl":
        if stat != "mean":
            return None
        if "penalty" in joined:
            return "kl_penalty"
        return "ppo_kl" if joined & {"approx", "approxkl", "old"} else "kl"
    if family == "entropy":
        return "entropy" if stat == "mean" else None
    if family == "reward":
        return f"reward_{stat}"
    return f"response_length_{stat}"  # length, of responses

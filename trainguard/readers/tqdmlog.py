"""tqdm progress bars with a postfix of metrics, as OpenRLHF's trainers print them::

    (PolicyModelActor pid=812) Train epoch [1/1]:  50%|█████     | 2/4 [00:06<00:06, 3.01s/it,
        act_loss=0.0123, reward=0.5, return=0.48, gen_len=312, tot_len=512, kl=0.00012, act_lr=5e-7, grad_norm=0.31]
    Episode [1/2]:  10%|█         | 1/10 [01:10<10:30, 70.0s/it, policy_loss=0.0123, kl=0.0001, reward=0.52]

(each bar on one line; broken here for width).

``pbar.set_postfix(status)``: OpenRLHF's actor (``ray/ppo_actor.py``) sets a short status
(``act_loss``, ``reward``, ``return``, ``gen_len``, ``tot_len``, ``kl``, ``act_lr``,
``grad_norm``, ``ent_loss``) once per training micro-step, its critic its status
(``critic_loss``, ``values`` ...), and before v0.9 the ``Episode`` bar of ``ppo_trainer.py``
the whole status of a global step. tqdm prints each value with ``{:.3g}`` (``nan``, ``inf`` as
Python prints them) and writes each refresh after a ``\\r``, so one line of a captured log holds
many; Ray prefixes each line with its actor.

Each new postfix of a bar is a step (the Nth is step N); a bar redrawn with the same postfix
(a tick of its counter, its close) is the same step. The actor's short names are read as the
names OpenRLHF logs (``act_loss`` -> ``policy_loss``, ``gen_len`` -> ``response_length``,
``grad_norm`` -> ``actor_grad_norm`` ...), so they are the signals the rules know. Lines that are
no bar with a postfix are passed over; a postfix value that is no number is left out and counted.
"""

from __future__ import annotations

import re
from typing import Iterator

from .base import LineReader, Step, to_float
from .verl import ANSI

# "<desc>: 50%|<bar>| 2/4 [00:06<00:06, 3.01s/it, k=v, ...]" or, without a total, "<desc>: 2it [00:06, 3.01s/it, k=v]".
# The counter is anchored before the stats so a postfix value holding "[" cannot start a match.
BAR = re.compile(r"(?:\d+%\|[^|\r\n]*\|\s*\d+/\S+|\d+(?:it|[a-zA-Z]+)?)\s+\[(?P<stats>[^\[\]\r\n]*)\]\s*$")
KEY = re.compile(r"[A-Za-z_][\w/.\-]*")
# OpenRLHF's actor shortens its names for the bar; these are the names it logs.
OPENRLHF_SHORT = {"act_loss": "policy_loss", "gen_len": "response_length", "tot_len": "total_length",
                  "act_lr": "actor_lr", "grad_norm": "actor_grad_norm", "ent_loss": "entropy_loss"}
MAX_SEGMENT = 100_000  # a bar is a few hundred characters


def bar_postfix(segment: str) -> tuple[str, str] | None:
    """``(bar identity, postfix text)`` of one bar refresh, or None when it is no bar with a postfix."""
    if len(segment) > MAX_SEGMENT or "=" not in segment or "[" not in segment:
        return None
    m = BAR.search(segment.rstrip())
    if m is None:
        return None
    parts = m.group("stats").split(", ")
    postfix = [p for p in parts if "=" in p]
    if not postfix:
        return None
    identity = segment[:m.start()].rsplit(":", 1)[0].strip()  # Ray prefix and description
    return identity, ", ".join(postfix)


def parse_postfix(text: str) -> tuple[dict[str, float], int]:
    """``(metrics, unreadable values)`` of a postfix ``k=v, k=v``."""
    metrics: dict[str, float] = {}
    bad = 0
    for item in text.split(", "):
        key, _, value = item.partition("=")
        key = key.strip()
        if not KEY.fullmatch(key):
            bad += 1
            continue
        number = to_float(value)
        if number is None:
            bad += 1
            continue
        metrics[key] = number
    if "act_loss" in metrics:  # OpenRLHF's actor: its short names
        metrics = {OPENRLHF_SHORT.get(k, k): v for k, v in metrics.items()}
    return metrics, bad


def looks_like_tqdm(lines: list[str]) -> bool:
    """Whether any of ``lines`` holds a bar with a postfix (for format detection)."""
    return any(bar_postfix(seg) for line in lines for seg in _segments(line))


def _segments(line: str) -> list[str]:
    if "\x1b" in line:
        line = ANSI.sub("", line)
    return line.split("\r")


class TqdmPostfixReader(LineReader):
    format = "tqdm"
    merge_steps = False  # each new postfix is a step

    def __init__(self, path):
        super().__init__(path)
        self.bad_values = 0

    def records(self) -> Iterator[Step]:
        step = 0
        last: dict[str, str] = {}  # bar identity -> its last postfix
        for _number, line in self.lines():
            for segment in _segments(line):
                found = bar_postfix(segment)
                if found is None:
                    continue
                identity, postfix = found
                if last.get(identity) == postfix:
                    continue  # the same step redrawn
                last[identity] = postfix
                metrics, bad = parse_postfix(postfix)
                self.bad_values += bad
                if metrics:
                    step += 1
                    yield step, metrics

    def stats(self) -> dict:
        return {**super().stats(), "bad_values": self.bad_values}


__all__ = ["TqdmPostfixReader", "looks_like_tqdm", "parse_postfix", "bar_postfix"]

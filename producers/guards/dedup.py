"""Prompt de-duplication: near-duplicate prompts (MinHash LSH) are sampled again only after a
minimum interval, so that a frequent query cannot dominate training.

>>> dedup = PromptDeduplicator(min_interval=1000)            # in prompts; or unit="steps"
>>> dedup.admit("What is the capital of France?")
True
>>> dedup.admit("what is the capital of  France ?")          # a small edit, soon after
False
>>> dedup.counts["guard/dedup/rejected"]
1.0

Similarity is the Jaccard similarity of character 5-grams of the normalised text (lower case,
runs of white space as one space), estimated by MinHash and looked up with datasketch's LSH,
so a lookup costs the same whatever the number of prompts held; LSH's candidates count only when
their estimated similarity reaches the threshold. Only prompts admitted within the last interval
are held (about 1.5 KB each with 128 permutations): older ones can no longer refuse anything.
"""

from __future__ import annotations

import collections
import re
import time
from typing import Iterable

from trainguard.producers.guards._events import GuardEvents
from trainguard.producers.trainer import TrainerLogger

UNITS = ("prompts", "steps", "seconds")
_SPACE = re.compile(r"\s+")


def shingles(text: str, ngram: int = 5) -> set[bytes]:
    """The character ``ngram``-grams of ``text``, normalised: what similarity is measured on."""
    norm = _SPACE.sub(" ", text.lower()).strip()
    if len(norm) <= ngram:
        return {norm.encode("utf-8", "surrogatepass")}
    return {norm[i:i + ngram].encode("utf-8", "surrogatepass") for i in range(len(norm) - ngram + 1)}


def _datasketch():
    try:
        import datasketch
    except ImportError as exc:
        raise ImportError("trainguard's de-duplication and score cache need datasketch: "
                          "pip install 'trainguard[guards]'") from exc
    return datasketch


def minhash(text: str, *, num_perm: int = 128, ngram: int = 5):
    MinHash = _datasketch().MinHash

    m = MinHash(num_perm=num_perm)
    m.update_batch(list(shingles(text, ngram)))
    return m


class SimilarTexts:
    """The last ``capacity`` texts, each with a value, and the ones similar to a new text.

    Shared by the de-duplicator (value: when it was admitted) and the breaker's score cache
    (value: the score it got)."""

    def __init__(self, *, threshold: float = 0.7, num_perm: int = 128, ngram: int = 5, capacity: int = 100_000):
        MinHashLSH = _datasketch().MinHashLSH

        if not 0.0 < threshold < 1.0:
            raise ValueError(f"threshold must be between 0 and 1 (a Jaccard similarity), got {threshold!r}")
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity!r}")
        self.num_perm, self.ngram, self.capacity, self.threshold = num_perm, ngram, capacity, threshold
        # Bands tuned to miss few near-duplicates; the candidates' false positives are then
        # weeded out by their estimated similarity.
        self._lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=(0.1, 0.9))
        self._order: collections.deque[int] = collections.deque()
        self.values: dict[int, object] = {}
        self._hashes: dict[int, object] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self.values)

    def hash(self, text: str):
        return minhash(text, num_perm=self.num_perm, ngram=self.ngram)

    def similar(self, m) -> list[object]:
        """Values of the held texts similar to the text of MinHash ``m``."""
        mine = m.hashvalues
        return [self.values[k] for k in self._lsh.query(m)
                if (self._hashes[k] == mine).mean() >= self.threshold]

    def add(self, m, value) -> None:
        key = self._next
        self._next += 1
        self._lsh.insert(key, m)
        self.values[key] = value
        self._hashes[key] = m.hashvalues
        self._order.append(key)
        while len(self._order) > self.capacity:
            self.pop_oldest()

    def oldest(self):
        return self.values[self._order[0]] if self._order else None

    def pop_oldest(self) -> None:
        key = self._order.popleft()
        self._lsh.remove(key)
        del self.values[key]
        del self._hashes[key]


class PromptDeduplicator:
    """Admit a prompt unless a near-duplicate was admitted less than ``min_interval`` ago.

    ``unit``: ``prompts`` (counted by this object), ``steps`` (``admit(..., step=)`` required) or
    ``seconds``. ``threshold``: the Jaccard similarity from which two prompts are near-duplicates.
    ``events``: the trainer's ``TrainerLogger``, to publish the counts (``guard/dedup/*``).
    """

    def __init__(self, *, min_interval: float = 1000, unit: str = "prompts", threshold: float = 0.7,
                 num_perm: int = 128, ngram: int = 5, capacity: int = 1_000_000,
                 events: TrainerLogger | None = None, name: str = "dedup", clock=time.monotonic):
        if unit not in UNITS:
            raise ValueError(f"unit must be one of {', '.join(UNITS)}; got {unit!r}")
        if not min_interval > 0:
            raise ValueError(f"min_interval must be positive, got {min_interval!r}")
        self.min_interval, self.unit, self.clock = min_interval, unit, clock
        self.index = SimilarTexts(threshold=threshold, num_perm=num_perm, ngram=ngram, capacity=capacity)
        self.events = GuardEvents(events, name)
        self.prefix = f"guard/{name}/"
        self.counts = {self.prefix + k: 0.0 for k in ("seen", "admitted", "rejected")}
        self._prompts = 0

    def _now(self, step: int | None) -> float:
        if self.unit == "prompts":
            return float(self._prompts)
        if self.unit == "seconds":
            return self.clock()
        if type(step) is not int:
            raise ValueError("unit='steps' needs the step: admit(prompt, step=N)")
        return float(step)

    def admit(self, prompt: str, *, step: int | None = None) -> bool:
        """True: sample this prompt now (it is remembered); False: a near-duplicate is too recent."""
        if not isinstance(prompt, str):
            raise TypeError(f"a prompt must be a str, got {type(prompt).__name__}")
        now = self._now(step)
        self._prompts += 1
        index = self.index
        # admissions older than the interval cannot refuse anything: forget them
        while len(index) and now - index.oldest() >= self.min_interval:
            index.pop_oldest()
        m = index.hash(prompt)
        self.counts[self.prefix + "seen"] += 1
        recent = index.similar(m)
        if recent:
            self.counts[self.prefix + "rejected"] += 1
            ok = False
        else:
            index.add(m, now)
            self.counts[self.prefix + "admitted"] += 1
            ok = True
        self.events.report({**self.counts, self.prefix + "held": float(len(index))}, step=step)
        return ok

    def filter(self, prompts: Iterable[str], *, step: int | None = None) -> list[int]:
        """Indices of the prompts admitted, in order (near-duplicates within the batch count too)."""
        return [i for i, p in enumerate(prompts) if self.admit(p, step=step)]

"""Real text for the guards' tests: prompts built from the first paragraphs of the standard
library's docstrings (hundreds of distinct English sentences on this interpreter), and the
small edits that make near-duplicates of them in real prompt sets."""

from __future__ import annotations

import functools
import importlib
import inspect
import random

from trainguard.producers.guards.dedup import shingles

MODULES = ("os", "re", "json", "collections", "itertools", "functools", "string", "textwrap", "math", "statistics",
           "pathlib", "shutil", "datetime", "random", "heapq", "bisect", "inspect", "socket", "subprocess",
           "threading", "asyncio", "logging", "csv", "zipfile", "tarfile", "hashlib", "base64", "urllib.parse",
           "difflib", "pprint", "operator", "copy", "decimal", "fractions", "struct", "uuid", "tempfile", "glob",
           "sqlite3", "calendar", "io", "gzip", "pickle", "weakref", "contextlib", "enum", "dataclasses", "argparse")
ASKS = ("How do I use {q} for this?", "Can you show an example with {q}?", "When should I prefer {q}?",
        "Explain {q} to a beginner.", "What are the pitfalls of {q}?")


def jaccard(a: str, b: str) -> float:
    x, y = shingles(a), shingles(b)
    return len(x & y) / len(x | y)


@functools.lru_cache(maxsize=4)
def prompts(limit: int = 400, max_similarity: float = 0.5) -> list[str]:
    """Distinct prompts: no two closer than ``max_similarity`` (exact Jaccard of 5-grams)."""
    out: list[str] = []
    kept: list[set] = []
    for m in MODULES:
        mod = importlib.import_module(m)
        for i, name in enumerate(sorted(dir(mod))):
            obj = getattr(mod, name)
            doc = inspect.getdoc(obj) if not name.startswith("_") and callable(obj) else None
            if not doc:
                continue
            line = doc.strip().split("\n\n")[0].replace("\n", " ")
            if not 50 <= len(line) <= 220:
                continue
            text = f"{line} {ASKS[i % len(ASKS)].format(q=f'{m}.{name}')}"
            s = shingles(text)
            if any(len(s & k) / len(s | k) >= max_similarity for k in kept):
                continue
            out.append(text)
            kept.append(s)
            if len(out) == limit:
                return out
    return out


def edit(text: str, rng: random.Random) -> str:
    """One small edit a user or a data pipeline makes: case, spacing, a typo, a word dropped,
    punctuation, a polite prefix."""
    words = text.split(" ")
    kind = rng.randrange(6)
    if kind == 0:
        return text.lower()
    if kind == 1:
        return "  ".join(words)
    if kind == 2:  # swap two letters of one longer word
        i = max(range(len(words)), key=lambda j: (len(words[j]), rng.random()))
        w = words[i]
        k = rng.randrange(1, len(w) - 2)
        words[i] = w[:k] + w[k + 1] + w[k] + w[k + 2:]
        return " ".join(words)
    if kind == 3:
        del words[rng.randrange(len(words))]
        return " ".join(words)
    if kind == 4:
        return text.rstrip("?.!") + "??"
    return "Please help: " + text

"""Rollout validation: results that cannot be trained on are dropped before the buffer, and
counted by reason.

>>> gate = RolloutValidator(max_tokens=512, count_tokens=lambda t: len(t.split()))
>>> batch = gate.filter(["4", "", "ok\\x00"])
>>> batch.kept, [(d.index, d.reason) for d in batch.dropped]
(['4'], [(1, 'empty'), (2, 'illegal_char')])

Reasons, in the order they are checked: ``not_text`` (not a str), ``empty`` (nothing but white
space), ``illegal_char`` (NUL, other C0 control characters but tab, newline and carriage
return, lone surrogates), ``too_long`` (over ``max_tokens`` or ``max_chars``), ``not_json`` and
``schema`` (with ``schema``: the text must be a JSON document the JSON Schema accepts).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

from trainguard.producers.guards._events import GuardEvents
from trainguard.producers.trainer import TrainerLogger

REASONS = ("not_text", "empty", "illegal_char", "too_long", "not_json", "schema")
# NUL and the C0 controls a tokenizer never meant to produce; lone UTF-16 surrogates (a str
# decoded with surrogateescape/surrogatepass, or a model emitting half a pair).
ILLEGAL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff]")


@dataclass
class Dropped:
    index: int
    reason: str
    detail: str = ""


@dataclass
class Checked:
    """One batch through the gate: what is kept (and where it was), what was dropped and why."""

    kept: list = field(default_factory=list)
    kept_indices: list[int] = field(default_factory=list)
    dropped: list[Dropped] = field(default_factory=list)


class RolloutValidator:
    """``max_tokens`` needs token counts: ``filter(texts, token_counts=[...])`` (what the
    trainer already has) or ``count_tokens`` (``lambda t: len(tokenizer(t).input_ids)``).
    ``schema``: a JSON Schema (a dict) every result must satisfy, for structured output.
    ``events``: the trainer's ``TrainerLogger`` (counts as ``guard/<name>/*``)."""

    def __init__(self, *, max_tokens: int | None = 512, max_chars: int | None = None,
                 count_tokens: Callable[[str], int] | None = None, schema: dict | None = None,
                 allow_empty: bool = False, events: TrainerLogger | None = None, name: str = "rollout"):
        self.max_tokens, self.max_chars, self.count_tokens = max_tokens, max_chars, count_tokens
        self.allow_empty = allow_empty
        self._schema = None
        if schema is not None:
            try:
                import jsonschema
            except ImportError:
                raise ImportError("a JSON Schema gate needs the jsonschema package: pip install jsonschema") from None
            cls = jsonschema.validators.validator_for(schema)
            cls.check_schema(schema)  # a broken schema is the caller's error, said now
            self._schema = cls(schema)
        self.events = GuardEvents(events, name)
        self.prefix = f"guard/{name}/"
        self.counts = {self.prefix + k: 0.0 for k in ("checked", "kept", "dropped")}
        self.counts.update({f"{self.prefix}dropped/{r}": 0.0 for r in REASONS})

    def reason(self, text, tokens: int | None = None) -> tuple[str, str] | None:
        """Why ``text`` must be dropped, as ``(reason, detail)``; None if it may be kept."""
        if not isinstance(text, str):
            return "not_text", type(text).__name__
        if not self.allow_empty and not text.strip():
            return "empty", ""
        bad = ILLEGAL.search(text)
        if bad:
            return "illegal_char", f"U+{ord(bad.group()):04X} at {bad.start()}"
        if self.max_chars is not None and len(text) > self.max_chars:
            return "too_long", f"{len(text)} characters > {self.max_chars}"
        if self.max_tokens is not None:
            if tokens is None:
                if self.count_tokens is None:
                    raise ValueError("max_tokens needs token counts: filter(texts, token_counts=...) "
                                     "or RolloutValidator(count_tokens=...)")
                tokens = self.count_tokens(text)
            if tokens > self.max_tokens:
                return "too_long", f"{tokens} tokens > {self.max_tokens}"
        if self._schema is not None:
            try:
                doc = json.loads(text)
            except ValueError as exc:
                return "not_json", str(exc)
            error = next(iter(self._schema.iter_errors(doc)), None)
            if error is not None:
                where = "/".join(map(str, error.absolute_path)) or "(root)"
                return "schema", f"{where}: {error.message}"[:300]
        return None

    def filter(self, texts: Sequence, *, token_counts: Sequence[int] | None = None,
               step: int | None = None) -> Checked:
        """Check a batch: the kept texts in order, and each dropped one with its reason."""
        if token_counts is not None and len(token_counts) != len(texts):
            raise ValueError(f"{len(token_counts)} token counts for {len(texts)} texts")
        out = Checked()
        p = self.prefix
        for i, text in enumerate(texts):
            why = self.reason(text, None if token_counts is None else int(token_counts[i]))
            if why is None:
                out.kept.append(text)
                out.kept_indices.append(i)
            else:
                out.dropped.append(Dropped(i, *why))
                self.counts[f"{p}dropped/{why[0]}"] += 1
        self.counts[p + "checked"] += len(texts)
        self.counts[p + "kept"] += len(out.kept)
        self.counts[p + "dropped"] += len(out.dropped)
        batch = {p + "batch_dropped_fraction": len(out.dropped) / len(texts) if len(texts) else 0.0}
        reasons = sorted({d.reason for d in out.dropped})
        self.events.report({**self.counts, **batch}, step=step, decision="dropped" if out.dropped else None,
                           reason=",".join(reasons) or None)
        return out

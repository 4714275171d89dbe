"""CrossRank: a straggler — one rank far from its peers at the same step."""

from __future__ import annotations

from typing import Hashable

import numpy as np

from .base import Param, Stateful, is_finite

__all__ = ["CrossRank"]

MAD_TO_STD = 1.4826


def _key(s):
    return tuple(_key(v) for v in s) if isinstance(s, list) else s


class CrossRank(Stateful):
    """Straggler detection: values of one metric from several ranks at the same step.

    ``add(step, rank, value)`` collects; ``complete(step)`` judges the step and forgets
    it, returning the flagged ranks as ``(rank, value, median, robust_z)``. A rank is
    flagged when at least ``min_peers`` ranks reported, its robust z against the
    cross-rank median/MAD is beyond ``z`` and its value is beyond ``ratio`` × the median
    (e.g. a step time 2x the median). The MAD is floored at ``rel_floor`` × |median| so
    identical peers do not turn a 1% difference into an infinite z. ``direction`` "high"
    (slow rank), "low" or "both". At most ``max_pending`` steps are held; the oldest is
    dropped. Non-finite values are ignored here.

    Cost: O(R log R) per completed step for R ranks.

    >>> cr = CrossRank(min_peers=4, ratio=2.0)
    >>> for rank, v in enumerate([1.0, 1.02, 0.98, 1.01, 2.6, 0.99]):
    ...     cr.add(7, rank, v)
    >>> [(r, v, m) for r, v, m, z in cr.complete(7)]
    [(4, 2.6, 1.005)]
    >>> cr.evidence()["peers"]
    6
    """

    kind = "cross_rank"
    params = (Param("min_peers", 4, int, "ranks that must report a step before it is judged (at least 2)"),
              Param("ratio", 2.0, float, "a flagged rank is also this many times the median (null: z alone)",
                    optional=True),
              Param("z", 3.5, float, "robust z beyond which a rank is far from its peers"),
              Param("direction", "high", str, "slow ranks (high), low ones, or both", choices=("high", "low", "both")),
              Param("rel_floor", 0.05, float, "the MAD is at least this share of the median"),
              Param("max_pending", 64, int, "steps held while their ranks report; the oldest is dropped"))
    cost = "O(R log R) per step for R ranks"

    def __init__(self, min_peers: int = 4, ratio: float | None = 2.0, z: float = 3.5,
                 direction: str = "high", rel_floor: float = 0.05, max_pending: int = 64):
        if direction not in ("high", "low", "both"):
            raise ValueError("direction must be high, low or both")
        self.min_peers = max(2, int(min_peers))
        self.ratio = float(ratio) if ratio is not None else None
        self.z = float(z)
        self.direction = direction
        self.rel_floor = float(rel_floor)
        self.max_pending = max(1, int(max_pending))
        self.pending: dict[Hashable, dict[Hashable, float]] = {}
        self.last: dict | None = None

    def add(self, step: Hashable, rank: Hashable, value: float) -> None:
        if not is_finite(value):
            return
        bucket = self.pending.get(step)
        if bucket is None:
            if len(self.pending) >= self.max_pending:
                self.pending.pop(next(iter(self.pending)))
            bucket = self.pending[step] = {}
        bucket[rank] = float(value)

    def peers(self, step: Hashable) -> int:
        return len(self.pending.get(step, ()))

    def complete(self, step: Hashable) -> list[tuple[Hashable, float, float, float]]:
        bucket = self.pending.pop(step, None) or {}
        n = len(bucket)
        if n < self.min_peers:
            self.last = {"step": step, "peers": n, "flagged": [], "ready": False}
            return []
        vals = np.fromiter(bucket.values(), dtype=float, count=n)
        med = float(np.median(vals))
        mad = float(np.median(np.abs(vals - med)))
        scale = max(MAD_TO_STD * mad, self.rel_floor * abs(med), 1e-12)
        out = []
        for rank, v in bucket.items():
            z = (v - med) / scale
            if self.direction == "high":
                hit = z > self.z and (self.ratio is None or v >= self.ratio * med)
            elif self.direction == "low":
                hit = -z > self.z and (self.ratio is None or v * self.ratio <= med)
            else:
                far = (self.ratio is None or v >= self.ratio * med or v * self.ratio <= med)
                hit = abs(z) > self.z and far
            if hit:
                out.append((rank, v, med, z))
        out.sort(key=lambda r: -abs(r[3]))
        self.last = {"step": step, "peers": n, "median": med, "mad": mad, "scale": scale,
                     "min": float(vals.min()), "max": float(vals.max()),
                     "flagged": [list(r) for r in out], "ready": True}
        return out

    def evidence(self) -> dict:
        ev = {"detector": self.kind, "ratio": self.ratio, "z": self.z,
              "min_peers": self.min_peers}
        ev.update(self.last or {"ready": False})
        return ev

    def to_state(self) -> dict:
        d = super().to_state()
        d["state"] = {
            "pending": [[s, [[r, v] for r, v in b.items()]] for s, b in self.pending.items()],
            "last": self.last,
        }
        return d

    @classmethod
    def from_state(cls, d: dict) -> "CrossRank":
        obj = cls(**d["params"])
        obj.pending = {_key(s): {_key(r): v for r, v in b} for s, b in d["state"]["pending"]}
        obj.last = d["state"]["last"]
        return obj

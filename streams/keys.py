"""The keys of the worker's tables and their changelogs, in one place.

- a run's state: the run id (``ppo-7b``); run ids never hold ``|`` (``schemas.events.RUN_ID``)
- a source's state: ``<run id>|<source id>`` (``ppo-7b|trainer:gpu-01:0:-``)
- a source's per-interval aggregates in the windowed table's changelog:
  ``<source key>@<window start>`` (``ppo-7b|trainer:gpu-01:0:-@1764400020``)
- the checkpoint's flush marker: ``|flush``, a key no run or source can have

>>> source_key("ppo-7b", "trainer:gpu-01:0:-")
b'ppo-7b|trainer:gpu-01:0:-'
>>> is_run_key(b"ppo-7b"), is_run_key(b"ppo-7b|trainer:gpu-01:0:-"), is_run_key(FLUSH_MARKER)
(True, False, False)
>>> window_key(b"ppo-7b|node:n1:-:-", 1764400020.0)
b'ppo-7b|node:n1:-:-@1764400020'
>>> split_window_key(b"ppo-7b|node:n1:-:-@1764400020")
(b'ppo-7b|node:n1:-:-', 1764400020.0)
"""

from __future__ import annotations

FLUSH_MARKER = b"|flush"


def source_key(run_id: str, source_id: str) -> bytes:
    return f"{run_id}|{source_id}".encode()


def is_run_key(key: bytes) -> bool:
    """A run's own entry (not one of its sources', nor the flush marker)."""
    return b"|" not in key


def window_key(source_key: bytes, start: float) -> bytes:
    return source_key + b"@" + str(int(start)).encode()


def split_window_key(raw: bytes) -> tuple[bytes, float] | None:
    """``(source key, window start)``, or None for a key that is not a window's."""
    if b"@" not in raw:
        return None
    skey, _, start = raw.rpartition(b"@")
    try:
        return skey, float(start)
    except ValueError:
        return None

"""Framework dialects: the metric names each trainer logs, one file per framework.

Each module is data: ``NAME`` (the framework as ``recognise()`` and the docs name it),
``ORDER`` (its column in docs/vocabulary.md; on a tie ``recognise()`` picks the lower),
``SOURCE`` (where the names were read, checked in the framework's own code) and ``NAMES``
(logged name, without a ``train/`` prefix -> canonical signal of ``streams/signals.py``). A
framework built on another extends its names (``ms_swift.py`` starts from ``trl.GRPO``).
Every module in this folder is read, so a framework is one new file; ``streams/signals.py``
checks that no name means two signals and that every signal exists.
"""

from __future__ import annotations

import importlib
import pkgutil

__all__ = ["DIALECTS", "SOURCES"]


def _load() -> list:
    modules = [importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__)
               if not m.name.startswith("_")]
    for m in modules:
        missing = [k for k in ("NAME", "ORDER", "SOURCE", "NAMES") if not hasattr(m, k)]
        if missing:
            raise TypeError(f"dialect {m.__name__} lacks {', '.join(missing)}")
    names = [m.NAME for m in modules]
    if len(set(names)) != len(names):
        raise TypeError(f"two dialects share a NAME: {sorted(names)}")
    return sorted(modules, key=lambda m: (m.ORDER, m.NAME))


_MODULES = _load()
DIALECTS: dict[str, dict[str, str]] = {m.NAME: m.NAMES for m in _MODULES}  # framework -> {name: signal}
SOURCES: dict[str, str] = {m.NAME: m.SOURCE for m in _MODULES}            # framework -> where it was read

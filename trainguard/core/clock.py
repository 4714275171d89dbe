"""Times from a topic shown on a clock: total, whatever a record holds."""

from __future__ import annotations

import time


def local_time(ts, fmt: str = "%Y-%m-%d %H:%M:%S", missing: str = "?") -> str:
    """``ts`` (seconds since the epoch) as local time in ``fmt``; ``missing`` for what no clock
    shows (not a number, NaN, a year past the platform's range): a record's ``expires``, ``ts``
    or ``until`` is whatever its writer put there, and must never crash the reader."""
    if type(ts) not in (int, float):
        return missing
    try:
        return time.strftime(fmt, time.localtime(ts))
    except (ValueError, OverflowError, OSError):
        return missing

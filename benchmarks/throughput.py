"""Figures 2 and 6: events/s and metric samples/s of the worker against a bare Faust agent and
a raw aiokafka loop, on the same pre-filled topic; one worker against two in a group.

Each consumer runs in its own process (``consumer_main.py``) and reads the whole topic from
the beginning under a fresh group id. The rate is ``N / (t_last - t_first)``: from the moment
the first event is handed to the consumer's code to the moment the last one is done, so
process start-up, the group join (about 4 s on the embedded broker) and the first fetch are
not counted. For a group, t_first is the earliest first event of any member and t_last the
latest last event of all of them. The consumers' CPU time over the same span is reported too
(cores used, events per CPU-second): it tells a design that stops scaling from a machine that
ran out of cores.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path

from workload import Child

SCRIPT = str(Path(__file__).resolve().parent / "consumer_main.py")
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


class Member:
    def __init__(self) -> None:
        self.first: float | None = None
        self.last = 0.0
        self.events = 0
        self.samples = 0


def consume(mode: str, settings, n_expected: int, log_dir: Path, members: int = 1, measure_s: float = 60.0,
            app_id: str | None = None, startup_s: float = 60.0) -> dict:
    """Run ``members`` consumers of ``mode`` (one group) until they have handled ``n_expected``
    events or ``measure_s`` seconds have passed since the first one (the rate is then over
    what was handled: the topic still holds more, so the consumer was never idle)."""
    app_id = app_id or f"bench-{mode}-{uuid.uuid4().hex[:6]}"
    prefix = settings.topics.events.rsplit(".", 1)[0]
    changed = threading.Event()
    state: dict[Child, Member] = {}

    def on_line(child: Child, line: str) -> None:
        parts = line.split()
        if not parts:
            return
        m = state.setdefault(child, Member())
        if parts[0] == "F":
            m.first = float(parts[1])
        elif parts[0] == "P":
            m.last, m.events, m.samples = float(parts[1]), int(parts[2]), int(parts[3])
            changed.set()

    children = []
    try:
        for i in range(members):
            children.append(Child([SCRIPT, mode, settings.bootstrap, prefix, str(settings.partitions), app_id],
                                  log_dir / f"{app_id}-{i}.log", on_line=on_line))
        deadline = time.monotonic() + startup_s
        measuring = False
        cpu_start = 0.0
        while True:
            changed.wait(0.5)
            changed.clear()
            total = sum(m.events for m in state.values())
            if total >= n_expected:
                break
            dead = [c for c in children if not c.alive()]
            if dead:
                raise RuntimeError(f"{mode} consumer exited with {dead[0].proc.returncode}:\n{dead[0].log()[-2000:]}")
            if not measuring and any(m.first is not None for m in state.values()):
                measuring = True
                deadline = time.monotonic() + measure_s
                cpu_start = sum(cpu_seconds(c.proc.pid) for c in children)
            if time.monotonic() > deadline:
                if not measuring:
                    raise RuntimeError(f"{mode}: no event handled within {startup_s:.0f}s; log:\n"
                                       f"{children[0].log()[-2000:]}")
                if total == 0 and time.monotonic() < deadline + startup_s:
                    continue  # the first batch is still being handled (a loaded host): its count comes
                break
        cpu = sum(cpu_seconds(c.proc.pid) for c in children) - cpu_start
    finally:
        for c in children:
            c.kill()
    ms = [m for m in state.values() if m.events]
    if not ms:
        raise RuntimeError(f"{mode}: no event handled; log:\n{children[0].log()[-2000:]}")
    t0 = min(m.first for m in ms if m.first is not None)
    t1 = max(m.last for m in ms)
    events = sum(m.events for m in ms)
    samples = sum(m.samples for m in ms)
    secs = max(t1 - t0, 1e-9)
    return {"events": events, "samples": samples, "seconds": secs, "events_per_s": events / secs,
            "samples_per_s": samples / secs, "members_used": len(ms),
            "cpu_cores": cpu / secs, "events_per_cpu_s": events / cpu if cpu > 0 else float("nan"),
            "split": [m.events for m in ms]}

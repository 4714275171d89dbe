"""Where the worker's time goes, per event: ``python benchmarks/profile_worker.py [--seconds 20]``.

Two views, both on the same workload as ``run.py`` (16 runs, trainer + node events):

1. Offline split (no Kafka): the schema decode, the engine's ``apply`` and the changelog
   serialisation of the entries a batch dirties, each timed on its own and divided per event
   for batches of 50, 200 and 1000 events (the flush is once per batch, so its share depends
   on how full the batches are).
2. The live worker (``consumer_main.py trainguard``) draining a pre-filled topic under py-spy
   (``pip install py-spy`` into the venv; skipped when absent): inclusive share of the top
   frames, turned into microseconds per event with the rate measured during the profile.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import orjson
from workload import (
    CLEANUP,
    ROOT,
    Child,
    Steps,
    encoded_events,
    fresh_settings,
    prefill,
    progress,
    start_broker,
)


def offline(steps: Steps, n: int = 8000) -> list[tuple[str, float]]:
    from trainguard.schemas import events as ev
    from trainguard.streams import rules as rules_mod
    from trainguard.streams.engine import Engine

    events = encoded_events(steps, n, 16)
    t = time.perf_counter()
    decoded = [ev.decode(v, expect=(ev.METRICS,)) for _, v in events]
    decode_us = (time.perf_counter() - t) / n * 1e6
    t = time.perf_counter()
    for _, v in events:
        orjson.loads(v)
    loads_us = (time.perf_counter() - t) / n * 1e6
    engine = Engine(rules_mod.load(None))
    warm = n // 2  # windows full before timing
    for i, e in enumerate(decoded[:warm]):
        engine.apply(e, 0, i)
    engine.dirty.clear()
    t = time.perf_counter()
    for i, e in enumerate(decoded[warm:], warm):
        engine.apply(e, 0, i)
    apply_us = (time.perf_counter() - t) / (n - warm) * 1e6
    keys = list(engine.dirty)
    t = time.perf_counter()
    for k in keys:
        engine.serialize(k)
    per_key_us = (time.perf_counter() - t) / len(keys) * 1e6
    out = [("orjson.loads alone (what the bare agent does)", loads_us),
           ("schema decode (ev.decode: orjson + validation)", decode_us),
           ("engine.apply (detection, rules, policy)", apply_us - 0.0),
           (f"changelog: serialize one dirty entry ({len(keys)} per batch here)", per_key_us)]
    for batch in (50, 200, 1000):
        dirty = min(len(keys), batch)  # a batch of B events dirties at most B run/source entries
        out.append((f"changelog flush per event, batches of {batch}", dirty * per_key_us / batch))
    return out


def label(frame: str) -> str:
    name, _, where = frame.partition(" (")
    return f"{name} ({where.split(':')[0].split('/')[-1]})" if where else name


def live(steps: Steps, seconds: float, log_dir: Path, mode: str = "trainguard") -> None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        print("py-spy not installed: live profile skipped (pip install py-spy)")
        return
    broker = start_broker(4, log_dir)
    settings = fresh_settings(broker.bootstrap, 4, "prof")
    events = encoded_events(steps, 60_000, 16)
    prefill(settings, events)
    prefix = settings.topics.events.rsplit(".", 1)[0]
    child = Child([str(Path(__file__).with_name("consumer_main.py")), mode, broker.bootstrap, prefix, "4",
                   f"prof-{int(time.time())}"], log_dir / "profile-worker.log")
    deadline = time.monotonic() + 60
    while not any(line.startswith("F") for line in child.lines):
        if time.monotonic() > deadline or not child.alive():
            raise RuntimeError(f"worker did not start:\n{child.log()[-2000:]}")
        time.sleep(0.1)
    raw = log_dir / "profile-worker.raw"
    progress(f"py-spy on the worker for {seconds:.0f}s")
    before = [line for line in child.lines if line.startswith("P")][-1:] or ["P 0 0 0"]
    subprocess.run([spy, "record", "--pid", str(child.proc.pid), "-d", str(int(seconds)), "-r", "250",
                    "--format", "raw", "-o", str(raw), "--nonblocking", "--gil"], capture_output=True, check=True)
    after = [line for line in child.lines if line.startswith("P")][-1]
    child.kill()
    _, t0, e0, _ = before[-1].split()
    _, t1, e1, _ = after.split()
    rate = (int(e1) - int(e0)) / max(float(t1) - float(t0), 1e-9)
    incl, self_ = Counter(), Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        frames = [label(f) for f in stack.split(";")]
        for f in set(frames):
            incl[f] += n
        self_[frames[-1]] += n
    per_event = 1e6 / rate
    print(f"\nlive {mode} worker: {rate:.0f} events/s while profiled = {per_event:.0f} us per event "
          f"({total} samples)\n")
    print("inclusive share  us/event  frame")
    for f, n in incl.most_common(40):
        print(f"  {n / total * 100:5.1f}%   {n / total * per_event:7.1f}   {f}")
    print("\nself share  frame")
    for f, n in self_.most_common(20):
        print(f"  {n / total * 100:5.1f}%   {f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--offline-only", action="store_true")
    ap.add_argument("--mode", choices=("trainguard", "bare"), default="trainguard",
                    help="profile the real worker or the bare Faust agent (the reference)")
    args = ap.parse_args()
    log_dir = ROOT / "out" / "bench"
    log_dir.mkdir(parents=True, exist_ok=True)
    steps = Steps()
    print("offline split, us per event (50- and 44-metric events, 16 runs):")
    for name, us in offline(steps):
        print(f"  {us:8.1f}  {name}")
    if not args.offline_only:
        try:
            live(steps, args.seconds, log_dir, args.mode)
        finally:
            CLEANUP.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())

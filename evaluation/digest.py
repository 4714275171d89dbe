"""One hash of everything detection says on the recorded inputs, to show a speed change changed
nothing: ``python evaluation/digest.py [--quick] [--show]``.

Replays every labelled real trace (the public set and ``evaluation/real-traces``) and drives the
simulated fault and healthy scenarios of ``make eval`` (2 seeds), each through a fresh engine,
and hashes every output: alerts with their evidence, commands, in order. Prints one line per
input with ``--show`` and, last, one JSON line ``{"digest": ..., "inputs": N, "outputs": M}``.
Run it before and after a change to the hot path: the digests must be equal.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import orjson  # noqa: E402
from faults import fault_scenarios, healthy_scenarios  # noqa: E402
from real import trace_sets  # noqa: E402

from trainguard.replay import replay  # noqa: E402

# What differs between two runs of the same input without meaning anything: ids drawn at
# random, and a command's wall-clock validity.
_VOLATILE = frozenset({"id", "incident", "nonce", "signature", "issued", "expires"})


def _stable(value):
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in _VOLATILE}
    if isinstance(value, list | tuple):
        return [_stable(v) for v in value]
    return value


def _hash(outputs: list) -> str:
    h = hashlib.sha256()
    for out in outputs:
        h.update(orjson.dumps(_stable(out), option=orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY))
    return h.hexdigest()


def inputs(quick: bool):
    """(name, outputs) for every recorded input, in a fixed order."""
    from run import _load_rules, drive

    _load_rules(None)

    for set_name, directory in trace_sets().items():
        if directory is None:
            continue
        labels = json.loads((directory / "labels.json").read_text())["traces"]
        for label in labels:
            result = replay(directory / "traces" / f"{label['file']}.jsonl", run_id=label["file"])
            yield f"{set_name}/{label['file']}", [*result.alerts, *result.commands]
    for sc in healthy_scenarios(2, 150 if quick else 300) + fault_scenarios(1 if quick else 2):
        outputs: list = []
        drive(sc, outputs=outputs)
        yield f"sim/{sc.name}", outputs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one seed per fault kind, short healthy runs")
    ap.add_argument("--show", action="store_true", help="one line per input: its outputs and their hash")
    args = ap.parse_args(argv)
    started = time.monotonic()
    total, count, outputs = hashlib.sha256(), 0, 0
    for name, outs in inputs(args.quick):
        digest = _hash(outs)
        total.update(f"{name}={digest}\n".encode())
        count, outputs = count + 1, outputs + len(outs)
        if args.show:
            print(f"{digest[:16]}  {len(outs):5d}  {name}")
        print(f"\r{count} inputs, {time.monotonic() - started:.0f} s", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    print(json.dumps({"digest": total.hexdigest(), "inputs": count, "outputs": outputs,
                      "seconds": round(time.monotonic() - started, 1), "quick": args.quick}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Fault-injection evaluation: how well do the rules catch simulated faults, how fast, how quietly?

    python evaluation/run.py [--quick] [--seeds N] [--rules FILE] [--no-nab] [--jobs N] [--report FILE]

Every scenario in ``evaluation/faults.py`` (each fault kind, several seeds, plus long
healthy runs with benign events) is driven offline through ``Engine(rules)``: the
simulated trainer publishes its step metrics (rank 0, and ranks 1..7 in straggler and
healthy runs), the node publishes its GPU/host metrics, a checkpoint is saved every 50
steps, and ``engine.tick(now)`` is called every simulated second when the engine has a
``tick`` method. The trainer does NOT obey rollback commands: detection is measured on
the un-rolled-back stream, i.e. on the first incident, with the fault active until the
scenario ends.

Per fault kind: recall (share of seeds where an expected rule fired after the onset and
before the end), detection delay in steps (alert step - onset step; 0 = caught on the
first faulty step's metrics) and in simulated seconds (alert time - the moment the fault
began). False alerts: every firing alert in healthy runs, and in fault runs before the
onset, per 10,000 such steps. Then ``evaluation/nab.py`` runs as a subprocess (unless
``--no-nab``) and its scores are folded in. The last line printed is one JSON object:

    {"min_recall": x, "false_alerts_per_10k_steps": x, "median_delay_steps_sudden": x,
     "drift_caught_before_kl": x, "real_caught": n, "real_failures": n, "real_healthy_silent": n,
     "real_healthy": n, "real_false_alarms": n, "real_added": {...},
     "recovery": {"runs": n, "recovered_without_human": n, "median_steps_lost": x,
                  "rollbacks_per_incident": x},
     "forecast_lead_steps": x, "forecast_traces": n, "forecast_healthy": n,
     "nab": {"standard": x, "reward_low_FP": x, "reward_low_FN": x}}

The ``real_*`` fields come from ``evaluation/real.py``: runs other people trained (the public
development set beside the checkout, and the traces added in ``evaluation/real-traces``),
replayed through the same rules; the simulator was written with the rules, real runs judge them.
``recovery`` comes from ``evaluation/recovery.py``: simulated runs whose trainer does obey the
commands (a transient NaN, a NaN that recurs at its step, a hanging reward model, two sudden
faults), counted by how many end without a human.
The ``forecast_*`` fields come from the real traces as well: how many steps before today's
alert the forecast rules (P3) first fired on the traces whose labels show what they foretell.
Forecasts page no one, so they are not false alerts here and not warnings there.

Targets: recall >= 0.95 for every fault kind, <= 1 false alert per 10k healthy steps,
median delay <= 3 steps for sudden faults, the slow KL drift caught before KL reaches 0.1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import real  # noqa: E402
import recovery  # noqa: E402
from faults import CHECKPOINT_EVERY, EXPECTED_RULES, HEALTHY_STEPS, SUDDEN, Scenario, fault_scenarios, healthy_scenarios  # noqa: E402

from trainguard.schemas import events as ev  # noqa: E402
from trainguard.simulator import SimulatedPPO  # noqa: E402
from trainguard.streams import rules as rules_mod  # noqa: E402
from trainguard.streams.engine import Engine  # noqa: E402

KL_LIMIT = 0.1

_RULES = None


def _load_rules(path: str | None):
    global _RULES
    _RULES = rules_mod.load(path) if path else rules_mod.default()
    return _RULES


def _firing(outputs, t: float, step: int, sink: list) -> None:
    for o in outputs or ():
        v = o.value if hasattr(o, "value") else None
        if isinstance(v, dict) and v.get("status") == "firing" and v.get("rule"):
            sink.append((v["rule"], step, t, v.get("severity"), bool(v.get("critical"))))


def drive(sc: Scenario, rules=None, outputs: list | None = None) -> dict:
    """Run one scenario through a fresh engine; return what fired and when (``outputs``: every
    output's value appended, for ``evaluation/digest.py``)."""
    rules = rules or _RULES
    sim = SimulatedPPO(seed=sc.seed, host=f"sim-{sc.seed}", ranks=sc.ranks)
    if sc.fault:
        sim.inject(sc.fault, at_step=sc.onset)
    engine = Engine(rules)
    tick = getattr(engine, "tick", None)
    clock = [sim.ts]
    if hasattr(engine, "clock"):  # "received at" is simulated time here, not the wall clock
        engine.clock = lambda: clock[0]
    run, host = sc.name, sim.host
    trainer = ev.source("trainer", host, 0)
    node = ev.source("node", host)
    ranks = {r: ev.source("trainer", host, r) for r in range(1, sc.ranks)}
    fired: list = []
    offset = 0
    kl_at: dict[int, float] = {}
    hung = sc.fault == "trainer_hung"
    end_ts = math.inf
    next_tick = math.floor(sim.ts) + 1
    steps_published = 0

    def kept(outs):
        if outputs is not None:
            outputs.extend(getattr(o, "value", o) for o in outs or ())
        return outs

    def send(event):
        nonlocal offset
        outs = engine.handle(ev.encode(event), 0, offset)
        offset += 1
        return kept(outs)

    while True:
        m = sim.step()
        now, step = sim.ts, sim.current_step
        clock[0] = now
        if tick is not None:  # the clock of the worker: a tick every simulated second
            last = step - 1 if m is not None else step
            while next_tick <= now:
                clock[0] = float(next_tick)
                _firing(kept(tick(float(next_tick))), next_tick, last, fired)
                next_tick += 1
            clock[0] = now
        if m is not None:
            steps_published += 1
            if sc.fault == "kl_drift":
                kl_at[step] = sim.kl_level
            _firing(send(ev.metrics_event(run, step, m, src=trainer, ts=now)), now, step, fired)
            for r, values in sim.rank_metrics().items():
                _firing(send(ev.metrics_event(run, step, values, src=ranks[r], ts=now)), now, step, fired)
        _firing(send(ev.metrics_event(run, step, sim.node_metrics(), src=node, ts=now)), now, step, fired)
        if m is not None and step % CHECKPOINT_EVERY == 0:
            send(ev.checkpoint_event(run, step, sim.save_checkpoint(), ts=now))
        if hung and sim.hung and end_ts == math.inf:
            end_ts = sim.faults[0].onset_ts + (sc.steps - sc.onset + 1) * sim.step_seconds
        if (not hung and step >= sc.steps) or now >= end_ts:
            break
    onset_ts = math.inf
    if sc.fault:
        onset_ts = sim.faults[0].onset_ts if sim.faults[0].onset_ts is not None else math.inf
    return {"name": sc.name, "fault": sc.fault, "klass": sc.klass, "onset": sc.onset, "onset_ts": onset_ts,
            "fired": fired, "steps": steps_published, "kl_at": kl_at, "has_tick": tick is not None,
            "step_seconds": sim.step_seconds, "expected": sc.expected}


def judge(res: dict) -> dict:
    """Split a run's firing alerts into false ones (before the onset) and the detection."""
    onset, onset_ts = res["onset"], res["onset_ts"]
    heard = [f for f in res["fired"] if f[3] != real.FORECAST]  # forecasts page no one: not false alerts
    pre = [f for f in heard if f[2] <= onset_ts]
    during = [f for f in heard if f[2] > onset_ts]
    clean_steps = res["steps"] if res["fault"] is None else min(res["steps"], onset - 1)
    out = {"false": pre, "clean_steps": clean_steps, "detected": False, "during": Counter(f[0] for f in during),
           "forecasts": sum(f[3] == real.FORECAST and f[2] <= onset_ts for f in res["fired"])}
    if res["fault"] is None:
        return out
    if res["fault"] == "trainer_hung" and not res["has_tick"]:
        out["na"] = True
        return out
    hit = next((f for f in during if f[0] in res["expected"]), None)
    if hit is not None:
        rule, step, t = hit[0], hit[1], hit[2]
        out.update(detected=True, rule=rule, delay_s=t - onset_ts)
        if res["fault"] == "trainer_hung":
            out["delay_steps"] = round((t - onset_ts) / res["step_seconds"], 1)
        else:
            out["delay_steps"] = step - onset
        if res["fault"] == "kl_drift":
            out["kl_at_detection"] = res["kl_at"].get(step, res["kl_at"].get(max(res["kl_at"]), math.nan))
    elif res["fault"] == "kl_drift":
        out["kl_at_detection"] = None
    return out


def _run_all(scenarios: list[Scenario], rules_path: str | None, jobs: int) -> list[tuple[dict, dict]]:
    if jobs > 1:
        from multiprocessing import Pool
        with Pool(jobs, initializer=_load_rules, initargs=(rules_path,)) as pool:
            results = pool.map(_drive_and_judge, scenarios, chunksize=1)
    else:
        _load_rules(rules_path)
        results = [_drive_and_judge(sc) for sc in scenarios]
    return results


def _drive_and_judge(sc: Scenario) -> tuple[dict, dict]:
    res = drive(sc)
    verdict = judge(res)
    res.pop("kl_at", None)
    res["fired"] = len(res["fired"])
    return res, verdict


def _fmt(x, spec=".2f") -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return format(x, spec)


def summarise(results: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    per: dict[str, dict] = defaultdict(lambda: {"runs": 0, "hits": 0, "na": 0, "delay_steps": [], "delay_s": [],
                                                "rules": Counter(), "during": Counter(), "kl": []})
    false_alerts, clean_steps, healthy_steps = 0, 0, 0
    false_by_rule: Counter = Counter()
    healthy_false = forecasts = 0
    for res, v in results:
        false_alerts += len(v["false"])
        forecasts += v["forecasts"]
        clean_steps += v["clean_steps"]
        false_by_rule.update(f[0] for f in v["false"])
        if res["fault"] is None:
            healthy_steps += v["clean_steps"]
            healthy_false += len(v["false"])
            continue
        p = per[res["fault"]]
        p["klass"] = res["klass"]
        p["runs"] += 1
        p["during"].update(v["during"])
        if v.get("na"):
            p["na"] += 1
            continue
        if v["detected"]:
            p["hits"] += 1
            p["delay_steps"].append(v["delay_steps"])
            p["delay_s"].append(v["delay_s"])
            p["rules"][v["rule"]] += 1
        if res["fault"] == "kl_drift":
            p["kl"].append(v.get("kl_at_detection"))
    table = {}
    for kind in EXPECTED_RULES:
        if kind not in per:
            continue
        p = per[kind]
        na = p["na"] == p["runs"]
        table[kind] = {
            "class": p["klass"], "runs": p["runs"],
            "recall": "n/a" if na else p["hits"] / max(1, p["runs"] - p["na"]),
            "median_delay_steps": statistics.median(p["delay_steps"]) if p["delay_steps"] else None,
            "median_delay_s": statistics.median(p["delay_s"]) if p["delay_s"] else None,
            "expected": list(EXPECTED_RULES[kind]),
            "credited": dict(p["rules"]),
            "fired_during": dict(p["during"].most_common(4)),
        }
        if kind == "kl_drift":
            table[kind]["kl_at_detection"] = p["kl"]
    recalls = [t["recall"] for t in table.values() if isinstance(t["recall"], float)]
    sudden = [d for k, p in per.items() if p.get("klass") == SUDDEN for d in p["delay_steps"]]
    drift = None
    if "kl_drift" in table:
        kls = table["kl_drift"]["kl_at_detection"]
        drift = bool(kls) and all(k is not None and k < KL_LIMIT for k in kls)
    summary = {
        "min_recall": round(min(recalls), 3) if recalls else None,
        "false_alerts_per_10k_steps": round(false_alerts / clean_steps * 10_000, 2) if clean_steps else None,
        "median_delay_steps_sudden": statistics.median(sudden) if sudden else None,
        "drift_caught_before_kl": drift,
    }
    extra = {"table": table, "false_alerts": false_alerts, "clean_steps": clean_steps,
             "healthy_steps": healthy_steps, "healthy_false": healthy_false, "forecasts": forecasts,
             "false_by_rule": dict(false_by_rule.most_common())}
    return summary, extra


def print_table(summary: dict, extra: dict) -> None:
    rows = [("fault kind", "class", "recall", "delay steps", "delay s", "expected rules", "fired during the fault")]
    for kind, t in extra["table"].items():
        rows.append((kind, t["class"], _fmt(t["recall"]), _fmt(t["median_delay_steps"], "g"),
                     _fmt(t["median_delay_s"], ".0f"), ",".join(t["expected"]),
                     " ".join(f"{r}:{n}" for r, n in t["fired_during"].items()) or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for i, r in enumerate(rows):
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + " | " + r[-1])
        if i == 0:
            print("-+-".join("-" * w for w in widths) + "-+-" + "-" * 22)
    print()
    hs = extra["healthy_steps"]
    print(f"healthy runs: {extra['healthy_false']} firing alerts in {hs} steps "
          f"({extra['healthy_false'] / hs * 10_000 if hs else 0:.2f} per 10k); with fault runs before their onset: "
          f"{extra['false_alerts']} in {extra['clean_steps']} steps "
          f"({summary['false_alerts_per_10k_steps']} per 10k)")
    print(f"forecasts (P3, not counted above) in the same steps: {extra['forecasts']}")
    if extra["false_by_rule"]:
        print("false alerts by rule: " + ", ".join(f"{r}:{n}" for r, n in extra["false_by_rule"].items()))
    if "kl_drift" in extra["table"]:
        kls = extra["table"]["kl_drift"]["kl_at_detection"]
        print("kl_drift: KL at detection " + ", ".join("missed" if k is None else f"{k:.3f}" for k in kls)
              + f" (limit {KL_LIMIT})")


def run_nab(jobs: int) -> dict:
    cmd = [sys.executable, str(HERE / "nab.py"), "--jobs", str(jobs)]
    empty = {"standard": None, "reward_low_FP": None, "reward_low_FN": None}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        print("NAB: timed out", file=sys.stderr)
        return empty
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(f"NAB: failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}", file=sys.stderr)
        return empty
    return {**empty, **json.loads(lines[-1]).get("nab", {})}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 seeds, shorter healthy runs, no NAB")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per fault kind (default 5; 2 with --quick)")
    ap.add_argument("--rules", default=None, help="rules file (default: the packaged rules/default.yaml)")
    ap.add_argument("--no-nab", action="store_true", help="skip the NAB benchmark")
    ap.add_argument("--faults", default=None, help="comma-separated fault kinds to run (default: all)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--report", default=None, help="write the full per-fault report as JSON here")
    args = ap.parse_args(argv)
    seeds = args.seeds or (2 if args.quick else 5)
    healthy_steps = HEALTHY_STEPS // 2 if args.quick else HEALTHY_STEPS
    kinds = args.faults.split(",") if args.faults else None
    if kinds:
        unknown = set(kinds) - set(EXPECTED_RULES)
        if unknown:
            ap.error(f"unknown fault kind(s): {', '.join(sorted(unknown))}")
    try:
        _load_rules(args.rules)
    except rules_mod.RulesError as exc:
        print(f"rules: {exc}", file=sys.stderr)
        return 2

    started = time.monotonic()
    scenarios = healthy_scenarios(seeds, healthy_steps) + fault_scenarios(seeds, kinds)
    # longest first, so two workers finish together
    scenarios.sort(key=lambda s: -(s.steps + (s.ranks - 1) * s.steps // 4))
    results = _run_all(scenarios, args.rules, max(1, args.jobs))
    summary, extra = summarise(results)
    if not results[0][0]["has_tick"]:
        print("note: the engine has no tick(now); trainer_hung is reported as n/a")
    print(f"{len(scenarios)} scenarios, {sum(r['steps'] for r, _ in results)} steps in "
          f"{time.monotonic() - started:.1f} s ({seeds} seeds per fault kind, rules: {args.rules or 'default'})")
    print()
    print_table(summary, extra)

    real_results = real.evaluate(_RULES)
    print()
    real.print_results(real_results)
    summary.update(real.summary(real_results))
    own = real.inferred(_RULES or rules_mod.default())
    real.print_inferred(own)
    summary["real_inferred"] = real.inferred_summary(own)

    rec = recovery.evaluate(2 if args.quick else 3, _RULES)
    print()
    print("recovery in a closed loop (evaluation/recovery.py):")
    print(recovery.table(rec))
    summary["recovery"] = {k: v for k, v in rec.items() if k != "per_fault"}

    nab = None
    if not (args.no_nab or args.quick):
        t = time.monotonic()
        nab = run_nab(max(1, args.jobs))
        print(f"NAB: {nab} ({time.monotonic() - t:.0f} s)")
    summary["nab"] = nab or {"standard": None, "reward_low_FP": None, "reward_low_FN": None}
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps({"summary": summary, **extra}, indent=1, default=str))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

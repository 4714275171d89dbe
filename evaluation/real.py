#!/usr/bin/env python3
"""Detection on runs other people trained: labelled real traces, replayed through the rules.

    python evaluation/real.py [--rules FILE] [--set dev|added|all] [--verbose]

Two sets of JSON-lines traces (one object per logged step, metric keys as the trainer
logged them), each with a ``labels.json``:

- ``dev``: the public development set beside the checkout (``<shared>/benchmarks/rl-traces``,
  verl, TRL, ms-swift, DeepSpeed-Chat and unsloth runs), scored as its ``score.py`` scores
  ``trainguard replay {path} --json``;
- ``added``: traces found since and labelled by the same README rules
  (``evaluation/real-traces``: TRL, verl, mlx-lm, ms-swift, unsloth; sources in its README).

Scoring (the sets' README): a failure trace is caught when an alert of any severity fires
between its ``earliest_ok_step`` and ``latest_ok_step``; a healthy trace holds when no P0/P1
alert fires; a false alarm is a P0/P1 alert on a healthy trace or before ``earliest_ok_step``
on a failure trace (counted per trace). Traces marked ``scored: false`` are shown, not
counted. One difference, stricter than ``score.py``: only *firing* alerts count, not the
lines that say an alert resolved. Each trace is replayed in-process with
:func:`trainguard.replay.replay`, the code behind ``trainguard replay``.

The last line printed is one JSON object; ``evaluation/run.py`` folds ``summary()`` into
``make eval``'s line as ``real_caught``, ``real_failures``, ``real_healthy_silent``,
``real_healthy``, ``real_false_alarms`` (the dev set) and ``real_added`` (the other set).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from nab import shared_dir  # noqa: E402

from trainguard.replay import replay  # noqa: E402
from trainguard.sinks.paging import Pager  # noqa: E402
from trainguard.streams import rules as rules_mod  # noqa: E402

LOUD = {"P0", "P1", None}
ADDED = HERE / "real-traces"
FORECAST = "P3"  # forecasts: shown, never paged, not counted as warnings
# Each forecast rule: the failure kinds (labels) it foretells, and the rules that catch those today.
FORECASTS = {
    "entropy_exhaustion_forecast": (frozenset({"entropy_collapse"}),
                                    frozenset({"entropy_collapse", "entropy_below_start", "entropy_near_zero"})),
    "kl_budget_forecast": (frozenset({"kl_drift", "kl_spike", "kl_explosion"}),
                           frozenset({"kl_explosion", "kl_high", "kl_spike", "kl_drift"})),
}


def trace_sets() -> dict[str, Path | None]:
    dev = shared_dir() / "benchmarks" / "rl-traces"
    return {"dev": dev if (dev / "labels.json").is_file() else None, "added": ADDED}


def judge(label: dict, alerts: list[tuple[int, str | None]]) -> tuple[bool, int, str]:
    """(ok, false alarms, note) for one trace, by the sets' README rules."""
    loud = [(s, v) for s, v in alerts if v in LOUD]
    if label["expect"] == "silent":
        return not loud, len(loud), f"{len(loud)} loud alerts"
    lo, hi = label.get("earliest_ok_step"), label.get("latest_ok_step")
    if lo is None or hi is None:
        return bool(alerts), 0, f"{len(alerts)} alerts (no window)"
    hits = [s for s, _ in alerts if lo <= s <= hi]
    early = [s for s, v in loud if s < lo]
    first = min((s for s, _ in alerts), default=None)
    return bool(hits), len(early), f"window {lo}..{hi}, first alert {first}, {len(early)} early"


def forecast_leads(label: dict, firing: list[dict]) -> list[dict]:
    """For a scored failure trace whose labels name a kind a forecast rule foretells: the step of
    today's alert (the first of the rules that catch that kind, at or after ``earliest_ok_step``),
    the forecast's first firing, and the lead (0 when it did not fire before that alert)."""
    if label["expect"] != "alert" or not label.get("scored", True) or label.get("earliest_ok_step") is None:
        return []
    out = []
    for rule, (kinds, catchers) in FORECASTS.items():
        if not kinds & set(label.get("kinds") or ()):
            continue
        caught = min((a["step"] for a in firing if a["rule"] in catchers and a["step"] >= label["earliest_ok_step"]),
                     default=None)
        if caught is None:  # nothing catches it today: no alert to be early for
            continue
        first = min((a["step"] for a in firing if a["rule"] == rule and a["step"] <= caught), default=None)
        out.append({"trace": label["file"], "forecast": rule, "caught_at": caught, "first_forecast": first,
                    "lead_steps": caught - first if first is not None else 0})
    return out


def notifications(alerts: list[dict]) -> int:
    """How many messages a chat sink with the default settings sends for these alerts (pages
    at once, warnings digested per run and interval: ``sinks/paging.py``)."""
    pager = Pager()
    return sum(len(pager.feed(a)) for a in alerts) + len(pager.flush())


def score_set(directory: Path, rules) -> dict:
    labels = json.loads((directory / "labels.json").read_text())["traces"]
    rows, totals, leads = [], Counter(), []
    for label in labels:
        result = replay(directory / "traces" / f"{label['file']}.jsonl", rules=rules, run_id=label["file"])
        firing = [a for a in result.alerts if a["status"] == "firing"]
        ok, false_alarms, note = judge(label, [(a["step"], a["severity"]) for a in firing])
        scored = label.get("scored", True)
        if scored:
            kind = "failures" if label["expect"] == "alert" else "healthy"
            totals[kind] += 1
            totals["caught" if kind == "failures" else "healthy_silent"] += ok
            totals["false_alarms"] += false_alarms > 0
            totals["false_alarm_alerts"] += false_alarms
            leads += forecast_leads(label, firing)
            if kind == "healthy":  # the noise a person would see on a run that trains fine
                totals["healthy_steps"] += result.steps
                totals["healthy_forecasts"] += sum(a["severity"] == FORECAST for a in firing)
                totals["healthy_warnings"] += sum(a["severity"] == "P2" for a in firing)
                totals["healthy_notifications"] += notifications(result.alerts)
            elif label.get("earliest_ok_step") is not None:
                totals["pages_before_onset"] += sum(a["severity"] in LOUD and a["step"] < label["earliest_ok_step"]
                                                    for a in firing)
        rows.append({"file": label["file"], "framework": label.get("framework"), "expect": label["expect"],
                     "scored": scored, "ok": ok, "false_alarms": false_alarms, "note": note,
                     "rules": sorted(Counter(a["rule"] for a in firing).items(), key=lambda kv: -kv[1])})
    per_100 = 100.0 / max(totals["healthy_steps"], 1)
    return {"caught": totals["caught"], "failures": totals["failures"],
            "healthy_silent": totals["healthy_silent"], "healthy": totals["healthy"],
            "false_alarms": totals["false_alarms"], "false_alarm_alerts": totals["false_alarm_alerts"],
            "warnings_per_100_healthy_steps": round(totals["healthy_warnings"] * per_100, 3),
            "notifications_per_100_healthy_steps": round(totals["healthy_notifications"] * per_100, 3),
            "pages_before_onset": totals["pages_before_onset"], "healthy_steps": totals["healthy_steps"],
            "healthy_forecasts": totals["healthy_forecasts"], "forecast_leads": leads, "traces": rows}


# What a research loop might call each signal: names no dialect knows, whose words say the signal
# (tests/test_inference.py checks both). ``inferred()`` renames every trace's names to these.
OWN_NAMES = {
    "entropy": "policy_entropy", "kl": "kl_divergence", "kl_penalty": "kl_penalty_term", "ppo_kl": "approx_kl_old_new",
    "reward_mean": "mean_reward", "reward_std": "reward_stdev", "reward_min": "reward_minimum",
    "reward_max": "reward_maximum", "response_length_mean": "avg_response_len",
    "response_length_min": "response_len_minimum", "response_length_max": "response_len_maximum",
    "grad_norm": "gradient_norm", "critic_grad_norm": "critic_gradient_norm",
    "policy_loss": "surrogate_loss", "value_loss": "value_fn_loss",
}


def inferred(rules, which: str = "all") -> dict:
    """Every scored trace again, each name a dialect maps to a signal of ``OWN_NAMES`` renamed
    to that name (the others kept): how detection does when a run's signals are known only from
    their names' words. A failure counts as caught when an alert in its window is on a renamed
    name (the inferred evidence alone); a healthy run must stay silent."""
    import tempfile

    totals = Counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="trainguard-inferred-") as tmp:
        for name, directory in trace_sets().items():
            if directory is None or which not in (name, "all"):
                continue
            for label in json.loads((directory / "labels.json").read_text())["traces"]:
                if not label.get("scored", True):
                    continue
                renamed: dict[str, str] = {}
                lines = []
                for line in (directory / "traces" / f"{label['file']}.jsonl").read_text().splitlines():
                    if not line.strip():
                        continue
                    record = json.loads(line)
                    out = {}
                    for key, value in record.items():
                        own = OWN_NAMES.get(rules.signal_for(key) or "") if key != "step" else None
                        if own is not None and own not in record:
                            renamed[key] = own
                        out[renamed.get(key, key)] = value
                    lines.append(json.dumps(out))
                if not renamed:
                    continue
                path = Path(tmp) / f"{label['file']}.jsonl"
                path.write_text("\n".join(lines) + "\n")
                result = replay(path, rules=rules, run_id=label["file"])
                own = set(renamed.values())
                firing = [a for a in result.alerts if a["status"] == "firing"]
                if label["expect"] == "alert":
                    firing = [a for a in firing if own & set(a.get("metrics") or [a.get("metric")])]
                ok, _, note = judge(label, [(a["step"], a["severity"]) for a in firing])
                kind = "failures" if label["expect"] == "alert" else "healthy"
                totals[kind] += 1
                totals["caught" if kind == "failures" else "healthy_silent"] += ok
                rows.append({"set": name, "file": label["file"], "expect": label["expect"], "ok": ok, "note": note,
                             "renamed": len(renamed)})
    return {"caught": totals["caught"], "failures": totals["failures"], "healthy_silent": totals["healthy_silent"],
            "healthy": totals["healthy"], "traces": rows}


def inferred_summary(own: dict) -> dict:
    return {k: own[k] for k in ("caught", "failures", "healthy_silent", "healthy")}


def print_inferred(own: dict, out=sys.stdout) -> None:
    print("the same traces under names no dialect knows (judged by the signal their words suggest):", file=out)
    for r in own["traces"]:
        if not r["ok"]:
            print(f"  FAIL {r['expect']:<6} {r['file']:<46} {r['note']} ({r['renamed']} names renamed)", file=out)
    print(f"{own['caught']}/{own['failures']} caught on a renamed name alone, {own['healthy_silent']}/{own['healthy']} "
          f"healthy silent\n", file=out)


def evaluate(rules=None, which: str = "all") -> dict[str, dict | None]:
    """``{set name: its score, or None when the set is not on this machine}``."""
    ruleset = rules if isinstance(rules, rules_mod.RuleSet) else rules_mod.load(rules)
    out: dict[str, dict | None] = {}
    for name, directory in trace_sets().items():
        if which in (name, "all"):
            out[name] = score_set(directory, ruleset) if directory is not None else None
    return out


def summary(results: dict[str, dict | None]) -> dict:
    """The fields ``make eval``'s JSON line carries."""
    dev, added = results.get("dev"), results.get("added")
    keys = ("caught", "failures", "healthy_silent", "healthy", "false_alarms", "warnings_per_100_healthy_steps",
            "notifications_per_100_healthy_steps", "pages_before_onset")
    out = {f"real_{k}": (dev[k] if dev else None) for k in keys}
    out["real_added"] = {k: added[k] for k in keys} if added else None
    out.update(forecast_summary(results))
    return out


def forecast_summary(results: dict[str, dict | None]) -> dict:
    """The forecasts over both sets: the median lead in steps over the traces that show what they
    foretell, how many traces that is, and how many forecasts fired on healthy runs."""
    sets = [r for r in results.values() if r]
    leads = [row["lead_steps"] for r in sets for row in r["forecast_leads"]]
    return {"forecast_lead_steps": statistics.median(leads) if leads else None, "forecast_traces": len(leads),
            "forecast_healthy": sum(r["healthy_forecasts"] for r in sets) if sets else None}


def print_results(results: dict[str, dict | None], verbose: bool = False, out=sys.stdout) -> None:
    for name, res in results.items():
        if res is None:
            print(f"{name}: not found (looked in {shared_dir() / 'benchmarks' / 'rl-traces'}; "
                  f"set TRAINGUARD_SHARED to the folder that holds benchmarks/)", file=out)
            continue
        print(f"real traces, {name} set:", file=out)
        print(f"{'verdict':<12} {'expect':<6} {'framework':<14} {'trace':<46} note", file=out)
        for r in res["traces"]:
            verdict = ("PASS" if r["ok"] else "FAIL") if r["scored"] else "(not scored)"
            rules = ", ".join(f"{rule}:{n}" for rule, n in r["rules"][:4]) if verbose else ""
            print(f"{verdict:<12} {r['expect']:<6} {str(r['framework']):<14} {r['file']:<46} {r['note']}"
                  + (f"  [{rules}]" if rules else ""), file=out)
        print(f"{res['caught']}/{res['failures']} caught, {res['healthy_silent']}/{res['healthy']} healthy silent, "
              f"{res['false_alarms']} false alarms ({res['false_alarm_alerts']} loud alerts); on "
              f"{res['healthy_steps']} healthy steps, per 100: {res['warnings_per_100_healthy_steps']} warnings, "
              f"{res['notifications_per_100_healthy_steps']} chat messages; {res['pages_before_onset']} pages "
              f"before an onset", file=out)
        for row in res["forecast_leads"]:
            first = "never before it" if row["first_forecast"] is None else f"first at step {row['first_forecast']}"
            print(f"  {row['forecast']} on {row['trace']}: caught at step {row['caught_at']}, forecast {first}, "
                  f"lead {row['lead_steps']} steps", file=out)
        print(f"  forecasts (P3, never paged, not counted as warnings) on healthy runs: {res['healthy_forecasts']}\n",
              file=out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rules", default=None, help="rules file (default: the packaged rules/default.yaml)")
    ap.add_argument("--set", default="all", choices=("dev", "added", "all"))
    ap.add_argument("--verbose", action="store_true", help="list the rules that fired on each trace")
    args = ap.parse_args(argv)
    try:
        results = evaluate(args.rules, args.set)
    except rules_mod.RulesError as exc:
        print(f"rules: {exc}", file=sys.stderr)
        return 2
    print_results(results, args.verbose)
    ruleset = rules_mod.load(args.rules)
    own = inferred(ruleset, args.set)
    print_inferred(own)
    print(json.dumps({**summary(results), "real_inferred": inferred_summary(own)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

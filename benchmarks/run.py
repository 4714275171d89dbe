"""``make bench``: every performance figure measured side by side with its reference, in one run.

    .venv/bin/python benchmarks/run.py            # the full run (about 13 minutes on 2 cores)
    .venv/bin/python benchmarks/run.py --quick    # smaller sizes (about 4 minutes)
    .venv/bin/python benchmarks/run.py --only detector,log --brokers kafka

The broker figures (log, throughput, latency, scaling) run on the embedded Tansu broker and
then on Apache Kafka (one KRaft node from the jars ``make kafka`` resolved), each against its
own reference measured on the same broker; the fleet and the hot run (``fleet.py``) on Apache
Kafka. Prints one table (Tansu's and Kafka's figures beside each other, with the ratio to their
reference and the target) and, as its last line, one JSON object with every figure: a figure
measured on Apache Kafka is the Tansu key prefixed with ``kafka_``. Progress goes to stderr,
child logs to out/bench/. Everything started (brokers, workers, consumers) is stopped at the
end, on Ctrl-C and on SIGTERM. See docs/performance.md for the method.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fleet
import workload
from workload import (
    CLEANUP,
    ROOT,
    Steps,
    encoded_events,
    fresh_settings,
    prefill,
    progress,
)

from trainguard.schemas.signing import ensure_key

FIGURES = ("detector", "log", "memory", "throughput", "latency", "scaling", "fleet")
BROKERS = ("tansu", "kafka")
KAFKA = "kafka_"  # the prefix of a figure measured on Apache Kafka; unprefixed: on Tansu
KEYS = ("detector_speedup", "worker_samples_per_s", "worker_events_ratio_vs_bare_faust",
        "worker_events_ratio_vs_aiokafka", "alert_latency_p99_ms", "command_latency_p99_ms",
        "log_p99_us_broker_up", "log_p99_us_broker_down", "bytes_per_series", "two_worker_speedup",
        "kafka_worker_events_ratio_vs_bare_faust", "scale_events_per_worker_cpu_s", "scale_rebalance_pause_s",
        "scale_max_lag_events", "scale_saturated_per_cpu_ratio_vs_one", "hot_run_folded_rank_steps_per_s",
        "hot_run_folded_ratio_vs_spread")


def _median_runs(fn, repeats: int) -> dict:
    runs = [fn(i) for i in range(repeats)]
    out = {k: statistics.median(r[k] for r in runs) for k in ("events_per_s", "samples_per_s", "events", "seconds")}
    out["runs_events_per_s"] = [round(r["events_per_s"]) for r in runs]
    out["split"] = runs[-1]["split"]
    return out


def throughput(bootstrap: str, steps: Steps, quick: bool, log_dir: Path) -> dict:
    from throughput import consume

    n = 4_000 if workload.SMOKE else 20_000 if quick else 100_000
    repeats = 1 if quick else 2  # two brokers in one run: two each keeps make bench near 15 minutes
    cap_bare, cap_worker = (2.0, 2.0) if workload.SMOKE else (5.0, 8.0) if quick else (12.0, 20.0)
    events = encoded_events(steps, n, 16)
    settings = fresh_settings(bootstrap, 4, "tp")
    progress(f"throughput: pre-filling {n} events (4 partitions)")
    secs = prefill(settings, events)
    progress(f"  {n / secs:.0f} events/s produced; aiokafka x{repeats}")
    raw = _median_runs(lambda i: consume("aiokafka", settings, n, log_dir), repeats)
    progress(f"  aiokafka {raw['events_per_s']:.0f} events/s; bare Faust x{repeats}")
    bare = _median_runs(lambda i: consume("bare", settings, n, log_dir, measure_s=cap_bare), repeats)
    progress(f"  bare Faust {bare['events_per_s']:.0f} events/s; trainguard worker x{repeats}")
    worker = _median_runs(lambda i: consume("trainguard", settings, n, log_dir, measure_s=cap_worker), repeats)
    progress(f"  worker {worker['events_per_s']:.0f} events/s; worker without its bulk lane x{repeats}")
    agent = _median_runs(lambda i: consume("trainguard-agent", settings, n, log_dir, measure_s=cap_worker), repeats)
    progress(f"  worker through Faust's agent path {agent['events_per_s']:.0f} events/s")
    return {
        "worker_events_per_s": worker["events_per_s"], "worker_samples_per_s": worker["samples_per_s"],
        "bare_faust_events_per_s": bare["events_per_s"], "bare_faust_samples_per_s": bare["samples_per_s"],
        "aiokafka_events_per_s": raw["events_per_s"], "aiokafka_samples_per_s": raw["samples_per_s"],
        "worker_events_ratio_vs_bare_faust": worker["events_per_s"] / bare["events_per_s"],
        "worker_events_ratio_vs_aiokafka": worker["events_per_s"] / raw["events_per_s"],
        "worker_runs_events_per_s": worker["runs_events_per_s"], "bare_runs_events_per_s": bare["runs_events_per_s"],
        "aiokafka_runs_events_per_s": raw["runs_events_per_s"],
        "worker_agent_path_events_per_s": agent["events_per_s"],
        "worker_agent_path_ratio_vs_bare_faust": agent["events_per_s"] / bare["events_per_s"],
        "worker_events_measured": worker["events"], "bare_events_measured": bare["events"],
        "samples_per_event": n and worker["samples_per_s"] / worker["events_per_s"],
    }


def scaling(bootstrap: str, steps: Steps, quick: bool, log_dir: Path) -> dict:
    from throughput import consume

    n = 6_000 if workload.SMOKE else 30_000 if quick else 100_000
    cap = 2.0 if workload.SMOKE else 8.0 if quick else 15.0
    repeats = 1 if quick else 2
    events = encoded_events(steps, n, 32, prefix="scale")
    settings = fresh_settings(bootstrap, 8, "sc")
    progress(f"scaling: pre-filling {n} events (8 partitions, 32 runs)")
    prefill(settings, events)
    one, two = [], []
    for i in range(repeats):  # interleaved, so that both see the same background load
        progress(f"  one worker (run {i + 1}/{repeats})")
        one.append(consume("trainguard", settings, n, log_dir, members=1, measure_s=cap))
        progress(f"  two workers, one group (run {i + 1}/{repeats})")
        two.append(consume("trainguard", settings, n, log_dir, members=2, measure_s=cap))
    e1 = statistics.median(r["events_per_s"] for r in one)
    e2 = statistics.median(r["events_per_s"] for r in two)
    return {"one_worker_events_per_s": e1, "two_workers_events_per_s": e2, "two_worker_speedup": e2 / e1,
            "one_worker_cpu_cores": statistics.median(r["cpu_cores"] for r in one),
            "two_workers_cpu_cores": statistics.median(r["cpu_cores"] for r in two),
            "one_worker_events_per_cpu_s": statistics.median(r["events_per_cpu_s"] for r in one),
            "two_workers_events_per_cpu_s": statistics.median(r["events_per_cpu_s"] for r in two),
            "two_workers_split": two[-1]["split"], "two_workers_members_used": min(r["members_used"] for r in two)}


# --------------------------------------------------------------------------- report


def _fmt(v, unit: str = "") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if abs(v) >= 1e5:
        s = f"{v / 1e3:,.0f}k"
    elif abs(v) >= 100:
        s = f"{v:,.0f}"
    elif abs(v) >= 10:
        s = f"{v:.1f}"
    else:
        s = f"{v:.2f}"
    return s + unit


def rows(r: dict) -> list[tuple]:
    """(id, figure, ours, reference name, reference, ratio, target text, pass)."""
    out = []
    g = r.get
    if "detector_speedup" in r:
        out.append(("detector", "detector cost / sample (BaselineBlock, 50-metric event)",
                    _fmt(g("baseline_block_us_per_sample"), " us"), "seed AdaptiveThreshold",
                    _fmt(g("seed_us_per_sample"), " us"), f"{g('detector_speedup'):.0f}x faster",
                    ">= 50x", g("detector_speedup") >= 50))
        out.append(("rolling_z", "detector cost / sample (RollingZ, scalar)", _fmt(g("rolling_z_us_per_sample"), " us"),
                    "seed AdaptiveThreshold", _fmt(g("seed_us_per_sample"), " us"),
                    f"{g('rolling_z_speedup'):.0f}x faster", "-", None))
    if "worker_samples_per_s" in r:
        out.append(("samples", "worker metric samples/s (4 partitions)", _fmt(g("worker_samples_per_s")),
                    "bare Faust agent", _fmt(g("bare_faust_samples_per_s")),
                    f"{g('worker_samples_per_s') / g('bare_faust_samples_per_s'):.2f}", ">= 250k/s",
                    g("worker_samples_per_s") >= 250_000))
        out.append(("events_bare", "worker events/s", _fmt(g("worker_events_per_s")), "bare Faust agent",
                    _fmt(g("bare_faust_events_per_s")), f"{g('worker_events_ratio_vs_bare_faust'):.2f}",
                    ">= 1.5", g("worker_events_ratio_vs_bare_faust") >= 1.5))
        out.append(("events_aiokafka", "worker events/s", _fmt(g("worker_events_per_s")), "aiokafka + orjson loop",
                    _fmt(g("aiokafka_events_per_s")), f"{g('worker_events_ratio_vs_aiokafka'):.3f}", ">= 0.25",
                    g("worker_events_ratio_vs_aiokafka") >= 0.25))
        if g("worker_agent_path_events_per_s"):
            out.append(("agent_path", "worker events/s, bulk lane off (Faust's agent path)",
                        _fmt(g("worker_agent_path_events_per_s")), "bare Faust agent",
                        _fmt(g("bare_faust_events_per_s")), f"{g('worker_agent_path_ratio_vs_bare_faust'):.2f}",
                        "-", None))
    if "alert_latency_p99_ms" in r:
        tr = g("transport_latency_p99_ms")
        out.append(("alert", f"produce -> alert p99 (p50 {_fmt(g('alert_latency_p50_ms'))}) at "
                    f"{_fmt(g('latency_load_events_per_s'))} ev/s", _fmt(g("alert_latency_p99_ms"), " ms"),
                    "broker round trip p99", _fmt(tr, " ms"),
                    f"{g('alert_latency_p99_ms') / tr:.1f}x" if tr else "n/a", "<= 1.5x",
                    bool(tr) and g("alert_latency_p99_ms") <= 1.5 * tr))
        out.append(("command", f"breaker -> trainer p99 (p50 {_fmt(g('command_latency_p50_ms'))}, "
                    f"{g('commands_measured')} runs)", _fmt(g("command_latency_p99_ms"), " ms"),
                    "broker round trip p99", _fmt(tr, " ms"),
                    f"{g('command_latency_p99_ms') / tr:.1f}x" if tr else "n/a", "<= 2x",
                    bool(tr) and g("command_latency_p99_ms") <= 2 * tr))
    if "log_p99_us_broker_up" in r:
        raw = g("raw_produce_p99_us")
        out.append(("log_up", f"log() p99, 50 metrics, broker up (p50 {_fmt(g('log_p50_us_broker_up'))})",
                    _fmt(g("log_p99_us_broker_up"), " us"), "librdkafka produce() p99", _fmt(raw, " us"),
                    f"{g('log_p99_us_broker_up') / raw:.1f}", "<= 4x", g("log_p99_us_broker_up") <= 4 * raw))
        if "log_p99_us_unsigned_broker_up" in r:
            signed = g("log_p99_us_broker_up") / raw
            out.append(("log_mac", f"log() p99 {'with the MAC' if g('log_signed') else 'UNSIGNED (no key)'}; "
                        f"unsigned p99 {_fmt(g('log_p99_us_unsigned_broker_up'))} us; "
                        f"sender thread {_fmt(g('log_sender_cpu_us_per_step'))} us CPU/step",
                        _fmt(g("log_p99_us_broker_up"), " us"), "librdkafka produce() p99", _fmt(raw, " us"),
                        f"{signed:.1f}", "<= 4x", bool(g("log_signed")) and signed <= 4))
        out.append(("log_down", f"log() p99, broker down, queue full after {g('log_queue_max_broker_down')} "
                    f"(p50 {_fmt(g('log_p50_us_broker_down'))})",
                    _fmt(g("log_p99_us_broker_down"), " us"), "log() p99 broker up",
                    _fmt(g("log_p99_us_broker_up"), " us"),
                    f"{g('log_p99_us_broker_down') / g('log_p99_us_broker_up'):.2f}", "<= 20 us",
                    g("log_p99_us_broker_down") <= 20))
    if "bytes_per_series" in r:
        out.append(("memory", f"memory / series ({g('series'):,} series)", _fmt(g("bytes_per_series"), " B"),
                    "seed AdaptiveThreshold", _fmt(g("seed_bytes_per_series"), " B"),
                    f"{g('bytes_per_series') / g('seed_bytes_per_series'):.2f}", "<= 2048 B",
                    g("bytes_per_series") <= 2048))
    if "two_worker_speedup" in r:
        out.append(("two", "two workers, one group (8 partitions), events/s", _fmt(g("two_workers_events_per_s")),
                    "one worker", _fmt(g("one_worker_events_per_s")), f"{g('two_worker_speedup'):.2f}x",
                    ">= 1.7x", g("two_worker_speedup") >= 1.7))
        if g("two_workers_cpu_cores"):
            out.append(("two_cores", "  two workers: CPU cores used (the broker and the rest share 2)",
                        _fmt(g("two_workers_cpu_cores")), "one worker", _fmt(g("one_worker_cpu_cores")),
                        f"{g('two_workers_cpu_cores') / g('one_worker_cpu_cores'):.2f}x", "-", None))
            out.append(("two_per_cpu", "  two workers: events per CPU-second", _fmt(g("two_workers_events_per_cpu_s")),
                        "one worker", _fmt(g("one_worker_events_per_cpu_s")),
                        f"{g('two_workers_events_per_cpu_s') / g('one_worker_events_per_cpu_s'):.2f}", "-", None))
    return out


def kafka_view(r: dict) -> dict:
    """The figures measured on Apache Kafka under their Tansu names."""
    return {k[len(KAFKA):]: v for k, v in r.items() if k.startswith(KAFKA)}


def fleet_rows(r: dict) -> list[tuple]:
    """The fleet and the hot run (Apache Kafka only): (figure, ours, reference name, reference,
    ratio, target, pass)."""
    g = r.get
    out = []
    per_cpu = g("scale_events_per_worker_cpu_s") or {}
    one = per_cpu.get("1")
    for n, v in per_cpu.items():
        out.append((f"fleet ({g('scale_partitions')} partitions, {_fmt(g('scale_load_events_per_s'))} ev/s): "
                    f"events per worker CPU-s, {n} worker{'s' if n != '1' else ''}", _fmt(v), "1 worker",
                    _fmt(one), f"{v / one:.2f}" if one else "n/a", ">= 0.80" if n != "1" else "-",
                    None if n == "1" or not one else v / one >= 0.8))
    saturated = g("scale_saturated_events_per_worker_cpu_s") or {}
    for n, v in saturated.items():
        ratio = (g("scale_saturated_per_cpu_ratio_vs_one") or {}).get(n)
        out.append((f"fleet, saturated (pre-filled, {g('scale_saturated_partitions')} partitions): events per "
                    f"worker CPU-s, {n} worker{'s' if n != '1' else ''}", _fmt(v), "1 worker", _fmt(saturated.get("1")),
                    f"{ratio:.2f}" if ratio is not None else "n/a", ">= 0.80" if n != "1" else "-",
                    None if n == "1" or ratio is None else ratio >= 0.8))
    if "scale_rebalance_pause_s" in r:
        pauses = ", ".join(f"{k} {v:.1f}" for k, v in (g("scale_pauses_s") or {}).items())
        out.append((f"fleet: longest pause, a worker joins or leaves ({pauses})",
                    _fmt(g("scale_rebalance_pause_s"), " s"), "-", "-", "-", "-", None))
        out.append(("fleet: highest consumer lag (committed vs high watermark)", _fmt(g("scale_max_lag_events")),
                    "events produced per s", _fmt(g("scale_load_events_per_s")),
                    f"{g('scale_max_lag_s'):.1f} s of load", "-", None))
        ref = g("kafka_alert_latency_p99_ms")
        out.append((f"fleet: produce -> alert p99 under load (p50 {_fmt(g('scale_alert_latency_p50_ms'))}, "
                    f"{g('scale_alerts_measured')} faults)", _fmt(g("scale_alert_latency_p99_ms"), " ms"),
                    "latency figure p99", _fmt(ref, " ms"),
                    f"{g('scale_alert_latency_p99_ms') / ref:.2f}" if ref else "n/a", "<= 200 ms",
                    g("scale_alert_latency_p99_ms") <= 200))
    if "hot_run_events_per_s" in r:
        out.append((f"hot run ({g('hot_run_ranks')} ranks, one partition): events/s, one worker",
                    _fmt(g("hot_run_events_per_s")), "same events as 32 runs", _fmt(g("spread_runs_events_per_s")),
                    f"{g('hot_run_ratio_vs_spread'):.2f}", "-", None))
    if "hot_run_folded_lift" in r:
        out.append((f"  its ranks folded 8 a node (x{g('hot_run_folded_lift'):.1f}): rank steps/s",
                    _fmt(g("hot_run_folded_rank_steps_per_s")), "same events as 32 runs",
                    _fmt(g("spread_runs_events_per_s")), f"{g('hot_run_folded_ratio_vs_spread'):.2f}", "-", None))
    return out


def table(r: dict) -> str:
    """Tansu's and Apache Kafka's figures beside each other, each with its own reference."""
    def verdict(ok) -> str:
        return "-" if ok is None else ("pass" if ok else "MISS")

    header = ("figure", "reference (same run)", "Tansu", "ref", "ratio", "", "Kafka", "ref", "ratio", "",
              "target")
    none = ("", "", "", "")
    kafka = {row[0]: row for row in rows(kafka_view(r))}
    body = []
    for _id, fig, ours, ref_name, ref, ratio, target, ok in rows(r):
        k = kafka.pop(_id, None)
        body.append((fig, ref_name, ours, ref, ratio, verdict(ok),
                     *((k[2], k[4], k[5], verdict(k[7])) if k else none), target))
    for _id, fig, ours, ref_name, ref, ratio, target, ok in kafka.values():  # measured on Kafka alone
        body.append((fig, ref_name, *none, ours, ref, ratio, verdict(ok), target))
    for fig, ours, ref_name, ref, ratio, target, ok in fleet_rows(r):
        body.append((fig, ref_name, *none, ours, ref, ratio, verdict(ok), target))
    widths = [max(len(str(x[i])) for x in [header, *body]) for i in range(len(header))]

    def line(cells) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(b) for b in body)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller sizes, one run each (about 4 minutes)")
    ap.add_argument("--smoke", action="store_true",
                    help="--quick at sizes that only prove every figure works (the test suite's run; numbers mean "
                         "nothing)")
    ap.add_argument("--only", default="", help=f"comma-separated figures: {','.join(FIGURES)}")
    ap.add_argument("--brokers", default=",".join(BROKERS),
                    help="where the broker figures run: tansu, kafka or both (default: %(default)s)")
    ap.add_argument("--rate", type=float, default=None,
                    help="load for the latency figure in events/s (default: half the measured worker rate)")
    args = ap.parse_args(argv)
    if args.smoke:
        workload.SMOKE = args.quick = True
    only = [f for f in args.only.split(",") if f] or list(FIGURES)
    brokers = [b for b in args.brokers.split(",") if b]
    unknown = set(only) - set(FIGURES)
    if unknown:
        ap.error(f"unknown figures: {', '.join(sorted(unknown))}")
    if set(brokers) - set(BROKERS):
        ap.error(f"unknown brokers: {', '.join(sorted(set(brokers) - set(BROKERS)))}")
    workload.install_signal_handlers()
    ensure_key("bench")  # commands signed and verified, as in production (the latency figure)
    log_dir = ROOT / "out" / "bench"
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"brokers": {}}
    started = time.time()
    status = 0

    def figure(name: str, fn, prefix: str = "", where: str = "") -> None:
        nonlocal status
        if name not in only:
            return
        try:
            results.update({prefix + k: v for k, v in fn().items()})
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # one broken figure must not cost the others
            progress(f"{name}{where}: FAILED: {type(exc).__name__}: {exc}")
            results.setdefault("failed", []).append(prefix + name)
            status = 1

    def on(broker_name: str, bootstrap: str, prefix: str) -> None:
        """The broker figures on one broker, their keys with ``prefix``."""
        import latency
        import log_cost

        where = f" on {broker_name}"
        progress(f"trainer log() cost, broker up and down{where}")
        figure("log", lambda: log_cost.run(bootstrap, steps, args.quick), prefix, where)
        figure("throughput", lambda: throughput(bootstrap, steps, args.quick, log_dir), prefix, where)

        def lat():
            rate = args.rate or 0.5 * results.get(prefix + "worker_events_per_s", 0) or 200.0
            progress(f"end-to-end latency{where}")
            return latency.run(bootstrap, steps, rate, log_dir, args.quick)

        figure("latency", lat, prefix, where)
        figure("scaling", lambda: scaling(bootstrap, steps, args.quick, log_dir), prefix, where)

    try:
        steps = Steps()

        def detector():
            import detector_cost

            progress("detector cost per sample")
            return detector_cost.run(args.quick)

        def mem():
            import memory

            progress("memory per series")
            return memory.run(steps, args.quick)

        figure("detector", detector)
        figure("memory", mem)
        needs_broker = {"log", "throughput", "latency", "scaling"} & set(only)
        if "tansu" in brokers and needs_broker:
            broker = workload.start_broker(4, log_dir)
            results["brokers"]["tansu"] = f"Tansu (embedded, memory storage) at {broker.bootstrap}"
            on("Tansu", broker.bootstrap, "")
            broker.stop()  # its CPU and memory back before the next broker
            CLEANUP.discard(broker.stop)
        if "kafka" in brokers and (needs_broker or "fleet" in only):
            progress("starting Apache Kafka (one KRaft node)")
            cluster = workload.start_kafka(4)
            if cluster is None:
                progress("Apache Kafka: no jars (run `make kafka`): its figures are not measured")
                results.setdefault("failed", []).append("kafka")
                status = 1
            else:
                results["brokers"]["kafka"] = cluster.describe()
                on("Apache Kafka", cluster.bootstrap, KAFKA)
                figure("fleet", lambda: fleet.run(cluster.bootstrap, steps, log_dir, args.quick), "", " on Kafka")
                cluster.stop()
                CLEANUP.discard(cluster.stop)
    except KeyboardInterrupt:
        progress("interrupted: stopping everything started")
        status = 130
    finally:
        CLEANUP.run()
    results["bench_seconds"] = round(time.time() - started, 1)
    results["quick"] = args.quick
    results["smoke"] = workload.SMOKE
    results["cpus"] = os.cpu_count()
    results["python"] = platform.python_version()
    progress(f"done in {results['bench_seconds']:.0f}s")
    print(table(results))
    print(json.dumps(_finite(results), sort_keys=False), flush=True)
    return status


def _finite(v):
    """NaN (a figure with nothing measured) as null, in nested objects too."""
    if isinstance(v, float) and math.isnan(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    return v


if __name__ == "__main__":
    sys.exit(main())

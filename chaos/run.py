#!/usr/bin/env python3
"""``make chaos``: what the trainer side does when the broker fails under it.

    python chaos/run.py [--quick] [--only broker_restart,readers_restart,close,listener]

Scenarios (``chaos/scenarios.py``, ``chaos/cluster.py``) run on a three-node Apache Kafka cluster
on loopback (``make kafka``; replication factor 3, min.insync.replicas 2), all but those that stop
or restart the broker themselves and need the embedded broker's memory storage or its port
(``broker_restart``, ``readers_restart``, ``close``, ``shutdown``, ``listener_reset``): each of those has an embedded
broker of its own. Without the Kafka jars (or with ``--broker tansu``) every scenario runs on an
embedded broker and the cluster's own scenarios are left out.

On the cluster (``chaos/cluster.py``):

- ``broker_kill``: the node leading a run's events partition killed with -9 while the run logs
  200 steps a second and a worker judges it (NaNs paged before, during the election and after),
  down 20 s, started again; a sinks process pages a real HTTP receiver.
- ``cluster_restart``: every node killed with -9 and started with its storage kept; a new worker
  restores its state from the changelogs: events judged twice, the rollback target after.
- ``election``: the worker and the leader of its run's partition killed together; kill to the
  next page with static membership (``TRAINGUARD_INSTANCE_ID``) and without.
- ``exactly_once``: Faust's ``processing_guarantee="exactly_once"`` beside the default: whether it
  works, events a second, NaN alerts published twice across a kill -9.
- ``refused_outputs``: the alerts topic refuses every message for 60 s (its ``max.message.bytes``
  below any alert) while a run's loss turns NaN twice, the worker killed with -9 between the two
  and started again; a listener applies and acks the rollbacks, a sinks process pages a real
  HTTP receiver. ``refused_outputs_lost``: a NaN's alert or command missing from its topic, an
  alert never paged, a command never applied (target 0); ``refused_outputs_duplicated``: pages
  received twice, commands applied twice (target 0); beside them the ids published twice on the
  topics (at-least-once across the kill, absorbed downstream), events committed past the first
  NaN while its alert was refused (``refused_outputs_acked_early``, target 0), and seconds from
  the topic taking messages again until the group's offset passes the last NaN (None: not in 60 s).

On the embedded broker or the cluster:

- ``broker_restart``: a loop logs 50-metric steps at 1,000 a second; the broker is killed,
  stays down for 25 s and comes back on the same port (memory storage: empty); the loop never
  stops. Figures: the share of the steps logged after the broker is back that reach it, every
  event delivered or counted lost, how long ``close()`` takes against its timeout.
- ``readers_restart``: the embedded broker restarted (back empty) under a worker, a sinks process
  paging a real HTTP receiver, ``trainguard tail`` and the run page's reader, each far past where
  the new topics end, while a run logs; right after, that run's loss turns NaN and a new run's
  too. Figures: processes that died (``broker_restart_crashes``), those alerts missing at a reader
  (``broker_restart_missed_alerts``), librdkafka's raw lines in the sinks' and tail's output
  (``broker_restart_raw_client_lines``), all with target 0, and seconds from the broker's return
  to the new run's page.
- ``close``: a trainer whose broker never answers logs 2,000 steps and closes.
- ``listener``: a control listener applies and acks three commands and is restarted; the new one
  must apply none of them again, nor a command issued before its lookback window.
- ``lifecycle``: 1,000 runs start, log and finish one after another over 10 minutes through a
  real worker: the bytes their state leaves in the changelogs after the grace period (what a
  restarted worker would restore), and the worker's memory growth from its settled size.
- ``shutdown``: SIGTERM to a worker with its broker up and with it gone, and to the broker.
- ``hostile``: 140 bad messages of seven kinds (garbage, truncated JSON, unknown versions,
  missing fields, steps out of range, bad run ids, 950 KB payloads) among a run whose loss turns
  NaN: crashes, dead letters missing, the step the NaN is paged at.
- ``worker_kill``: a worker killed with -9 right after it paged, three times, while a run logs,
  and started again (it ends its dead predecessor's group membership, then joins); a sinks
  process pages a real HTTP receiver and is restarted once: seconds until the new worker pages
  the run's next NaN, alerts missed, pages received twice, commands issued twice (a second id for
  one decision; copies under one id, which the listener refuses, are counted apart).
- ``ui``: records with an injection payload in every string field of every record kind, and
  malformed or misplaced ones, beside a run a real worker judges; every page of ``trainguard
  ui`` rendered in Debian's chromium: markup a record put on a page (``ui_injections``), the
  reader alive after each malformed record, a restarted UI reading past them.
- ``forged``: someone with write access to every topic and no key forges a checkpoint path, a
  30-day silence, a ``finished``, a ``failed`` ack, an unsigned copy of the pending rollback,
  and signs a rollback to a path the trainer never reported: how many took effect.
- ``unsigned_metrics`` (``chaos/authority.py``): the README's loop trains with keys while a forger
  writes its next steps, unsigned and signed with a node agent's key, and a node's samples: a
  finite value then 3 NaNs before any checkpoint, that twice after two; commands the worker
  signed on them (``unsigned_metric_commands``, target 0), alerts marked unauthenticated, and the
  loop's own NaN rolled back to its checkpoint.
- ``scope_forgeries`` (``chaos/authority.py``): per-run keys asked for runs named ``*`` and
  ``exp*``, then a victim run's steering events, NaN metrics and failed acks signed with old
  untyped ``exp*`` and ``*`` keys and another run's key (its own scope and a prefix claimed):
  forgeries the worker took (``scope_forgeries_accepted``, target 0).
- ``listener_reset``: the broker restarts empty under a control listener: commands sent after
  it that were never applied.
- ``chat_injections``: a sinks process with every chat sink and Alertmanager reads alerts whose
  every field holds a markdown link, a Slack link with <!channel> and a forged line: texts in
  which one came out live.
- ``sinks_restart``: a sinks process stopped while its webhook receiver refuses, restarted once
  it is up: alerts never received, alerts received twice.
- ``ts_poison``: NaN losses stamped by a millisecond, microsecond and nanosecond clock and 1e308
  written to the events topic, alerts so stamped to the alerts topic, then real runs' NaNs through
  a real worker and a sinks process with every chat sink and Alertmanager (restarted once):
  ``ts_poison_delayed_alerts``, real P0s a sink did not page within twice the latency of a P0
  sent before any poison (5 s at least).
- ``tiny_runs``: 20,000 invented run ids of one tiny event each through a real worker whose tiny
  runs live 20 s, twice: its RSS settled, at the peak, and once they are forgotten, per 1,000 runs.
- ``invented_runs``: the same, one wave each of 20,000 run ids with 1, 4 and 20 events (a run its
  trainer never started keeps the short TTL whatever its event count): RSS left per 1,000 runs once
  they are forgotten, the worst of the three.
- ``cross_partition``, ``oversize``: one event of a run written to another partition; four node
  events of long control-character names; each against the README loop (``chaos/hostile_runs.py``).
- ``many_metrics``: a trainer logging 5,000 metric names per step for 200 steps, the worker then
  restarted: worker crashes, and the NaN at the last step still paged.
- ``extreme_values``: one rule per registered value detector setting; a control run and three runs
  with one astronomic value (fp32's maximum, ±1e308) in every detector's metric, then each detector's
  own kind of anomaly 200 steps later, the worker killed with -9 and restarted in between
  (``chaos/extreme.py``): detectors that page the control's anomaly and not another run's.
- ``hostile_crash_loops``: each record that once crashed the worker on every restart (lone
  surrogates in a checkpoint path, a metric name, a silence reason, a source host; 2,500
  per-layer names; 11,500 sources of one run), the worker then killed and restarted twice:
  workers that died on their own.

Prints a table, then one JSON line with the figures and their targets' verdicts.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chaos import authority, cluster, extreme, hostile_runs, scenarios  # noqa: E402
from trainguard import kafka_cluster  # noqa: E402
from trainguard.schemas.signing import ensure_key  # noqa: E402

# figure -> (target, how to compare): "le" at most, "ge" at least
TARGETS = {
    "broker_restart_delivered_after_ratio": (0.99, "ge"),
    "broker_restart_crashes": (0, "le"),
    "broker_restart_missed_alerts": (0, "le"),
    "broker_restart_raw_client_lines": (0, "le"),
    "lost_uncounted": (0, "le"),
    "close_over_timeout_s": (1.0, "le"),
    "listener_restart_reapplied": (0, "le"),
    "stale_command_applied": (0, "le"),
    "finished_run_bytes_after_grace": (1024, "le"),
    "churn_rss_growth_pct": (5.0, "le"),
    "shutdown_s": (5.0, "le"),
    "worker_recovery_s": (5.0, "le"),
    "worker_kill_missed_alerts": (0, "le"),
    "worker_kill_duplicate_pages": (0, "le"),
    "worker_kill_duplicate_commands": (0, "le"),
    "hostile_crashes": (0, "le"),
    "hostile_dead_letters_missing": (0, "le"),
    "worker_rss_mb_per_1000_tiny_runs": (5.0, "le"),
    "worker_rss_mb_per_1000_invented_runs": (5.0, "le"),
    "cross_partition_blinded_runs": (0, "le"),
    "oversize_alerts_lost": (0, "le"),
    "many_metrics_crashes": (0, "le"),
    "hostile_crash_loops": (0, "le"),
    "extreme_value_blinded_detectors": (0, "le"),
    "ui_injections": (0, "le"),
    "forged_inputs_applied": (0, "le"),
    "unsigned_metric_commands": (0, "le"),
    "scope_forgeries_accepted": (0, "le"),
    "listener_reset_lost_commands": (0, "le"),
    "chat_injections": (0, "le"),
    "sinks_restart_lost_alerts": (0, "le"),
    "sinks_restart_duplicate_alerts": (0, "le"),
    "ts_poison_delayed_alerts": (0, "le"),
    "broker_kill_delivered_after_ratio": (0.99, "ge"),
    "broker_kill_lost_uncounted": (0, "le"),
    "broker_kill_missed_alerts": (0, "le"),
    "broker_kill_duplicate_pages": (0, "le"),
    "broker_kill_duplicate_commands": (0, "le"),
    "cluster_restart_rejudged_events": (0, "le"),
    "refused_outputs_lost": (0, "le"),
    "refused_outputs_duplicated": (0, "le"),
    "refused_outputs_acked_early": (0, "le"),
    "takeover_static_worker_exits": (0, "le"),
    "takeover_dynamic_worker_exits": (0, "le"),
    "takeover_static_alerts_twice": (0, "le"),
    "takeover_dynamic_alerts_twice": (0, "le"),
}

# Stop or restart their broker themselves (memory storage, one port): an embedded broker each.
TANSU_ONLY = ("broker_restart", "readers_restart", "close", "shutdown", "listener_reset")
CLUSTER_ONLY = ("broker_kill", "cluster_restart", "election", "exactly_once", "refused_outputs")


def run(only: set[str], quick: bool, broker: str = "apache-kafka") -> tuple[dict, dict]:
    """The results by scenario, and the broker each ran on."""
    if broker == "tansu":
        return run_on_broker(only, quick), dict.fromkeys(only, "tansu")
    out = run_on_broker(only & set(TANSU_ONLY), quick)
    where = dict.fromkeys(out, "tansu")
    on_kafka: dict = {}
    if only - set(TANSU_ONLY):
        with cluster.cluster_for_chaos() as kafka:
            on_kafka = run_on_broker(only - set(TANSU_ONLY) - set(CLUSTER_ONLY), quick)
            on_kafka.update(run_on_cluster(kafka, only & set(CLUSTER_ONLY), quick))
    where.update(dict.fromkeys(on_kafka, "apache-kafka"))
    return {**out, **on_kafka}, where


def run_on_cluster(kafka, only: set[str], quick: bool) -> dict:
    out: dict = {}
    if "broker_kill" in only:
        print("broker_kill: kill -9 the leader of a run's partition under a run and a worker ...", file=sys.stderr,
              flush=True)
        out["broker_kill"] = cluster.broker_kill(kafka, down_s=10 if quick else 20, after_s=5 if quick else 10)
    if "election" in only:
        print("election: the worker killed with the leader of its partition, static and dynamic ...",
              file=sys.stderr, flush=True)
        results = {kind: cluster.election_takeover(kafka, static=kind == "static") for kind in ("static", "dynamic")}
        out["election"] = {}
        for kind, r in results.items():
            out["election"][f"takeover_{kind}_s"] = r["takeover_s"]
            out["election"][f"takeover_{kind}_worker_exits"] = r["worker_exits"]
            out["election"][f"takeover_{kind}_alerts_twice"] = r["alerts_twice"]
    if "exactly_once" in only:
        print("exactly_once: Faust's transactions beside at-least-once ...", file=sys.stderr, flush=True)
        out["exactly_once"] = cluster.exactly_once(kafka, runs=4 if quick else 8)
    if "refused_outputs" in only:
        print("refused_outputs: the alerts topic refuses for a minute, a NaN run, the worker killed -9 ...",
              file=sys.stderr, flush=True)
        out["refused_outputs"] = cluster.refused_outputs(kafka, refuse_s=30 if quick else 60)
    if "cluster_restart" in only:  # last: every node is killed and started again
        print("cluster_restart: every node killed -9 and started with its storage ...", file=sys.stderr, flush=True)
        out["cluster_restart"] = cluster.cluster_restart(kafka, steps=200 if quick else 400)
    return out


def run_on_broker(only: set[str], quick: bool) -> dict:
    out: dict = {}
    if "broker_restart" in only:
        print("broker_restart: logging, killing the broker, waiting, restarting it ...", file=sys.stderr, flush=True)
        r = scenarios.broker_restart(up_s=3, down_s=8 if quick else 25, after_s=5 if quick else 10)
        out["broker_restart"] = r
    if "readers_restart" in only:
        print("readers_restart: the broker restarted empty under a worker, sinks, tail and the run page ...",
              file=sys.stderr, flush=True)
        out["readers_restart"] = scenarios.broker_restart_readers(down_s=8 if quick else 25,
                                                                  history=300 if quick else 3000)
    if "close" in only:
        print("close: a trainer whose broker never answers ...", file=sys.stderr, flush=True)
        out["close"] = scenarios.close_with_broker_gone()
    if "listener" in only:
        print("listener: apply, ack, restart the listener ...", file=sys.stderr, flush=True)
        out["listener"] = scenarios.listener_restart()
    if "lifecycle" in only:
        print("lifecycle: runs starting and finishing through a worker ...", file=sys.stderr, flush=True)
        out["lifecycle"] = scenarios.state_lifecycle(runs=200 if quick else 1000, duration_s=60 if quick else 600)
    if "shutdown" in only:
        print("shutdown: SIGTERM to workers and the broker ...", file=sys.stderr, flush=True)
        out["shutdown"] = scenarios.shutdown()
    if "hostile" in only:
        print("hostile: bad messages among a faulty run ...", file=sys.stderr, flush=True)
        out["hostile"] = scenarios.hostile_input()
    if "worker_kill" in only:
        print("worker_kill: kill -9 a worker and start it again, three times ...", file=sys.stderr, flush=True)
        out["worker_kill"] = scenarios.worker_kill()
    if "tiny_runs" in only:
        print("tiny_runs: invented run ids, one event each, through a worker ...", file=sys.stderr, flush=True)
        out["tiny_runs"] = scenarios.tiny_runs(runs=5000 if quick else 20_000, waves=2)
    if "invented_runs" in only:
        out["invented_runs"] = {}
        for events in (1, 4, 20):
            print(f"invented_runs: invented run ids of {events} event(s) each through a worker ...", file=sys.stderr,
                  flush=True)
            r = scenarios.tiny_runs(runs=5000 if quick else 20_000, events=events)
            out["invented_runs"][f"worker_rss_mb_per_1000_invented_runs_{events}_events"] = \
                r["worker_rss_mb_per_1000_tiny_runs"]
            out["invented_runs"][f"held_mb_per_1000_invented_runs_{events}_events"] = \
                r["worker_rss_mb_per_1000_tiny_runs_held"]
    if "cross_partition" in only:
        print("cross_partition: one event of a run on another partition, a NaN, a worker restart ...",
              file=sys.stderr, flush=True)
        out["cross_partition"] = hostile_runs.cross_partition()
    if "oversize" in only:
        print("oversize: node events of long control-character names, then a NaN ...", file=sys.stderr, flush=True)
        out["oversize"] = hostile_runs.oversize()
    if "many_metrics" in only:
        print("many_metrics: 5,000 metric names per step through a worker ...", file=sys.stderr, flush=True)
        out["many_metrics"] = scenarios.many_metrics(steps=50 if quick else 200)
    if "hostile_crash_loops" in only:
        print("hostile_crash_loops: the records that crashed workers, and two restarts ...", file=sys.stderr,
              flush=True)
        out["hostile_crash_loops"] = scenarios.hostile_crash_loops()
    if "extreme_values" in only:
        print("extreme_values: one astronomic value in every detector's metric, a worker restart ...", file=sys.stderr,
              flush=True)
        out["extreme_values"] = extreme.extreme_values()
    if "ui" in only:
        print("ui: hostile records on every topic, every page of trainguard ui in chromium ...", file=sys.stderr,
              flush=True)
        out["ui"] = scenarios.ui_injections()
    if "forged" in only:
        print("forged: forged checkpoints, silences, acks and commands against a worker ...", file=sys.stderr,
              flush=True)
        out["forged"] = scenarios.forged_inputs_applied()
    if "unsigned_metrics" in only:
        print("unsigned_metrics: forged metrics against the README loop and a worker with keys ...", file=sys.stderr,
              flush=True)
        out["unsigned_metrics"] = authority.unsigned_metric_commands()
    if "scope_forgeries" in only:
        print("scope_forgeries: pattern run ids and keys of other runs against a worker ...", file=sys.stderr,
              flush=True)
        out["scope_forgeries"] = authority.scope_forgeries_accepted()
    if "listener_reset" in only:
        print("listener_reset: the broker restarts empty under a listener ...", file=sys.stderr, flush=True)
        out["listener_reset"] = scenarios.listener_reset_lost_commands()
    if "chat_injections" in only:
        print("chat_injections: hostile fields through every chat template ...", file=sys.stderr, flush=True)
        out["chat_injections"] = scenarios.chat_injections()
    if "sinks_restart" in only:
        print("sinks_restart: stop the sinks while the receiver is down, restart ...", file=sys.stderr, flush=True)
        out["sinks_restart"] = scenarios.sinks_restart_lost_alerts()
    if "ts_poison" in only:
        print("ts_poison: time stamps of other clocks and 1e308 ahead of real NaNs, every sink ...", file=sys.stderr,
              flush=True)
        out["ts_poison"] = scenarios.ts_poison(victims=3 if quick else 5)
    return out


def summary(results: dict, where: dict) -> dict:
    on_kafka = "apache-kafka" in where.values()
    s: dict = {"broker": "apache-kafka" if on_kafka else "tansu", "cluster_nodes": 3 if on_kafka else None}
    if "broker_restart" in results:
        r = results["broker_restart"]
        s["broker_restart_delivered_after_ratio"] = r["broker_restart_delivered_after_ratio"]
        s["lost_uncounted"] = r["lost_uncounted"]
        s["close_seconds"] = r["close_seconds"]
    if "readers_restart" in results:
        r = results["readers_restart"]
        for k in ("broker_restart_crashes", "broker_restart_missed_alerts", "broker_restart_raw_client_lines"):
            s[k] = r[k]
        s["broker_restart_page_after_back_s"] = r["page_after_back_s"]
    if "close" in results:
        r = results["close"]
        s["lost_uncounted"] = s.get("lost_uncounted", 0) + r["lost_uncounted"]
        s["close_seconds_broker_gone"] = r["close_seconds"]
        s["close_over_timeout_s"] = round(r["close_seconds"] - r["close_timeout_s"], 2)
    if "listener" in results:
        s["listener_restart_reapplied"] = results["listener"]["listener_restart_reapplied"]
        s["stale_command_applied"] = results["listener"]["stale_command_applied"]
    if "lifecycle" in results:
        s["finished_run_bytes_after_grace"] = results["lifecycle"]["finished_run_bytes_after_grace"]
        s["churn_rss_growth_pct"] = results["lifecycle"]["churn_rss_growth_pct"]
    if "shutdown" in results:
        s["shutdown_s"] = results["shutdown"]["shutdown_s"]
    if "hostile" in results:
        s["hostile_crashes"] = results["hostile"]["hostile_crashes"]
        s["hostile_dead_letters_missing"] = results["hostile"]["hostile_dead_letters_missing"]
    if "worker_kill" in results:
        s["worker_recovery_s"] = results["worker_kill"]["worker_recovery_s"]
        for k in ("worker_kill_missed_alerts", "worker_kill_duplicate_pages", "worker_kill_duplicate_commands"):
            s[k] = results["worker_kill"][k]
    if "tiny_runs" in results:
        s["worker_rss_mb_per_1000_tiny_runs"] = results["tiny_runs"]["worker_rss_mb_per_1000_tiny_runs"]
        for k in ("held", "next_waves"):
            s[f"worker_rss_mb_per_1000_tiny_runs_{k}"] = results["tiny_runs"][f"worker_rss_mb_per_1000_tiny_runs_{k}"]
    if "invented_runs" in results:
        r = results["invented_runs"]
        s.update({k: v for k, v in r.items() if k.startswith("worker_rss")})
        s["worker_rss_mb_per_1000_invented_runs"] = max(v for k, v in r.items() if k.startswith("worker_rss"))
    if "cross_partition" in results:
        s["cross_partition_blinded_runs"] = results["cross_partition"]["cross_partition_blinded_runs"]
    if "oversize" in results:
        s["oversize_alerts_lost"] = results["oversize"]["oversize_alerts_lost"]
    if "many_metrics" in results:
        s["many_metrics_crashes"] = results["many_metrics"]["many_metrics_crashes"]
    if "hostile_crash_loops" in results:
        s["hostile_crash_loops"] = results["hostile_crash_loops"]["hostile_crash_loops"]
    if "extreme_values" in results:
        for k in ("extreme_value_blinded_detectors", "extreme_value_detectors", "extreme_value_detectors_checked",
                  "extreme_value_restart_after_commit"):
            s[k] = results["extreme_values"][k]
    if "ui" in results:
        s["ui_injections"] = results["ui"]["ui_injections"]
    if "forged" in results:
        s["forged_inputs_applied"] = results["forged"]["forged_inputs_applied"]
    if "unsigned_metrics" in results:
        s["unsigned_metric_commands"] = results["unsigned_metrics"]["unsigned_metric_commands"]
    if "scope_forgeries" in results:
        s["scope_forgeries_accepted"] = results["scope_forgeries"]["scope_forgeries_accepted"]
    if "listener_reset" in results:
        s["listener_reset_lost_commands"] = results["listener_reset"]["listener_reset_lost_commands"]
    if "chat_injections" in results:
        s["chat_injections"] = results["chat_injections"]["chat_injections"]
    if "sinks_restart" in results:
        for k in ("sinks_restart_lost_alerts", "sinks_restart_duplicate_alerts"):
            s[k] = results["sinks_restart"][k]
    if "ts_poison" in results:
        s["ts_poison_delayed_alerts"] = results["ts_poison"]["ts_poison_delayed_alerts"]
        s["ts_poison_usual_latency_s"] = results["ts_poison"]["usual_latency_s"]
    if "broker_kill" in results:
        r = results["broker_kill"]
        for k in ("broker_kill_delivered_after_ratio", "broker_kill_lost_uncounted", "broker_kill_missed_alerts",
                  "broker_kill_duplicate_pages", "broker_kill_duplicate_commands"):
            s[k] = r[k]
        s["broker_kill_page_after_kill_s"] = r.get("page_after_kill_s")
    if "cluster_restart" in results:
        s["cluster_restart_rejudged_events"] = results["cluster_restart"]["cluster_restart_rejudged_events"]
    if "election" in results:
        s.update(results["election"])
    if "refused_outputs" in results:
        r = results["refused_outputs"]
        for k in ("refused_outputs_lost", "refused_outputs_duplicated", "alerts_published_twice",
                  "commands_published_twice", "acked_early", "seconds_to_commit_after"):
            s[k if k.startswith("refused") else f"refused_outputs_{k}"] = r[k]
    if "exactly_once" in results:
        r = results["exactly_once"]
        for k in ("works", "events_per_s", "alerts_published_twice"):
            for g in ("at_least_once", "exactly_once"):
                s[f"{g}_{k}"] = r.get(f"{g}_{k}")
    s["passed"] = all(s[k] is not None and (s[k] >= t if how == "ge" else s[k] <= t)
                      for k, (t, how) in TARGETS.items() if k in s)
    return s


def print_table(results: dict, s: dict, where: dict) -> None:
    print(f"{'scenario':<20} {'broker':<13} {'figure':<40} value")
    for name, figures in results.items():
        for k, v in figures.items():
            print(f"{name:<20} {where.get(name, ''):<13} {k:<40} {v}")
    print()
    for k, (target, how) in TARGETS.items():
        if k in s:
            ok = s[k] is not None and (s[k] >= target if how == "ge" else s[k] <= target)
            print(f"{k:<40} {s[k]!s:<8} target {'>=' if how == 'ge' else '<='} {target}  {'ok' if ok else 'MISSED'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="an 8 s outage instead of 25 s, 200 runs instead of 1,000, "
                                                         "5,000 tiny runs instead of 20,000, 50 steps instead of 200")
    ap.add_argument("--only", default="", help="comma-separated: broker_restart, readers_restart, close, listener, "
                                               "lifecycle, "
                                               "shutdown, hostile, worker_kill, forged, unsigned_metrics, "
                                               "scope_forgeries, listener_reset, "
                                               "chat_injections, sinks_restart, ts_poison, ui, "
                                               "tiny_runs, invented_runs, cross_partition, oversize, "
                                               "many_metrics, hostile_crash_loops, extreme_values, "
                                               "broker_kill, cluster_restart, election, exactly_once, refused_outputs")
    ap.add_argument("--broker", choices=("apache-kafka", "tansu"), default=None,
                    help="apache-kafka (default where `make kafka` resolved its jars): a three-node cluster for "
                         "every scenario but those that restart the broker; tansu: the embedded broker only")
    args = ap.parse_args(argv)
    only = set(filter(None, args.only.split(","))) or {"broker_restart", "readers_restart", "close", "listener",
                                                       "lifecycle", "shutdown",
                                                       "hostile", "worker_kill", "forged", "unsigned_metrics",
                                                       "scope_forgeries", "listener_reset",
                                                       "chat_injections", "sinks_restart", "ts_poison", "ui"}
    if not args.only:
        only |= {"tiny_runs", "invented_runs", "cross_partition", "oversize", "many_metrics", "hostile_crash_loops",
                 "extreme_values", *CLUSTER_ONLY}
    broker = args.broker or ("apache-kafka" if kafka_cluster.available() else "tansu")
    if broker == "tansu":
        if not kafka_cluster.available() and only & set(CLUSTER_ONLY):
            print("chaos: no Apache Kafka (`make kafka`): the cluster's scenarios are left out", file=sys.stderr)
        only -= set(CLUSTER_ONLY)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    ensure_key("chaos")  # signed as in production: keyless workers refuse unsigned checkpoints and run ends
    started = time.monotonic()
    results, where = run(only, args.quick, broker)
    s = summary(results, where)
    print_table(results, s, where)
    print(f"({time.monotonic() - started:.0f} s)")
    print(json.dumps(s))
    return 0 if s["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

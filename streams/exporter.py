"""Prometheus exporter: the run's key metrics, detector state, alerts and pipeline health.
The worker feeds it from the engine; a sinks process serves its notification counters through
it (``sinks/prometheus.py``).

Metrics are declared once, here, with fixed label names, in the module's own registry
``REGISTRY`` (what :meth:`Exporter.start_http` serves). The set is bounded by design:

=======================================  ==================  ===============================
metric                                   labels              bound on series
=======================================  ==================  ===============================
trainguard_run_signal                    run, signal         max_runs x len(SIGNALS)
trainguard_run_metric                    run, metric         max_runs x max_metrics_per_run
trainguard_run_last_seen_timestamp_seconds  run              max_runs
trainguard_detector_anomalous            run, rule           max_runs x max_rules
trainguard_alerts_total                  rule, severity,     max_rules x 4 x 2
                                         status
trainguard_alerts_firing                 rule, severity      max_rules x 4
trainguard_incidents_total               (none)              1
trainguard_incidents_open                (none)              1
trainguard_pipeline_lag_seconds          (none)              1
trainguard_events_processed_total        (none)              1
trainguard_samples_processed_total       (none)              1
trainguard_dlq_total                     reason              len(DLQ_REASONS)
trainguard_runs_tracked                  (none)              1
trainguard_runs_evicted_total            (none)              1
trainguard_notifications_total           sink, outcome       5 sinks x 3 outcomes
=======================================  ==================  ===============================

- ``signal`` is a canonical signal (``streams/signals.py``: ``kl``, ``entropy``,
  ``reward_mean`` ...): whatever a framework calls it (verl's ``actor/kl_loss``, TRL's
  ``train/kl``), so one panel serves every framework.
- ``metric`` takes only names from the allow-list ``KEY_METRICS`` plus the names given to
  :class:`Exporter` (``TRAINGUARD_PROMETHEUS_METRICS`` for the worker); other metric names
  are not exported (they stay in Kafka). The node agent's per-device names
  (``gpu/utilization_pct[3]``) count as their base name; the hosts of a run share a device
  index (the latest report wins): per-host GPU panels belong to DCGM's exporter.
- Alert counters are the worker's: a sinks process serves only its notification counters,
  unless told to count the alerts it reads (``TRAINGUARD_PROMETHEUS_ALERTS=1``, for a
  worker that exports nothing), so a panel summing over both never counts an alert twice.
- ``run``: at most ``max_runs`` runs (default 20) are tracked; when a new run arrives the
  run seen least recently is evicted and all its series are removed. A run the worker holds as
  vouched for by its trainer (it said it started, or reported a checkpoint) is never evicted for
  one that is not: unvouched runs leave first, and an unvouched newcomer finds no room among
  vouched runs (it is not exported), so run ids anyone can invent never hide a real run's series.
- ``rule``: at most ``max_rules`` distinct rule names (default 100); alerts of further
  rules are counted under ``rule="_other"``.
- ``severity`` is P0..P3, ``status`` firing|resolved, ``reason`` one of ``DLQ_REASONS``,
  ``sink`` a sink kind (dingtalk, wecom, slack, webhook, alertmanager), ``outcome``
  delivered|retried|undelivered.

With the defaults that is at most 20 x 35 + 20 x 256 + 20 + 20 x 100 + 800 + 400 + 40 series.

One :class:`Exporter` per process (the metrics are process-wide, as in client_python).
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from trainguard.schemas.events import SEVERITIES
from trainguard.streams.signals import signal_of

KEY_METRICS: tuple[str, ...] = (
    "actor/kl_loss",
    "actor/entropy",
    "actor/grad_norm",
    "actor/pg_clipfrac",
    "critic/score/mean",
    "critic/score/std",
    "critic/vf_loss",
    "reward/kl_divergence",
    "response_length/mean",
    "rollout/latency_ms",
    "rollout/empty_response_ratio",
    "perf/throughput",
    "timing_s/step",
    "gpu/utilization_pct",
    "gpu/memory_used_gb",
    "system/cpu_load_avg",
)
"""The allow-list of metric names exported per run (everything else stays in Kafka)."""

OTHER_RULE = "_other"

DLQ_REASONS = ("not_json", "not_object", "oversized", "unknown_schema", "unknown_version",
               "wrong_topic", "invalid_field", "empty", "other")
"""The DLQ reason categories; free-text reasons are mapped onto these."""

REGISTRY = CollectorRegistry(auto_describe=True)

RUN_SIGNAL = Gauge("trainguard_run_signal", "Latest value of a canonical training signal of a run "
                   "(whatever name its framework logs it under)", ["run", "signal"], registry=REGISTRY)
RUN_METRIC = Gauge("trainguard_run_metric", "Latest value of a key training metric of a run",
                   ["run", "metric"], registry=REGISTRY)
RUN_LAST_SEEN = Gauge("trainguard_run_last_seen_timestamp_seconds",
                      "Event time of the latest metrics seen for a run", ["run"], registry=REGISTRY)
DETECTOR_ANOMALOUS = Gauge("trainguard_detector_anomalous",
                           "1 while a rule has a firing alert for a run, else 0", ["run", "rule"],
                           registry=REGISTRY)
ALERTS = Counter("trainguard_alerts", "Alerts raised and resolved, by rule and severity",
                 ["rule", "severity", "status"], registry=REGISTRY)
ALERTS_FIRING = Gauge("trainguard_alerts_firing", "Alerts firing now, by rule and severity",
                      ["rule", "severity"], registry=REGISTRY)
COMMANDS = Counter("trainguard_commands", "Commands the worker sent to a run's trainer (rollback, pause, stop ...), "
                   "by action", ["run", "action"], registry=REGISTRY)
INCIDENTS = Counter("trainguard_incidents", "Incidents opened (distinct incident ids)", registry=REGISTRY)
INCIDENTS_OPEN = Gauge("trainguard_incidents_open", "Incidents with at least one firing alert",
                       registry=REGISTRY)
PIPELINE_LAG = Gauge("trainguard_pipeline_lag_seconds",
                     "Wall-clock time minus event time of the latest processed batch", registry=REGISTRY)
EVENTS = Counter("trainguard_events_processed", "Events processed by the worker", registry=REGISTRY)
SAMPLES = Counter("trainguard_samples_processed", "Metric samples (name=value pairs) processed",
                  registry=REGISTRY)
DLQ = Counter("trainguard_dlq", "Messages sent to the dead-letter topic, by reason", ["reason"],
              registry=REGISTRY)
RUNS_TRACKED = Gauge("trainguard_runs_tracked", "Runs whose series are exported now", registry=REGISTRY)
NOTIFICATIONS = Counter("trainguard_notifications", "Alert notifications by sink and outcome "
                        "(delivered, retried, undelivered = given up)", ["sink", "outcome"], registry=REGISTRY)
RUNS_EVICTED = Counter("trainguard_runs_evicted", "Runs evicted to keep within max_runs", registry=REGISTRY)

_DLQ_RULES = (  # first match wins; the messages are schemas.events.SchemaError's
    ("empty", ("empty message", "no value")),
    ("oversized", ("exceeds", "too large")),
    ("not_object", ("must be a json object",)),
    ("not_json", ("not valid json",)),
    ("unknown_version", ("unknown version",)),
    ("unknown_schema", ("unknown event kind", "schema: missing")),
    ("wrong_topic", ("on this topic",)),
)
_FIELD_ERROR = re.compile(r"^[\w.\[\]/-]+: ")


def dlq_reason(reason: str) -> str:
    """Map a free-text DLQ reason (a SchemaError message ...) onto one of ``DLQ_REASONS``."""
    text = (reason or "").strip().lower()
    if text in DLQ_REASONS:
        return text
    for name, needles in _DLQ_RULES:
        if any(n in text for n in needles):
            return name
    return "invalid_field" if _FIELD_ERROR.match(text) else "other"


class Exporter:
    """Feeds the module's metrics from what the worker sees; thread-safe.

    >>> exp = Exporter(max_runs=2)
    >>> exp.observe_metrics("ppo-7b", {"actor/kl_loss": 0.02, "my/custom": 1.0}, ts=1.0)
    >>> REGISTRY.get_sample_value("trainguard_run_metric", {"run": "ppo-7b", "metric": "actor/kl_loss"})
    0.02
    >>> REGISTRY.get_sample_value("trainguard_run_signal", {"run": "ppo-7b", "signal": "kl"})
    0.02
    >>> exp.forget_run("ppo-7b")
    """

    def __init__(self, key_metrics: tuple[str, ...] | list[str] = KEY_METRICS, max_runs: int = 20,
                 max_rules: int = 100, max_alert_ids: int = 50_000, max_metrics_per_run: int = 256,
                 incident_rules: frozenset[str] | set[str] = frozenset()):
        if max_runs < 1 or max_rules < 1:
            raise ValueError("max_runs and max_rules must be at least 1")
        self.key_metrics = frozenset(key_metrics)
        self.max_runs = max_runs
        self.max_rules = max_rules
        self.max_alert_ids = max_alert_ids
        self.max_metrics_per_run = max_metrics_per_run
        self._lock = threading.RLock()
        self._runs: OrderedDict[str, None] = OrderedDict()  # least recently seen first
        self._vouched: set[str] = set()  # tracked runs their trainer vouched for: evicted only for each other
        self._run_metrics: dict[str, set[str]] = {}
        self._run_signals: dict[str, set[str]] = {}
        self._run_commands: dict[str, set[str]] = {}  # run -> actions it was sent
        self._signals: dict[str, str | None] = {}  # metric name -> its signal; bounded below
        self._rules: set[str] = set()
        # firing alert id -> (run, rule, severity, incident); bounded by max_alert_ids
        self._firing: OrderedDict[str, tuple[str, str, str, str | None]] = OrderedDict()
        self._firing_of_run: dict[str, set[str]] = {}  # run -> its firing alert ids
        # An incident is an alert of these rules (the ruleset's incidents), or names one in "incident".
        self.incident_rules = frozenset(incident_rules)
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()  # (alert id, status)
        self._anomalous: dict[tuple[str, str], int] = {}  # (run, rule) -> firing alert count
        self._incidents: OrderedDict[str, int] = OrderedDict()  # incident id -> firing alerts
        self._server: tuple[Any, threading.Thread] | None = None  # the HTTP server and its thread

    # ------------------------------------------------------------------ runs

    def _touch_run(self, run_id: str, vouched: bool = False) -> bool:
        """Track ``run_id`` as seen now; False when it is not tracked (no room that an unvouched run
        may take)."""
        if vouched:
            self._vouched.add(run_id)
        if run_id in self._runs:
            self._runs.move_to_end(run_id)
            return True
        if len(self._runs) >= self.max_runs:
            victim = next((r for r in self._runs if r not in self._vouched), None)
            if victim is None and not vouched:
                return False
            self._remove_run(victim if victim is not None else next(iter(self._runs)))
            RUNS_EVICTED.inc()
        self._runs[run_id] = None
        self._run_metrics[run_id] = set()
        self._run_signals[run_id] = set()
        self._run_commands[run_id] = set()
        RUNS_TRACKED.set(len(self._runs))
        return True

    def _remove_run(self, run_id: str) -> None:
        self._runs.pop(run_id, None)
        self._vouched.discard(run_id)
        for metric in self._run_metrics.pop(run_id, ()):
            _remove(RUN_METRIC, run_id, metric)
        for signal in self._run_signals.pop(run_id, ()):
            _remove(RUN_SIGNAL, run_id, signal)
        _remove(RUN_LAST_SEEN, run_id)
        for aid in list(self._firing_of_run.get(run_id, ())):
            self._unfire(aid)
        for run, rule in [k for k in self._anomalous if k[0] == run_id]:
            del self._anomalous[(run, rule)]
            _remove(DETECTOR_ANOMALOUS, run, rule)
        for action in self._run_commands.pop(run_id, ()):
            _remove(COMMANDS, run_id, action)
        RUNS_TRACKED.set(len(self._runs))

    def forget_run(self, run_id: str) -> None:
        """Drop every series of ``run_id`` (a finished run, say)."""
        with self._lock:
            if run_id in self._runs:
                self._remove_run(run_id)

    def tracked_runs(self) -> list[str]:
        with self._lock:
            return list(self._runs)

    # ------------------------------------------------------------------ observations

    def signal(self, name: str) -> str | None:
        """The canonical signal ``name`` stands for (cached: one dict lookup per name)."""
        try:
            return self._signals[name]
        except KeyError:
            if len(self._signals) > 10_000:  # a run inventing names: stay bounded
                self._signals.clear()
            found = self._signals[name] = signal_of(name)
            return found

    def listed(self, name: str) -> bool:
        """Allow-listed, as is or per device (the node agent's ``gpu/utilization_pct[3]``)."""
        return name in self.key_metrics or (name[-1:] == "]" and name.partition("[")[0] in self.key_metrics)

    def wants(self, name: str) -> bool:
        """Whether a metric of this name is exported (a signal, or allow-listed)."""
        return self.listed(name) or self.signal(name) is not None

    def observe_metrics(self, run_id: str, metrics: dict, ts: float | None = None, vouched: bool = False) -> None:
        """Export the signals and the allow-listed metrics of one metrics event; the rest are ignored.
        ``vouched``: the run's trainer vouched for it (see the module's docstring)."""
        with self._lock:
            if not self._touch_run(run_id, vouched):
                return
            known, known_signals = self._run_metrics[run_id], self._run_signals[run_id]
            for name, value in metrics.items():
                signal = self.signal(name)
                listed = self.listed(name)
                if signal is None and not listed:
                    continue
                try:
                    value = float(value)
                except (TypeError, ValueError):
                    continue
                # NaN is exported as NaN: it is a signal
                if signal is not None:
                    RUN_SIGNAL.labels(run_id, signal).set(value)
                    known_signals.add(signal)
                if listed and (name in known or len(known) < self.max_metrics_per_run):
                    RUN_METRIC.labels(run_id, name).set(value)
                    known.add(name)
            RUN_LAST_SEEN.labels(run_id).set(time.time() if ts is None else ts)

    def _rule_label(self, rule: str) -> str:
        if rule in self._rules:
            return rule
        if len(self._rules) < self.max_rules:
            self._rules.add(rule)
            return rule
        return OTHER_RULE

    def _unfire(self, alert_id: str) -> None:
        run, rule, severity, incident = self._firing.pop(alert_id)
        of_run = self._firing_of_run.get(run)
        if of_run is not None:
            of_run.discard(alert_id)
            if not of_run:
                del self._firing_of_run[run]
        ALERTS_FIRING.labels(rule, severity).dec()
        key = (run, rule)
        left = self._anomalous.get(key, 0) - 1
        if key in self._anomalous:
            self._anomalous[key] = max(left, 0)
            if run in self._runs:
                DETECTOR_ANOMALOUS.labels(run, rule).set(1 if left > 0 else 0)
        if incident is not None and incident in self._incidents:
            self._incidents[incident] -= 1
            if self._incidents[incident] == 0:
                INCIDENTS_OPEN.dec()

    def observe_command(self, command: dict, vouched: bool = False) -> None:
        """Count a command the worker sent (the dashboard marks rollbacks and stops from it); a
        replay of the same id is ignored. ``action`` is the schema's closed set, so bounded."""
        with self._lock:
            cid = (str(command.get("id", "")), "command")
            if cid in self._seen:
                return
            self._seen[cid] = None
            while len(self._seen) > self.max_alert_ids:
                self._seen.popitem(last=False)
            run, action = str(command.get("run_id", "")), str(command.get("action", ""))
            if not self._touch_run(run, vouched):
                return
            self._run_commands[run].add(action)
            COMMANDS.labels(run, action).inc()

    def observe_alert(self, alert: dict, vouched: bool = False) -> None:
        """Count an alert and update the firing gauges; replays of the same id+status are ignored.
        An alert of a run that finds no room is counted, without its run's series."""
        with self._lock:
            aid = str(alert.get("id", ""))
            status = alert.get("status", "firing")
            if (aid, status) in self._seen:
                return
            self._seen[(aid, status)] = None
            while len(self._seen) > self.max_alert_ids:
                self._seen.popitem(last=False)
            rule = self._rule_label(str(alert.get("rule", "")))
            severity = str(alert["severity"]) if alert.get("severity") in SEVERITIES else "P3"
            ALERTS.labels(rule, severity, "resolved" if status == "resolved" else "firing").inc()
            if status == "resolved":
                if aid in self._firing:
                    self._unfire(aid)
                return
            if aid not in self._firing:
                self._fire(aid, str(alert.get("run_id", "")), alert, vouched)

    def observe_status(self, run_id: str, status: dict | None) -> None:
        """Make the run's firing alerts those its status lists open (what ``trainguard runs``
        shows): a restarted worker's exporter is rebuilt from the state it restored, and an alert
        whose end it never saw (the run forgotten, or taken over by another worker) stops
        counting. ``None``: the run was forgotten."""
        with self._lock:
            listed = {str(a["id"]): a for a in ((status or {}).get("open_alerts") or ())
                      if isinstance(a, dict) and a.get("id")}
            for aid in list(self._firing_of_run.get(run_id, ())):
                if aid not in listed:
                    self._unfire(aid)
            for aid, alert in listed.items():
                if aid not in self._firing:  # open before this process started: not counted again as new
                    self._fire(aid, run_id, alert, False, new=False)

    def _fire(self, aid: str, run: str, alert: dict, vouched: bool, new: bool = True) -> None:
        rule = self._rule_label(str(alert.get("rule", "")))
        severity = str(alert["severity"]) if alert.get("severity") in SEVERITIES else "P3"
        incident = aid if alert.get("kind") == "incident" or alert.get("rule") in self.incident_rules else (
            str(alert["incident"]) if alert.get("incident") else None)
        tracked = self._touch_run(run, vouched)
        self._firing[aid] = (run, rule, severity, incident)
        self._firing_of_run.setdefault(run, set()).add(aid)
        while len(self._firing) > self.max_alert_ids:
            self._unfire(next(iter(self._firing)))
        ALERTS_FIRING.labels(rule, severity).inc()
        if tracked:
            self._anomalous[(run, rule)] = self._anomalous.get((run, rule), 0) + 1
            DETECTOR_ANOMALOUS.labels(run, rule).set(1)
        if incident is not None:
            if incident not in self._incidents:
                if new:
                    INCIDENTS.inc()
                self._incidents[incident] = 0
                while len(self._incidents) > self.max_alert_ids:
                    old, n = self._incidents.popitem(last=False)
                    if n > 0:
                        INCIDENTS_OPEN.dec()
            if self._incidents[incident] == 0:
                INCIDENTS_OPEN.inc()
            self._incidents[incident] += 1

    def observe_dlq(self, reason: str) -> None:
        DLQ.labels(dlq_reason(reason)).inc()

    def observe_batch(self, events: int, samples: int, lag_s: float) -> None:
        """Throughput and lag of one processed batch (lag = now - event time of its last event)."""
        if events:
            EVENTS.inc(events)
        if samples:
            SAMPLES.inc(samples)
        PIPELINE_LAG.set(max(0.0, float(lag_s)))

    # ------------------------------------------------------------------ serving

    def start_http(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``addr:port`` in a daemon thread; return the bound port (port 0 = any)."""
        server, thread = start_http_server(port, addr=addr, registry=REGISTRY)
        self._server = (server, thread)
        return server.server_address[1]

    def stop_http(self) -> None:
        if self._server is not None:
            server, thread = self._server
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
            self._server = None


def _remove(metric, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass


def metric_names(registry: CollectorRegistry = REGISTRY) -> set[str]:
    """Every sample name the registry exposes (``_total``, ``_created`` suffixes included)."""
    names = set()
    for family in registry.collect():
        names.add(family.name)
        for sample in family.samples:
            names.add(sample.name)
    return names

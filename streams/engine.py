"""The detection engine: one event in, alerts and commands out. No Kafka inside.

The same object serves the Faust worker (``streams/app.py``), the offline replay and the
tests. State lives in a mapping the caller provides (a Faust table's store, or a dict):

- ``b"<run>"``            -> :class:`RunState`: breaker, checkpoints, latest node snapshot
- ``b"<run>|<source>"``   -> :class:`SourceState`: every metric's baseline and rule streaks

A step event with 50 metrics touches one source entry and one run entry. Entries changed
since the last flush are listed in :attr:`Engine.dirty` (key -> partition) so the worker
writes each changed entry to the changelog once per batch, not once per metric or event.
Each run entry remembers the offset of the last event applied, so events replayed after
a restart (at-least-once delivery) change nothing and emit nothing new.
"""

from __future__ import annotations

import base64
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, MutableMapping

import numpy as np
import orjson

from trainguard.schemas import events as ev
from trainguard.schemas.signing import SigningKey, sign
from trainguard.streams import policy
from trainguard.streams.baseline import BaselineBlock
from trainguard.streams.rules import RuleSet

log = logging.getLogger("trainguard.engine")

MAX_CHECKPOINTS = 64
MAX_SNAPSHOT_HOSTS = 16
MAX_RECENT_ALERTS = 32


class SourceState:
    """Baselines and open alert episodes of one producer (a trainer rank or a node)."""

    __slots__ = ("kind", "block", "rule_rows", "streaks", "firing", "gate_hi", "gate_lo")

    def __init__(self, kind: str, block: BaselineBlock | None = None):
        self.kind = kind
        self.block = block or BaselineBlock()
        self.rule_rows: list[list[int]] = []       # per row: indices of rules that watch it
        self.gate_hi = np.zeros(0)                 # per row: lowest 'above' of its threshold-only rules
        self.gate_lo = np.zeros(0)                 # per row: highest 'below' of its threshold-only rules
        self.streaks: dict[tuple[int, int], int] = {}      # (rule, row) -> consecutive samples holding
        self.firing: dict[tuple[int, int], dict] = {}      # (rule, row) -> the open alert

    def bind(self, rules: RuleSet) -> None:
        """Work out which rules watch each row added since the last call."""
        names = self.block.names
        for row in range(len(self.rule_rows), len(names)):
            self.rule_rows.append(rules.rules_for(names[row], self.kind))
        hi = np.full(len(names), np.inf)
        lo = np.full(len(names), -np.inf)
        for row, idxs in enumerate(self.rule_rows):
            for i in idxs:
                r = rules.rules[i]
                if r.threshold_only:
                    if r.above is not None:
                        hi[row] = min(hi[row], r.above)
                    if r.below is not None:
                        lo[row] = max(lo[row], r.below)
        self.gate_hi, self.gate_lo = hi, lo

    def to_bytes(self) -> bytes:
        return orjson.dumps({
            "kind": self.kind, "block": self.block.to_state(),
            "streaks": [[r, w, n] for (r, w), n in self.streaks.items()],
            "firing": [[r, w, a] for (r, w), a in self.firing.items()],
        })

    @classmethod
    def from_bytes(cls, raw: bytes, rules: RuleSet) -> "SourceState":
        d = orjson.loads(raw)
        state = cls(d["kind"], BaselineBlock.from_state(d["block"]))
        state.streaks = {(r, w): n for r, w, n in d["streaks"]}
        state.firing = {(r, w): a for r, w, a in d["firing"]}
        state.bind(rules)
        return state


@dataclass
class RunState:
    offset: int = -1
    breaker: policy.BreakerState = field(default_factory=policy.BreakerState)
    checkpoints: list = field(default_factory=list)     # {step, path, ts, healthy}
    nodes: dict = field(default_factory=dict)           # host -> {ts, step, metrics}
    sources: list = field(default_factory=list)         # source ids seen
    open_critical: dict = field(default_factory=dict)   # alert id -> rule, while firing
    recent_alerts: list = field(default_factory=list)   # the last critical alerts, for reports

    def to_bytes(self) -> bytes:
        d = self.__dict__.copy()
        d["breaker"] = self.breaker.to_state()
        return orjson.dumps(d)

    @classmethod
    def from_bytes(cls, raw: bytes) -> "RunState":
        d = orjson.loads(raw)
        d["breaker"] = policy.BreakerState.from_state(d["breaker"])
        return cls(**d)


@dataclass
class Output:
    """Something to publish: ``kind`` is alert, command or dlq; ``key`` the run id."""
    kind: str
    key: str
    value: dict


def _json_value(v: float) -> float | str:
    return v if math.isfinite(v) else ("NaN" if v != v else ("Infinity" if v > 0 else "-Infinity"))


class Engine:
    def __init__(self, rules: RuleSet, store: MutableMapping[bytes, Any] | None = None, *,
                 signing_key: SigningKey | None = None):
        self.rules = rules
        self.store: MutableMapping[bytes, Any] = {} if store is None else store
        self.signing_key = signing_key
        self.dirty: dict[bytes, int] = {}
        self.processed = 0
        self.samples = 0
        self.skipped_replays = 0
        self._params_cache: dict[str, tuple[int, float, bool]] = {}
        # Callables given every decoded event that is applied (not replays), before detection:
        # e.g. the worker's Prometheus exporter. Empty by default; keep them cheap.
        self.on_event: list = []

    # -- state access ----------------------------------------------------------------------

    def _run(self, key: bytes) -> RunState:
        state = self.store.get(key)
        if state is None:
            state = RunState()
            self.store[key] = state
        elif type(state) is bytes:  # restored from the changelog: decode once, on first use
            state = RunState.from_bytes(state)
            self.store[key] = state
        return state

    def _source(self, key: bytes, kind: str) -> SourceState:
        state = self.store.get(key)
        if state is None:
            state = SourceState(kind)
            self.store[key] = state
        elif type(state) is bytes:
            state = SourceState.from_bytes(state, self.rules)
            self.store[key] = state
        return state

    def serialize(self, key: bytes) -> bytes | None:
        state = self.store.get(key)
        if state is None or type(state) is bytes:
            return state
        return state.to_bytes()

    def _baseline_params(self, metric: str) -> tuple[int, float, bool]:
        p = self._params_cache.get(metric)
        if p is None:
            b = self.rules.baseline_for(metric)
            p = self._params_cache[metric] = (b.window, b.k, b.clip_lower)
        return p

    # -- events ------------------------------------------------------------------------------

    def handle(self, raw: bytes, partition: int = 0, offset: int = -1, topic: str = "") -> list[Output]:
        """Apply one raw event; never raises on bad input (it becomes a DLQ record)."""
        try:
            event = ev.decode(raw, expect=(ev.METRICS, ev.CHECKPOINT, ev.LIFECYCLE))
        except ev.SchemaError as exc:
            return [self.dead_letter(raw, str(exc), topic, partition, offset)]
        try:
            return self.apply(event, partition, offset)
        except Exception as exc:  # a bug must not stop the pipeline; keep the evidence
            return [self.dead_letter(raw, f"internal error while processing: {type(exc).__name__}: {exc}",
                                     topic, partition, offset)]

    def apply(self, event: dict, partition: int = 0, offset: int = -1) -> list[Output]:
        run_id = event["run_id"]
        run_key = run_id.encode()
        run = self._run(run_key)
        if 0 <= offset <= run.offset:
            self.skipped_replays += 1
            return []
        if offset >= 0:
            run.offset = offset
        self.dirty[run_key] = partition
        self.processed += 1
        if self.on_event:
            for callback in self.on_event:
                try:
                    callback(event)
                except Exception:  # an observer's failure must not cost the event its detection
                    log.exception("trainguard: on_event callback failed")
        kind = event["schema"]
        if kind == ev.METRICS:
            return self._metrics(event, run, run_id, partition)
        if kind == ev.CHECKPOINT:
            # Only a checkpoint saved while no critical alert was open is a rollback target.
            run.checkpoints.append({"step": event["step"], "path": event["path"], "ts": event["ts"],
                                    "healthy": not run.open_critical})
            del run.checkpoints[:-MAX_CHECKPOINTS]
            return []
        if event["event"] == "rolled_back":
            return self._rolled_back(event, run, run_id, partition)
        return []

    def _rolled_back(self, event: dict, run: RunState, run_id: str, partition: int) -> list[Output]:
        policy.on_rolled_back(run.breaker, event.get("step"))
        outputs = []
        for sid in run.sources:  # the restored model is not what the windows saw
            key = f"{run_id}|{sid}".encode()
            src = self._source(key, "") if key in self.store else None
            if src is not None and src.kind in self.rules.policy["step_sources"]:
                for alert in src.firing.values():
                    outputs.append(Output("alert", run_id, {
                        **alert, "status": "resolved", "ts": event["ts"], "step": event.get("step", alert["step"]),
                        "node_snapshot": None, "resolution": "the trainer rolled back"}))
                src.block.reset()
                src.streaks.clear()
                src.firing.clear()
                self.dirty[key] = partition
        run.open_critical.clear()
        return outputs

    def _metrics(self, event: dict, run: RunState, run_id: str, partition: int) -> list[Output]:
        src = event["source"]
        sid = ev.source_id(src)
        key = f"{run_id}|{sid}".encode()
        state = self._source(key, src["kind"])
        if sid not in run.sources:
            run.sources.append(sid)
        self.dirty[key] = partition
        metrics = event["metrics"]
        names = tuple(metrics)
        block = state.block
        before = len(block)
        rows = block.rows(names, self._baseline_params)
        if len(block) != before:
            state.bind(self.rules)
        x = np.fromiter(metrics.values(), float, len(names))
        self.samples += len(names)
        anomalous, finite, mean, std, lower, upper, ready = block.update(rows, x)

        if src["kind"] == "node":
            run.nodes[src.get("host") or sid] = {"ts": event["ts"], "step": event["step"],
                                                 "metrics": {n: _json_value(v) for n, v in metrics.items()}}
            if len(run.nodes) > MAX_SNAPSHOT_HOSTS:
                run.nodes.pop(min(run.nodes, key=lambda h: run.nodes[h]["ts"]))

        # Only rows that some rule could fire on need Python-level work.
        with np.errstate(invalid="ignore"):
            candidate = anomalous | ~finite | (x > state.gate_hi[rows]) | (x < state.gate_lo[rows])
        if state.firing:  # open episodes are re-judged every sample, anomalous or not
            candidate |= np.isin(rows, [row for _, row in state.firing])
        hits = np.flatnonzero(candidate)
        outputs: list[Output] = []
        critical_ids: list[str] = []
        critical_rules: list[str] = []
        critical_text = ""
        holding: set[tuple[int, int]] = set()
        attempt = run.breaker.attempt
        for j in hits.tolist():
            row = int(rows[j])
            value = float(x[j])
            for ri in state.rule_rows[row]:
                rule = self.rules.rules[ri]
                slot = (ri, row)
                # The baseline must flag a sample to open an episode; the thresholds alone keep
                # it open (a sustained fault soon enters the window and stops looking unusual).
                if not rule.holds(value, bool(anomalous[j]) or slot in state.firing):
                    continue
                holding.add(slot)
                n = state.streaks.get(slot, 0) + 1
                state.streaks[slot] = n
                if n < rule.for_samples:
                    continue
                alert = state.firing.get(slot)
                if alert is None:
                    evidence = self._evidence(value, bool(finite[j]), mean[j], std[j], lower[j], upper[j],
                                              block, row)
                    alert = self._alert(event, run, run_id, sid, rule, names[j], value, evidence, attempt)
                    state.firing[slot] = alert
                    outputs.append(Output("alert", run_id, alert))
                    if rule.critical:
                        run.open_critical[alert["id"]] = rule.name
                        run.recent_alerts.append(alert)
                        del run.recent_alerts[:-MAX_RECENT_ALERTS]
                if rule.critical:
                    critical_ids.append(alert["id"])
                    critical_rules.append(rule.name)
                    critical_text = critical_text or f"{rule.summary} ({names[j]}={value:.4g})"
        # Episodes that no longer hold are resolved; streaks that broke start again.
        present = set(rows.tolist())
        for slot in [s for s in state.streaks if s not in holding and s[1] in present]:
            del state.streaks[slot]
        for slot in [s for s in state.firing if s not in holding and s[1] in present]:
            opened = state.firing.pop(slot)
            run.open_critical.pop(opened["id"], None)
            outputs.append(Output("alert", run_id, self._resolved(opened, event)))

        if src["kind"] in self.rules.policy["step_sources"]:
            decision = policy.on_step(run.breaker, self.rules.policy, run_id=run_id, step=event["step"],
                                      ts=event["ts"], critical=bool(critical_ids), alert_ids=critical_ids,
                                      rules=critical_rules, checkpoints=run.checkpoints, diagnosis=critical_text)
            if decision is not None:
                report = self._report(run, run_id, decision, event)
                command = {**decision.command, "report": report["id"]}
                if self.signing_key is not None:
                    command = sign(command, self.signing_key)
                outputs.append(Output("report", run_id, report))
                outputs.append(Output("command", run_id, command))
        return outputs

    def _window(self, run_id: str, alert: dict) -> dict | None:
        """The metric's recent values, oldest first, from the baseline's ring buffer."""
        src = self.store.get(f"{run_id}|{ev.source_id(alert['source'])}".encode())
        if src is None or type(src) is bytes or alert["metric"] not in src.block.index:
            return None
        block = src.block
        row = block.index[alert["metric"]]
        w, n = int(block.window[row]), int(block.count[row])
        filled = min(n, w)
        positions = [(n - filled + i) % w for i in range(filled)]
        shift = 0.0 if math.isnan(block.shift[row]) else float(block.shift[row])
        values = [float(block.buf[row, p]) + shift for p in positions]
        return {"source": ev.source_id(alert["source"]), "window": w, "values": values}

    def _report(self, run: RunState, run_id: str, decision: policy.Decision, event: dict) -> dict:
        """The diagnosis report behind a command: what happened, the evidence, what was chosen and why."""
        ids = set(decision.command["reason"])
        alerts = [a for a in run.recent_alerts if a["id"] in ids] or run.recent_alerts[-5:]
        windows = {}
        for a in alerts:
            if a["metric"] not in windows:
                window = self._window(run_id, a)
                if window is not None:
                    windows[a["metric"]] = window
        b = run.breaker
        return {
            "schema": "report/1",
            "id": "report-" + decision.command["id"],
            "run_id": run_id,
            "ts": event["ts"],
            "step": event["step"],
            "action": decision.command["action"],
            "command_id": decision.command["id"],
            "summary": decision.command["detail"],
            "incident": {"onset_step": b.onset_step if b.onset_step is not None else event["step"],
                         "rules": sorted({a["rule"] for a in alerts}),
                         "layers": sorted({a.get("layer", "data") for a in alerts})},
            "alerts": [{k: a[k] for k in ("id", "rule", "severity", "metric", "value", "step", "evidence",
                                          "diagnosis", "suggestion") if k in a} for a in alerts],
            "windows": windows,
            "resource_snapshot": run.nodes,
            "checkpoint": {"chosen": decision.checkpoint, "why": decision.why,
                           "candidates": decision.candidates},
            "history": {"rollbacks": b.attempt, "rollbacks_last_hour": len(b.rollback_ts)},
        }

    # -- building outputs ---------------------------------------------------------------------

    def _evidence(self, value, finite, mean, std, lower, upper, block: BaselineBlock, row: int) -> dict:
        if not finite:
            return {"detector": "non_finite", "value": _json_value(value)}
        return {"detector": "rolling_z", "value": value, "mean": float(mean), "std": float(std),
                "lower": float(lower), "upper": float(upper), "window": int(block.window[row]),
                "k": float(block.k[row]), "samples": int(min(block.count[row], block.window[row]))}

    def _alert(self, event, run: RunState, run_id, sid, rule, metric, value, evidence, attempt) -> dict:
        step, ts = event["step"], event["ts"]
        return {
            "schema": ev.ALERT,
            "id": policy.stable_id(run_id, rule.name, sid, metric, step, attempt),
            "run_id": run_id,
            "rule": rule.name,
            "severity": rule.severity,
            "status": "firing",
            "critical": rule.critical,
            "summary": rule.summary,
            "metric": metric,
            "value": _json_value(value),
            "layer": event.get("layer") or self.rules.layer_for(metric),
            "source": event["source"],
            "step": step,
            "ts": ts,
            "onset": {"step": step, "ts": ts},
            "evidence": evidence,
            "diagnosis": rule.diagnosis,
            "suggestion": rule.suggestion,
            "node_snapshot": dict(run.nodes),
        }

    def _resolved(self, alert: dict, event: dict) -> dict:
        return {**alert, "status": "resolved", "step": event["step"], "ts": event["ts"],
                "value": _json_value(float(event["metrics"].get(alert["metric"], math.nan))),
                "node_snapshot": None}

    @staticmethod
    def dead_letter(raw: bytes, reason: str, topic: str = "", partition: int = -1, offset: int = -1) -> Output:
        raw = raw or b""
        record = {"schema": "dlq/1", "reason": reason, "topic": topic, "partition": partition,
                  "offset": offset, "ts": time.time(), "size": len(raw),
                  "raw_b64": base64.b64encode(raw[: ev.MAX_EVENT_BYTES]).decode()}
        try:
            record["raw_text"] = raw[:2048].decode("utf-8")
        except UnicodeDecodeError:
            pass
        return Output("dlq", "", record)

"""The alert book: every open alert of a run, opened and resolved in one place."""

from __future__ import annotations

import logging

from trainguard.schemas import events as ev
from trainguard.streams import keys
from trainguard.streams.alerts import LOUD
from trainguard.streams.engine.outputs import Output, OutputKind, _json_value
from trainguard.streams.engine.state import MAX_BOOK, MAX_RECENT_ALERTS, RunState, StateAccess
from trainguard.streams.signals import base_name, signal_of

log = logging.getLogger("trainguard.engine")


class AlertBook(StateAccess):
    """Every open alert of a run, wherever its kind keeps it: entering one as it fires, finding
    it by id, taking it out as it resolves."""

    _severity: dict[str, str]
    _fired: bool

    def _open_alert(self, run: RunState, run_id: str, alert_id: str, close: bool = False) -> dict | None:
        """The open alert with this id, wherever the run keeps it; with ``close`` it is taken
        out (and its streak reset, so a condition that still holds fires again only after the
        rule's duration, as a new alert)."""
        found = None
        for sid in run.sources:
            key = keys.source_key(run_id, sid)
            if key not in self.store:
                continue
            src = self._source(key, "")
            slots = [slot for slot, a in src.firing.items() if a["id"] == alert_id]
            if slots:
                found = src.firing[slots[0]]
                if close:
                    for slot in slots:
                        del src.firing[slot]
                        src.streaks.pop(slot, None)
                        src.tracks.pop(slot, None)
                    self._changed(key, run.partition)
        for table in (run.stale, run.cross_firing, run.incidents, run.notices):
            for k in [k for k, a in table.items() if a["id"] == alert_id]:
                found = table.pop(k) if close else table[k]
        return found

    @staticmethod
    def _book(run: RunState, alert: dict) -> None:
        """Enter a published alert in the run's book of open alerts (what `status` lists)."""
        value = alert.get("value")
        run.book[alert["id"]] = {"rule": alert["rule"], "severity": alert["severity"], "id": alert["id"],
                                 "metric": alert.get("metric"), "step": alert.get("step"), "ts": alert["ts"],
                                 "value": _json_value(value) if type(value) is float else value,
                                 "flapping": bool(alert.get("flapping"))}
        evidence = alert.get("evidence")
        if isinstance(evidence, dict) and "eta_points" in evidence:  # a forecast: when, for status
            run.book[alert["id"]]["eta"] = {k: evidence[k] for k in ("eta_steps", "eta_points", "threshold")
                                            if k in evidence}
        while len(run.book) > MAX_BOOK:
            del run.book[next(iter(run.book))]

    def _paging(self, run: RunState) -> bool:
        """Whether a P0/P1 alert of the run is open."""
        return any(a["open"] > 0 and self._severity.get(rule) in LOUD for rule, a in run.active.items())

    def _silence_for(self, run: RunState, rule: str) -> dict | None:
        if not run.silences:
            return None
        now = self.clock()
        return next((s for s in run.silences if s["until"] > now and s["rule"] in (None, rule)), None)

    @staticmethod
    def _add(outputs: list, output: Output | None) -> None:
        if output is not None:
            outputs.append(output)

    def _fire(self, run: RunState, alert: dict, rule) -> Output | None:
        self._fired = True
        active = run.active.setdefault(alert["rule"], {"open": 0, "last_ts": 0.0, "alert": None})
        active["open"] += 1
        active["last_ts"] = alert["ts"]
        active["alert"] = {k: alert[k] for k in ("id", "metric", "value", "step", "layer")}
        for incident in self.rules.incidents:
            opened = run.incidents.get(incident.name)
            if incident.inhibit and opened and alert["rule"] in incident.rules:
                alert["inhibited_by"] = opened["id"]  # the incident already pages for it
        if rule.critical:
            run.open_critical[alert["id"]] = alert["rule"]
            run.recent_alerts.append(alert)
            del run.recent_alerts[:-MAX_RECENT_ALERTS]
        if not getattr(rule, "emit", True):
            alert["incident_only"] = True  # kept for incidents, never published on its own
            return None
        self._book(run, alert)
        silence = self._silence_for(run, alert["rule"])
        if silence is not None:  # published and recorded, but no sink pages for it
            alert["silenced"] = dict(silence)
        return Output(OutputKind.ALERT, alert["run_id"], alert)

    def _resolve(self, run: RunState, alert: dict, event: dict, **extra) -> Output | None:
        active = run.active.get(alert["rule"])
        if active and active["open"] > 0:
            active["open"] -= 1
        run.open_critical.pop(alert["id"], None)
        run.acknowledged.pop(alert["id"], None)
        run.book.pop(alert["id"], None)
        if alert.get("incident_only"):
            return None
        resolved = {**alert, "status": "resolved", "step": event.get("step", alert.get("step")),
                    "ts": event["ts"], "node_snapshot": None, **extra}
        resolved.pop("flapping", None)  # it settled: the sinks end the flapping notice with it
        return Output(OutputKind.ALERT, alert["run_id"], resolved)

    def _alert(self, event, run: RunState, run_id, sid, rule, metric, value, evidence, attempt) -> dict:
        step, value = event["step"], _json_value(value)
        first = evidence.get("first_spike") if isinstance(evidence, dict) else None
        # A repeated spike began at the first one: the breaker's healthy checkpoint predates it.
        onset = first if first is not None and first["step"] < step else None
        return ev.alert_event(
            run_id, rule.name, alert_id=ev.alert_id(run_id, rule.name, sid, metric, step, attempt),
            severity=rule.severity, critical=rule.critical, summary=rule.summary, metric=metric, value=value,
            signal=signal_of(base_name(metric)), metrics=[metric], values={metric: value},
            layer=event.get("layer") or self.rules.layer_for(metric), source=event["source"], step=step,
            ts=event["ts"], evidence=evidence, diagnosis=rule.diagnosis, suggestion=rule.suggestion,
            onset=onset, node_snapshot=dict(run.nodes))

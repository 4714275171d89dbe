"""The alert book: every open alert of a run, opened and resolved in one place."""

from __future__ import annotations

import logging
from typing import Callable

from trainguard.schemas import events as ev
from trainguard.schemas.signing import TRAINER, UNAUTHENTICATED
from trainguard.streams import keys
from trainguard.streams.alerts import LOUD
from trainguard.streams.engine.outputs import Output, OutputKind, _json_value
from trainguard.streams.engine.state import (
    CROSS,
    INCIDENT,
    LISTED,
    MAX_BOOK,
    MAX_RECENT_ALERTS,
    NOTICE,
    SOURCE,
    STALE,
    RunState,
    StateAccess,
    book_entry,
)

__all__ = ["AlertBook", "CROSS", "INCIDENT", "LISTED", "NOTICE", "SOURCE", "STALE"]

log = logging.getLogger("trainguard.engine")


class AlertBook(StateAccess):
    """The run's alert book (``RunState.book``): every open alert of the run, one entry per alert
    id, entered as it fires and taken out as it resolves, whatever kind of rule judges it. The
    breaker reads it (is a critical alert open?), the status lists it, operators acknowledge and
    resolve through it."""

    _severity: dict[str, str]
    _fired: bool
    _vouched: Callable[..., dict]  # the breaker's: who vouched for an alert's evidence
    _remedy: Callable[..., dict]   # the breaker's: what it can do about an alert, or why a person must

    def _open_alert(self, run: RunState, run_id: str, alert_id: str, close: bool = False) -> dict | None:
        """The open alert with this id; with ``close`` it is taken out of the book and its room
        (and its streak reset, so a condition that still holds fires again only after the
        rule's duration, as a new alert)."""
        entry = run.book.get(alert_id)
        if entry is not None and entry["room"] != SOURCE:
            if close:
                del run.book[alert_id]
            return entry["alert"]
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
        if close:
            run.book.pop(alert_id, None)
        return found

    def _open_alerts(self, run: RunState, run_id: str) -> list[str]:
        """The ids of every open alert of the run: the book's, and those of its sources (a
        source's alert the book no longer lists, past ``MAX_BOOK``, is still open)."""
        ids = dict.fromkeys(run.book)
        for sid in run.sources:
            key = keys.source_key(run_id, sid)
            if key in self.store:
                ids.update(dict.fromkeys(a["id"] for a in self._source(key, "").firing.values()))
        return list(ids)

    @staticmethod
    def _in_room(run: RunState, room: str, key: str | None = None) -> dict[str, dict]:
        """The room's open alerts by the room's key (all of them, or the one under ``key``)."""
        return {e["key"]: e["alert"] for e in run.book.values()
                if e["room"] == room and (key is None or e["key"] == key)}

    @staticmethod
    def _critical_open(run: RunState) -> bool:
        """Whether a critical alert is open on the trainer's own evidence (a checkpoint saved
        meanwhile is no rollback target): neither a forger nor a node agent can spoil one."""
        return any(e["critical"] and e.get("authority", TRAINER) == TRAINER for e in run.book.values())

    @staticmethod
    def _book(run: RunState, alert: dict, room: str = SOURCE, key: str | None = None) -> None:
        """Enter an alert in the book: what `status` lists, and for a run-level room the alert
        itself under its key."""
        run.book[alert["id"]] = book_entry(alert, room, key)
        if len(run.book) > MAX_BOOK:  # the oldest source alerts leave the list; they stay open in their source
            # Warnings first: a flood of them must not push out the critical alert the breaker,
            # the checkpoints' health, `status` and an operator's ack read here.
            source = [(e["critical"], aid) for aid, e in run.book.items() if e["room"] == SOURCE]
            for _, aid in sorted(source, key=lambda c: c[0])[:len(run.book) - MAX_BOOK]:
                del run.book[aid]

    def _paging(self, run: RunState) -> bool:
        """Whether a P0/P1 alert of the run is open on the trainer's own evidence (with keys)."""
        return any(a["open"] > 0 and self._severity.get(rule) in LOUD
                   and (a.get("alert") or {}).get("authority", TRAINER) == TRAINER for rule, a in run.active.items())

    def _silence_for(self, run: RunState, rule: str) -> dict | None:
        if not run.silences:
            return None
        now = self.clock()
        return next((s for s in run.silences if s["until"] > now and s["rule"] in (None, rule)), None)

    @staticmethod
    def _add(outputs: list, output: Output | None) -> None:
        if output is not None:
            outputs.append(output)

    def _fire(self, run: RunState, alert: dict, rule, room: str = SOURCE, key: str | None = None) -> Output | None:
        """Open an alert: in the book (under ``room`` and ``key``), the incident bookkeeping and
        the reports' recent critical alerts; its event, unless the rule only feeds incidents."""
        self._fired = True
        vouched = alert.get("authority") != UNAUTHENTICATED
        if vouched:  # forged evidence joins no incident, pages into no checkpoint's health, no report
            active = run.active.setdefault(alert["rule"], {"open": 0, "last_ts": 0.0, "alert": None})
            active["open"] += 1
            active["last_ts"] = alert["ts"]
            active["alert"] = {k: alert[k] for k in ("id", "metric", "value", "step", "layer", "authority")
                               if k in alert}
        incidents = self._in_room(run, INCIDENT) if self.rules.incidents else {}
        for incident in self.rules.incidents:
            opened = incidents.get(incident.name)
            if incident.inhibit and opened and alert["rule"] in incident.rules:
                alert["inhibited_by"] = opened["id"]  # the incident already pages for it
        if rule.critical and vouched:
            run.recent_alerts.append(alert)
            del run.recent_alerts[:-MAX_RECENT_ALERTS]
        if not getattr(rule, "emit", True):
            alert["incident_only"] = True  # kept for incidents, never published on its own
        self._book(run, alert, room, key)
        if alert.get("incident_only"):
            return None
        alert["remedy"] = self._remedy(run, alert, rule)
        silence = self._silence_for(run, alert["rule"])
        if silence is not None:  # published and recorded, but no sink pages for it
            alert["silenced"] = dict(silence)
        return Output(OutputKind.ALERT, alert["run_id"], alert)

    def _resolve(self, run: RunState, alert: dict, event: dict, **extra) -> Output | None:
        active = run.active.get(alert["rule"]) if alert.get("authority") != UNAUTHENTICATED else None
        if active and active["open"] > 0:
            active["open"] -= 1
        run.book.pop(alert["id"], None)
        if alert.get("incident_only"):
            return None
        resolved = {**alert, "status": "resolved", "step": event.get("step", alert.get("step")),
                    "ts": event["ts"], "node_snapshot": None, **extra}
        resolved.pop("flapping", None)  # it settled: the sinks end the flapping notice with it
        return Output(OutputKind.ALERT, alert["run_id"], resolved)

    def _signal_judged(self, rule, metric: str) -> str | None:
        """The signal the alert judged ``metric`` as: a dialect's, or the one its words suggest
        when the rule watches signals and not that name."""
        signal = self.rules.signal_for(metric)
        if signal is None and rule.signals and not rule.metrics.match(metric):
            signal = self.rules.inferable(metric)
        return signal

    def _alert(self, event, run: RunState, run_id, sid, rule, metric, value, evidence, attempt) -> dict:
        step, value = event["step"], _json_value(value)
        first = evidence.get("first_spike") if isinstance(evidence, dict) else None
        # A repeated spike began at the first one: the breaker's healthy checkpoint predates it.
        onset = first if first is not None and first["step"] < step else None
        return self._vouched(ev.alert_event(
            run_id, rule.name, alert_id=ev.alert_id(run_id, rule.name, sid, metric, step, attempt),
            severity=rule.severity, critical=rule.critical, summary=rule.summary, metric=metric, value=value,
            signal=self._signal_judged(rule, metric), metrics=[metric], values={metric: value},
            layer=event.get("layer") or self.rules.layer_for(metric), source=event["source"], step=step,
            ts=event["ts"], evidence=evidence, diagnosis=rule.diagnosis, suggestion=rule.suggestion,
            onset=onset, node_snapshot=dict(run.nodes)))

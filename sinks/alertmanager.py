"""Alertmanager sink: alerts go to ``POST /api/v2/alerts``, where teams' routes, silences and
inhibitions already live.

Each trainguard alert becomes one Alertmanager alert:

- labels (they identify the alert, so a resolution matches its firing): ``alertname`` and
  ``rule`` (the rule), ``run``, ``severity``, ``host``, and where the alert has them
  ``metric``, ``layer``, ``rank``, ``gpu``, escaped like the annotations;
- annotations: ``summary`` (the ``title.txt`` template), ``root_cause`` (the diagnosis),
  ``suggestion``, ``report``, ``incident``, ``value``, ``step``, ``alert_id``;
- ``startsAt`` = onset time; a resolved alert carries ``endsAt`` = its time.

Alertmanager resolves on its own an alert that is not re-sent (like Prometheus, which
re-sends every minute), so a firing alert is re-posted every ``resend_s`` with ``endsAt``
= now + 4 x ``resend_s`` until its resolution arrives; if trainguard stops, its alerts
resolve a few minutes later instead of firing forever. At most ``max_active`` firing alerts
(default 1000), each for at most ``max_firing_s`` (default one day), are re-sent.

Delivery itself (retries with backoff, outbox, once per id+status, ``undelivered()``) is
:class:`~trainguard.sinks.webhooks.delivery.WebhookSink`'s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from datetime import datetime, timezone

from trainguard.sinks.paging import muted
from trainguard.sinks.reports import shown_time
from trainguard.sinks.webhooks.delivery import WebhookSink
from trainguard.sinks.webhooks.messages import alert_fields, escape_annotation

log = logging.getLogger("trainguard.sinks.alertmanager")


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _num(ts, default: float) -> float:
    """``ts`` where a date can hold it (no NaN, no infinity, no year past 9999), else ``default``."""
    when = shown_time(ts)
    return default if when is None or when < 0 else when


def _report_url(alert: dict) -> str:
    """The alert's report where it is one http(s) URL, else ""."""
    report = alert.get("report")
    if isinstance(report, str) and report.startswith(("http://", "https://")) and report.isprintable() \
            and " " not in report:
        return report
    return ""


class AlertmanagerSink(WebhookSink):
    """``AlertmanagerSink("http://alertmanager:9093")`` (the base URL, without ``/api/v2``)."""

    name = "alertmanager"
    url_setting = "TRAINGUARD_ALERTMANAGER_URL"
    settings = (url_setting,)

    def __init__(self, url: str, *, resend_s: float = 60.0, max_active: int = 1000, max_firing_s: float = 86_400.0,
                 **kwargs):
        base = url.rstrip("/")
        for suffix in ("/api/v2/alerts", "/api/v2"):
            if base.endswith(suffix):
                base = base[: -len(suffix)]
        self.base_url = base
        self.resend_s = resend_s
        self.max_active = max_active
        self.max_firing_s = max_firing_s
        self._active: OrderedDict[str, dict] = OrderedDict()  # alert id -> firing alert (delivered)
        self._active_lock = threading.Lock()
        self._next_resend = time.monotonic() + resend_s
        super().__init__(base + "/api/v2/alerts", **kwargs)

    def labels(self, alert: dict) -> dict[str, str]:
        """The labels, escaped like the annotations (Alertmanager's templates put them into messages
        too: a label holds no newline, no ``<!channel>``); the same for a firing and its resolution."""
        src = alert.get("source") or {}
        if not isinstance(src, dict):
            src = {}
        labels = {"alertname": alert.get("rule", ""), "rule": alert.get("rule", ""), "run": alert.get("run_id", ""),
                  "severity": alert.get("severity", ""), "host": src.get("host") or ""}
        for name, value in (("metric", alert.get("metric")), ("layer", alert.get("layer")),
                            ("rank", src.get("rank")), ("gpu", src.get("gpu"))):
            if value not in (None, ""):
                labels[name] = value
        return {k: escape_annotation(v) for k, v in labels.items()}

    def accepts(self, event: dict) -> bool:
        # every alert (Alertmanager groups and routes itself), but not those the engine muted
        return str(event.get("schema", "")).startswith("alert/") and not (
            event.get("status") != "resolved" and muted(event))

    def annotations(self, alert: dict) -> dict[str, str]:
        # Alertmanager's templates put these into messages we do not see: escaped like markdown
        fields = alert_fields(alert)
        # a report that is a URL is the generatorURL too, a link by design: the one field left one
        report = escape_annotation(_report_url(alert)) or fields["report"]
        notes = {"summary": self.templates.render("title.txt", alert), "root_cause": fields["root_cause"],
                 "suggestion": fields["suggestion"], "report": report,
                 "incident": fields["incident"],
                 "value": fields["value"], "step": fields["step"], "alert_id": fields["id"]}
        return {k: v for k, v in notes.items() if v}

    def postable(self, alert: dict, now: float | None = None) -> dict:
        now = time.time() if now is None else now
        ts = _num(alert.get("ts"), now)
        starts = min(_num((alert.get("onset") or {}).get("ts"), ts), ts)
        out = {"labels": self.labels(alert), "annotations": self.annotations(alert), "startsAt": _iso(starts)}
        if alert.get("status") == "resolved":
            out["endsAt"] = _iso(max(starts, min(ts, now)))
        else:
            out["endsAt"] = _iso(now + 4 * self.resend_s)
        report = _report_url(alert)
        if report:
            out["generatorURL"] = report
        return out

    def payload(self, alert: dict) -> list[dict]:  # type: ignore[override]  # Alertmanager's API takes a list
        return [self.postable(alert)]

    # -- keep firing alerts alive in Alertmanager until they resolve

    def delivered(self, alert: dict) -> None:
        with self._active_lock:
            aid = str(alert.get("id"))
            if alert.get("status") == "resolved":
                self._active.pop(aid, None)
                return
            self._active[aid] = alert
            while len(self._active) > self.max_active:
                self._active.popitem(last=False)

    def active(self) -> list[dict]:
        """Firing alerts being re-sent now."""
        with self._active_lock:
            return list(self._active.values())

    def tick_due(self) -> bool:
        return bool(self._active) and time.monotonic() >= self._next_resend

    def tick(self) -> None:
        if time.monotonic() < self._next_resend:
            return
        self._next_resend = time.monotonic() + self.resend_s
        now = time.time()
        with self._active_lock:
            for aid, alert in list(self._active.items()):
                if now - _num(alert.get("ts"), now) > self.max_firing_s:
                    log.warning("trainguard: alertmanager stops re-sending alert %s, firing for over %.0f s",
                                aid, self.max_firing_s)
                    del self._active[aid]
            alerts = list(self._active.values())
        if not alerts:
            return
        postable = []
        for alert in alerts:  # it was delivered, so it renders; one that does not is dropped alone
            try:
                postable.append(self.postable(alert, now))
            except Exception as exc:
                log.error("trainguard: alertmanager stops re-sending alert %s, which no longer renders: %s",
                          str(alert.get("id"))[:80], exc)
                with self._active_lock:
                    self._active.pop(str(alert.get("id")), None)
        if not postable:
            return
        try:
            self._post_json(postable)
        except Exception as exc:  # the next tick tries again; the alerts stay active until endsAt
            log.warning("trainguard: alertmanager re-send of %d firing alert(s) failed: %s", len(alerts), exc)

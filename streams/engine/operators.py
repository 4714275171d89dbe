"""Operator actions: silences, acknowledgements and alerts resolved by hand."""

from __future__ import annotations

import logging

from trainguard.streams.engine.book import STALE, AlertBook
from trainguard.streams.engine.state import MAX_SILENCES, RunState

log = logging.getLogger("trainguard.engine")


class OperatorActions(AlertBook):
    """What an operator does to a run: silence it (or one rule), end a silence, acknowledge or
    resolve an open alert by hand."""

    def _operator(self, event: dict, run: RunState, run_id: str, outputs: list) -> None:
        """An operator silenced the run (or one rule of it) until a time, ended a silence, or
        acknowledged or resolved an open alert by hand."""
        who = f"{event.get('by') or '?'}: {event.get('reason', '')}"
        if event["action"] == "ack":
            entry = run.book.get(event["alert_id"])
            if entry is None or self._open_alert(run, run_id, event["alert_id"]) is None:
                log.warning("trainguard: run %s: no open alert %s to acknowledge", run_id, event["alert_id"])
                return
            entry["acknowledged"] = {"by": event.get("by", ""), "reason": event.get("reason", ""), "ts": event["ts"]}
            return
        if event["action"] == "resolve":
            entry = run.book.get(event["alert_id"])
            if entry is not None and entry["room"] == STALE:  # "killed on purpose": not again until it speaks
                run.dismissed = [*[k for k in run.dismissed if k != entry["key"]], entry["key"]][-MAX_SILENCES:]
            alert = self._open_alert(run, run_id, event["alert_id"], close=True)
            if alert is None:
                log.warning("trainguard: run %s: no open alert %s to resolve", run_id, event["alert_id"])
                return
            self._add(outputs, self._resolve(run, alert, event, resolution=f"resolved by hand by {who}"))
            return
        now = self.clock()
        run.silences = [s for s in run.silences if s["id"] != event["id"] and s["until"] > now]
        if event["action"] == "silence":
            run.silences.append({"id": event["id"], "rule": event.get("rule"), "until": event["until"],
                                 "reason": event.get("reason", ""), "by": event.get("by", "")})
            del run.silences[:-MAX_SILENCES]
        log.warning("trainguard: run %s: %s %s%s by %s: %s", run_id, event["action"], event["id"],
                    f" (rule {event['rule']})" if event.get("rule") else "", event.get("by") or "?",
                    event.get("reason", ""))

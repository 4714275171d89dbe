"""Status and reports: a run as operators see it, and why a command was sent."""

from __future__ import annotations

import math
import time
from typing import Iterator

from trainguard.schemas import events as ev
from trainguard.streams import keys, policy
from trainguard.streams.engine.outputs import Output, OutputKind, fit
from trainguard.streams.engine.state import LISTED, RunState, StateAccess


class StatusRoom(StateAccess):
    """What `trainguard runs` and `status` show of a run, its summary once it is forgotten, and
    the diagnosis report behind a command."""

    worker_name: str
    summary_retention_s: float
    _status_at: dict[bytes, float]
    _final: dict[bytes, dict]

    @staticmethod
    def _outcome(run: RunState) -> str | None:
        """How the run ended, as its trainer said (a stop the breaker sent is not one the trainer
        applied): stopped, finished, or None."""
        if run.stopped:
            return "stopped"
        return "finished" if run.finished else None

    @staticmethod
    def _command_said(command: dict) -> str:
        """What came of the breaker's last command, in words: "stop sent at step 140, refused by the
        trainer: unknown signing key"."""
        sent = f"{command['action']} sent" + (f" at step {command['step']}" if command.get("step") is not None else "")
        detail = command.get("detail") or "no detail"
        status = command.get("status")
        if status == "applied":
            at = f" at step {command['acked_step']}" if command.get("acked_step") is not None else ""
            said = f"{sent}, applied by the trainer{at}" + (f": {detail}" if command.get("detail") else "")
        elif status in ("rejected", "failed"):
            said = f"{sent}, {'refused by' if status == 'rejected' else 'failed in'} the trainer: {detail}"
            if command.get("unverified"):
                said += f" (not authenticated: {command['unverified']}; not applied either way)"
        elif status == "expired":
            said = f"{sent}, not applied: no ack from the trainer before it expired"
        else:
            said = f"{sent}, not acked yet"
        return said

    def status(self, run_id: str) -> dict | None:
        """The run's state as an operator asks for it (a ``status/1`` event), or None when this
        engine holds no such run."""
        key = run_id.encode()
        if key not in self.store:
            return None
        run = self._look(key)
        trainer = run.last_seen.get("trainer")
        steps = [seen[1] for seen in run.last_seen.values() if seen[1] is not None]
        healthy = next((c for c in reversed(run.checkpoints) if c.get("healthy")), None)
        open_alerts = [{**{k: entry[k] for k in LISTED if k in entry}, "acknowledged": entry.get("acknowledged")}
                       for entry in run.book.values() if entry.get("listed", True)]
        breaker = run.breaker
        return {
            "schema": ev.STATUS, "run_id": run_id, "ts": time.time(),
            "last_event_ts": max((seen[0] for seen in run.last_seen.values()), default=None),
            "last_step": trainer[1] if trainer and trainer[1] is not None else max(steps, default=None),
            "finished": run.finished, **({"outcome": ended} if (ended := self._outcome(run)) else {}),
            "sources": len(run.sources),
            "breaker": {"status": breaker.status, "rollbacks": breaker.attempt, "streak": breaker.streak,
                        "restored_step": breaker.restored_step,
                        "pending_command": breaker.command_id if breaker.status in (policy.AWAITING, policy.RERUN)
                        else None},
            **({"command": {**{k: run.command.get(k) for k in ("id", "action", "step", "status")},
                            "said": self._command_said(run.command)}} if run.command else {}),
            "open_alerts": open_alerts, "checkpoints": len(run.checkpoints),
            # what `trainguard command RUN rollback --to STEP` may restore: only what the trainer reported
            "saved_checkpoints": [{"step": c["step"], "path": c["path"], "healthy": c["healthy"],
                                   **({"why": c["why"]} if "why" in c else {})} for c in run.checkpoints],
            "last_healthy_checkpoint": {"step": healthy["step"], "path": healthy["path"]} if healthy else None,
            **({"unsigned_checkpoints": [dict(c) for c in run.unsigned_checkpoints]} if run.unsigned_checkpoints
               else {}),
            "dropped_events": run.dropped_events, "worker": self.worker_name,
            "silences": [dict(s) for s in run.silences if s["until"] > self.clock()],
            "unwatched_metrics": list(run.unwatched),
            "limits": {cap: dict(entry) for cap, entry in run.limits.items()},
        }

    def status_outputs(self) -> Iterator[Output]:
        """A status for every run touched since the last call; a forgotten run's is its summary
        (``state_freed``), kept on the compacted status topic for ``summary_retention_s``. Each is
        made as the caller takes it, so take them all at once: a burst of 20,000 new runs made a
        list of 100 MB, which the allocator kept after it was freed."""
        touched, self.touched = self.touched, set()
        return self._statuses(touched, time.time())

    def _statuses(self, touched: set, now: float) -> Iterator[Output]:
        for key in touched:
            value = self._final.pop(key, None) or self.status(key.decode())
            if value is not None and key in self.store:
                self._status_at[key] = now
            if value is not None:  # past one message, it leaves out its longest lists, said in it
                value = fit(value, self.limits.record_bytes)
            yield Output(OutputKind.STATUS, key.decode(), value)  # None: a tombstone

    def summary(self, run_key: bytes) -> dict | None:
        """The run's last status as it is forgotten: how it ended, its rollbacks, the alerts still
        open, until when it is kept."""
        status = self.status(run_key.decode())
        if status is None:
            return None
        run = self._look(run_key)
        outcome = self._outcome(run) or "idle"
        return {**status, "state_freed": True, "outcome": outcome,
                "recent_alerts": [{k: a.get(k) for k in ("id", "rule", "severity", "step", "metric")}
                                  for a in run.recent_alerts[-10:]],
                "retained_until": time.time() + self.summary_retention_s}

    def _window(self, run_id: str, alert: dict) -> dict | None:
        """The metric's recent values, oldest first, from the baseline's ring buffer."""
        src = self.store.get(keys.source_key(run_id, ev.source_id(alert["source"])))
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
        return ev.report_event(
            run_id, decision.command, ts=event["ts"], step=event["step"],
            incident={"onset_step": decision.onset if decision.onset is not None else event["step"],
                      "first_critical_step": b.onset_step if b.onset_step is not None else event["step"],
                      "margin_steps": self.rules.policy.rollback_min_steps_before_onset,
                      "rules": sorted({a["rule"] for a in alerts}),
                      "layers": sorted({a.get("layer", "data") for a in alerts}),
                      "breaker_rules": self.rules.breaker_rules},
            alerts=[{k: a[k] for k in ("id", "rule", "severity", "metric", "value", "step", "evidence",
                                       "diagnosis", "suggestion") if k in a} for a in alerts],
            windows=windows, resource_snapshot=run.nodes,
            checkpoint={"chosen": decision.checkpoint, "why": decision.why, "candidates": decision.candidates,
                        "passed_over": decision.passed_over,
                        **({"refused_unsigned": [dict(c) for c in run.unsigned_checkpoints]}
                           if run.unsigned_checkpoints and decision.checkpoint is None else {})},
            history={"rollbacks": b.attempt, "rollbacks_last_hour": len(b.rollback_ts),
                     "ladder": [dict(r) for r in b.ladder], "rungs": self.rules.policy.rungs,
                     **({"rung": decision.rung} if decision.rung is not None else {}),
                     **({"verdict": decision.verdict} if decision.verdict else {}),
                     **({"suspect_host": b.suspect} if decision.verdict == policy.HARDWARE and b.suspect else {})})

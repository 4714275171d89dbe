"""What a page shows of each record: small views of the fields it uses, of the types it
expects, whatever else a (valid) record holds, and values as short text for a page (escaped
where they are written)."""

from __future__ import annotations

import math
import time

import orjson

from trainguard.operate import _state as cli_state
from trainguard.sinks.reports import forecast_text, format_value, int64
from trainguard.sinks.reports import shown as _shown


def short_text(v, limit: int = 256) -> str:
    """Any value of a record as a short string for a page (escaped where it is written)."""
    if v is None:
        return ""
    if isinstance(v, str):
        text = v
    elif type(v) in (int, float):
        text = format_value(v)
    else:  # a list, an object, a boolean: as JSON, as it came
        try:
            text = orjson.dumps(v, option=orjson.OPT_NON_STR_KEYS).decode()
        except TypeError:  # an integer beyond 64 bits somewhere inside
            text = str(v)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def plain_value(v):
    """A metric or alert value: a number, a non-finite one's name, or text (never a Python None)."""
    if type(v) is float:
        return v if math.isfinite(v) else str(v)
    if int64(v) is not None:
        return v
    return short_text(v, 32)


def status_view(s: dict) -> dict:
    breaker = s["breaker"]
    ckpt = s.get("last_healthy_checkpoint") or {}
    unwatched = s.get("unwatched_metrics")
    names = [short_text(n) for n in unwatched[:50] if isinstance(n, str)] if isinstance(unwatched, list) else []
    return {"run_id": s["run_id"], "ts": s["ts"], "last_step": s.get("last_step"), "state": run_state(s),
            "last_event_ts": s.get("last_event_ts"), "finished": s.get("finished") is True,
            "breaker": {"status": short_text(breaker["status"], 64), "rollbacks": breaker["rollbacks"]},
            "open_alerts": len(s["open_alerts"]), "last_healthy_checkpoint_step": int64(ckpt.get("step")),
            "acknowledged": _acknowledged(s["open_alerts"]), "silences": _silences(s.get("silences")),
            "unwatched_metrics": names, "suspect_checkpoints": _suspect(s.get("saved_checkpoints")),
            # what came of the breaker's last command: "stop sent at step 140, refused by the trainer: ..."
            "command": short_text((s.get("command") or {}).get("said") if isinstance(s.get("command"), dict)
                                  else None, 600),
            "unwatched_more": max(0, len(unwatched) - len(names)) if isinstance(unwatched, list) else 0,
            # a finished run's summary, kept on the status topic after its detection state was freed
            "state_freed": s.get("state_freed") is True,
            "outcome": s.get("outcome") if s.get("outcome") in ("finished", "stopped", "idle") else None,
            "retained_until": s.get("retained_until") if type(s.get("retained_until")) in (int, float) else None}


def run_state(s: dict) -> str:
    """The run's state in the words of ``trainguard runs`` and ``status`` (from the same status
    record): "finished", "awaiting rollback", a command the trainer refused, ..."""
    try:
        return short_text(cli_state(s), 300)
    except Exception:  # valid, but of a shape the CLI cannot show either
        return "unreadable status"


def _suspect(saved) -> list[dict]:
    """The newest checkpoints the worker holds suspect (never a rollback target), each with why."""
    suspect = [c for c in saved if isinstance(c, dict) and c.get("healthy") is False] if isinstance(saved, list) else []
    return [{"step": int64(c.get("step")), "why": short_text(c.get("why"), 300) or "saved while a P0/P1 alert was open"}
            for c in suspect[-10:]]


def _acknowledged(open_alerts) -> dict[str, str]:
    """Open alert id -> who acknowledged it and why, as the page shows it."""
    out = {}
    for a in open_alerts[:200] if isinstance(open_alerts, list) else []:
        ack = a.get("acknowledged") if isinstance(a, dict) else None
        if isinstance(a.get("id") if isinstance(a, dict) else None, str) and isinstance(ack, dict):
            reason = f": {short_text(ack.get('reason'), 120)}" if ack.get("reason") else ""
            out[a["id"]] = f"acknowledged by {short_text(ack.get('by'), 64) or '?'}{reason}"
    return out


def _silences(silences) -> list[dict]:
    return [{"id": short_text(s.get("id"), 64), "rule": short_text(s.get("rule"), 64) or "any rule",
             "until": utc_time(s.get("until"))}
            for s in (silences[:20] if isinstance(silences, list) else []) if isinstance(s, dict)]


def utc_time(ts) -> str:
    """A record's time as a person reads it (UTC); '?' for one that is no time."""
    if type(ts) not in (int, float) or not 0 < ts < 1e11:
        return "?"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts))


def alert_view(a: dict) -> dict:
    metrics = a.get("metrics")
    names = [m for m in metrics[:16] if isinstance(m, str)] if isinstance(metrics, list) else []
    metric = a.get("metric")
    if isinstance(metric, str) and metric not in names:
        names.append(metric)
    return {"id": a["id"], "status": a["status"], "severity": a["severity"], "rule": short_text(a["rule"]),
            "metric": short_text(metric), "metrics": [short_text(m) for m in names],
            "value": plain_value(a.get("value")),
            "step": a.get("step"), "ts": a["ts"], "silenced": bool(a.get("silenced")),
            "forecast": short_text(forecast_text(a.get("evidence")) or "")}


def command_view(c: dict) -> dict:  # no signature: the page shows what was decided, not the MAC
    target = c.get("target") or {}
    return {"id": c["id"], "action": c["action"], "issued": c["issued"], "detail": short_text(c.get("detail"), 160),
            "target_step": target.get("step"), "target_path": short_text(target.get("path"))}


def ack_view(a: dict) -> dict:
    return {"command_id": a["command_id"], "status": a["status"], "detail": short_text(a.get("detail"), 160),
            "step": a.get("step"), "ts": a["ts"]}


def report_for_page(r: dict) -> dict:
    """A (valid) report with the shapes its page expects in the fields the schema leaves open,
    so that an odd one is shown as far as it goes instead of failing its page."""
    def obj(v) -> dict:
        return v if isinstance(v, dict) else {}

    def texts(v) -> list[str]:
        return [short_text(x) for x in v] if isinstance(v, list) else []

    alerts = []
    for a in r["alerts"] if isinstance(r.get("alerts"), list) else []:
        if isinstance(a, dict):
            evidence = dict(obj(a.get("evidence")))
            if not {"lower", "upper", "mean"} <= set(evidence):
                evidence.pop("lower", None)
            alerts.append({**a, "rule": short_text(a.get("rule")), "metric": short_text(a.get("metric")),
                           "severity": short_text(a.get("severity")),
                           "step": a["step"] if int64(a.get("step")) is not None
                           else _shown(plain_value(a.get("step"))),
                           "evidence": evidence})
    incident = obj(r.get("incident"))
    checkpoint = obj(r.get("checkpoint"))
    chosen = obj(checkpoint.get("chosen"))
    windows = {k: {"source": short_text(w.get("source")), "values": w["values"] if isinstance(w.get("values"), list)
                   else []} for k, w in obj(r.get("windows")).items() if isinstance(w, dict)}
    return {**r, "step": _shown(int64(r.get("step"))), "ts": r["ts"] if r["ts"] < 1e11 else 0.0,  # a date it can show
            "incident": {**incident, "rules": texts(incident.get("rules")), "layers": texts(incident.get("layers")),
                         "onset_step": _shown(int64(incident.get("onset_step")))},
            "alerts": alerts, "windows": windows,
            "history": {k: _shown(plain_value(v)) for k, v in obj(r.get("history")).items()},
            "checkpoint": {**checkpoint, "why": short_text(checkpoint.get("why"), 1000),
                           "chosen": {"step": _shown(int64(chosen.get("step"))), "path": short_text(chosen.get("path"))}
                           if chosen else None},
            "resource_snapshot": {host: {"metrics": obj(obj(snap).get("metrics"))}
                                  for host, snap in obj(r.get("resource_snapshot")).items()}}


def report_view(r: dict) -> dict:
    return {"id": r["id"], "action": r["action"], "command_id": r["command_id"], "step": int64(r.get("step")),
            "ts": r["ts"]}

"""Diagnosis reports on disk: one JSON document and one readable text file per report.

``<dir>/<run_id>/<report id>.json`` and ``.txt``; the control command names the report id,
so whoever looks at a rollback or a stop finds why in one place.
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import orjson

from trainguard.sinks.base import Sink


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return str(v)


def render_text(report: dict) -> str:
    """The readable form of a diagnosis report."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(report["ts"]))
    inc = report.get("incident", {})
    lines = [
        f"trainguard diagnosis report {report['id']}",
        f"run {report['run_id']}  at step {report.get('step')}  {when}",
        f"decision: {report['action'].upper()} (command {report['command_id']})",
        "",
        f"what happened: {report.get('summary', '')}",
        f"incident: onset at step {inc.get('onset_step')}, rules {', '.join(inc.get('rules', []))}, "
        f"layers {', '.join(inc.get('layers', []))}",
        "",
        "alerts:",
    ]
    for a in report.get("alerts", []):
        ev = a.get("evidence", {})
        bounds = f" window [{_fmt(ev['lower'])}, {_fmt(ev['upper'])}] mean {_fmt(ev['mean'])}" if "lower" in ev else ""
        lines.append(f"  - {a.get('severity')} {a['rule']} at step {a.get('step')}: "
                     f"{a.get('metric')}={_fmt(a.get('value'))}{bounds}")
        if a.get("diagnosis"):
            lines.append(f"      {a['diagnosis']}")
        if a.get("suggestion"):
            lines.append(f"      suggestion: {a['suggestion']}")
    cp = report.get("checkpoint", {})
    chosen = cp.get("chosen")
    lines += ["", "checkpoint: " + (f"step {chosen['step']} ({chosen['path']})" if chosen else "none"),
              f"  why: {cp.get('why', '')}"]
    windows = report.get("windows", {})
    if windows:
        lines += ["", "metric windows before the decision (oldest first):"]
        for metric, w in windows.items():
            values = ", ".join(_fmt(v) for v in w["values"][-20:])
            lines.append(f"  {metric} [{w['source']}]: {values}")
    snapshot = report.get("resource_snapshot") or {}
    if snapshot:
        lines += ["", "resources (latest node metrics):"]
        for host, snap in snapshot.items():
            metrics = snap.get("metrics", {})
            keys = [k for k in metrics if k.startswith(("gpu/utilization_pct", "gpu/memory_used_gb", "system/"))][:12]
            lines.append(f"  {host}: " + ", ".join(f"{k}={_fmt(metrics[k])}" for k in keys))
    history = report.get("history", {})
    if history:
        lines += ["", f"history: {history.get('rollbacks', 0)} rollback(s) so far, "
                      f"{history.get('rollbacks_last_hour', 0)} in the last hour"]
    return "\n".join(lines) + "\n"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:200] or "_"


class ReportSink(Sink):
    name = "reports"

    def __init__(self, directory: str | Path):
        super().__init__()
        self.directory = Path(directory)

    def path_for(self, report: dict) -> Path:
        return self.directory / _safe(report["run_id"]) / f"{_safe(report['id'])}.json"

    def write(self, batch: list[dict]) -> None:
        for report in batch:
            if report.get("schema") != "report/1":
                continue
            path = self.path_for(report)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
            path.with_suffix(".txt").write_text(render_text(report), encoding="utf-8")

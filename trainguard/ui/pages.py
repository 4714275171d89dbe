"""The pages, rendered from a copy of what the board keeps (:meth:`Board.snapshot`), never
under its lock: the runs, a run's page, a report's page. Every value is escaped for where it
is written (text, attribute, link); no page runs script."""

from __future__ import annotations

import time
import urllib.parse

from trainguard.sinks.reports import PLOT_CSS, implicated, int64
from trainguard.sinks.reports import attr as _attr
from trainguard.sinks.reports import render_html as render_report
from trainguard.sinks.reports import shown as _shown
from trainguard.ui.plots import kept_stride, signal_plots, steps_extent, zoom_href
from trainguard.ui.reader import Board
from trainguard.ui.views import report_for_page, utc_time

REFRESH_S = 5


_STYLE = ("body{font:14px/1.4 sans-serif;margin:1.5em;max-width:64em}table{border-collapse:collapse}"
          "td,th{padding:2px 8px;border-bottom:1px solid #eee;text-align:left}figure{margin:.5em 0}"
          ".firing{color:#d62728}.resolved{color:#2ca02c}.state{font-size:16px}.meta{color:#666}"
          ".when{white-space:nowrap}" + PLOT_CSS)


def html_page(title: str, body: str, *, refresh: bool = True) -> str:
    meta = f'<meta http-equiv="refresh" content="{REFRESH_S}">' if refresh else ""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">{meta}<title>{_attr(title)}</title>'
            f'<style>{_STYLE}</style></head><body>{body}</body></html>\n')


def _run_path(run_id: str, *rest: str) -> str:
    """The path of a run's page (or below it): every part percent-encoded, so it is a path, never
    a ``javascript:`` URL nor anything that leaves an attribute."""
    return "/" + "/".join(urllib.parse.quote(p, safe="") for p in ("run", run_id, *rest))


def _run_href(run_id: str, *rest: str) -> str:
    return _attr(_run_path(run_id, *rest))


def _skipped_note(board: Board) -> str:
    skipped, causes = board.skipped()
    if not skipped:
        return ""
    top = ", ".join(f"{c}: {n}" for c, n in sorted(causes.items(), key=lambda kv: -kv[1])[:5])
    return (f'<p class="meta skipped" data-skipped="{skipped}">{skipped} record(s) skipped as invalid for '
            f'their topic ({_attr(top)}); the worker dead-letters what it reads</p>')


_INDEX_COLUMNS = ("run", "trainer processes", "last step", "last event (UTC)", "state", "rollbacks",
                  "healthy checkpoint", "open alerts")
_INDEX_CLASSES = ("run", "attempts", "step", "when", "state", "rollbacks", "checkpoint", "alerts")


def render_index(board: Board, now: float | None = None) -> str:
    """The runs a worker reports on, as ``trainguard runs`` lists them (the status topic, a
    summary past its retention left out), in its words for their state. A run id only heard of
    on the events topic makes no run: its records may be ones the worker refused."""
    now = time.time() if now is None else now
    rows, unconfirmed = [], 0
    for r in board.runs():
        status = r["status"]
        if status is None or (status.get("retained_until") or now) < now:
            unconfirmed += status is None
            continue
        attempts = f'{r["attempts"]} attempts' if r["attempts"] > 1 else r["attempts"] or None
        cells = (f'<a href="{_run_href(r["run_id"])}">{_attr(r["run_id"])}</a>', _attr(attempts),
                 _attr(status.get("last_step")), _attr(utc_time(status.get("last_event_ts"))),
                 _attr(status.get("state")),
                 _attr(status["breaker"]["rollbacks"]), _attr(status.get("last_healthy_checkpoint_step")),
                 _attr(status.get("open_alerts", 0)))
        rows.append('<tr class="run">' + "".join(f'<td class="{css}">{c}</td>' for css, c in zip(
            _INDEX_CLASSES, cells, strict=True)) + "</tr>")
    header = "<tr>" + "".join(f"<th>{name}</th>" for name in _INDEX_COLUMNS) + "</tr>"
    table = f"<table>{header}{''.join(rows)}</table>" if rows else "<p>no runs yet: no worker has reported one</p>"
    pending = (f'<p class="meta unconfirmed">{unconfirmed} more run id(s) on the events topic that no worker '
               f'reports on: records it refused, or no worker running yet</p>') if unconfirmed else ""
    return html_page("trainguard: runs", f"<h1>trainguard: runs</h1>{table}{pending}"
                                     f'<p class="meta">{board.records} records read</p>{_skipped_note(board)}')


def _zoom_bar(run_id: str, extent: tuple[int, int], shown: tuple[int, int], stride: int) -> str:
    a, b = shown
    span = max(b - a, 2)
    links = [(_run_href(run_id), "whole run"), (zoom_href(a + span // 4, b - span // 4), "zoom in"),
             (zoom_href(max(extent[0], a - span // 2), min(extent[1], b + span // 2)), "zoom out"),
             (zoom_href(a - span // 2, b - span // 2), "◀ earlier"),
             (zoom_href(a + span // 2, b + span // 2), "later ▶")]
    return (f'<p class="zoom" data-from="{a}" data-to="{b}">steps <b>{a}</b> to <b>{b}</b> of {extent[0]} to '
            f'{extent[1]}: ' + " · ".join(f'<a href="{href}">{text}</a>' for href, text in links)
            + ' (click a plot to zoom in there; hover for the value)</p>'
            + (f'<p class="meta stride">a long run: this page keeps one value per {stride} logged, and every NaN '
               f'and every rollback\'s restored step</p>' if stride > 1 else ""))


def _alerts_by_id(view: dict, status: dict) -> list[dict]:
    """One entry per alert id, oldest first: its firing record's facts and its state now."""
    acked = status.get("acknowledged") or {}
    by_id: dict[str, dict] = {}
    for a in view["alerts"]:  # oldest first
        entry = by_id.setdefault(a["id"], {**a, "fired": a["ts"], "resolved_ts": None})
        if a["status"] == "resolved":
            entry["resolved_ts"] = a["ts"]
            entry["state"] = "resolved"
        else:
            entry.update({k: a[k] for k in ("step", "value", "metric", "metrics", "severity", "rule", "forecast")})
            entry["fired"] = a["ts"]
        entry.setdefault("state", "firing")
        entry["silenced"] = entry["silenced"] or a["silenced"]
    for entry in by_id.values():
        entry["ack"] = acked.get(entry["id"], "")
        flags = ", ".join(f for f in ("silenced" if entry["silenced"] else "", entry["ack"]) if f)
        entry["note"] = (f'{entry["severity"]} {entry["rule"]} {entry["state"]}{", " + flags if flags else ""}: '
                         f'alert {entry["id"]} at step {_shown(entry["step"])}, {entry["metric"]} = '
                         f'{_shown(entry["value"])}')
    return list(by_id.values())


def render_run(board: Board, run_id: str, view: dict | None = None, *, x_range: tuple[int, int] | None = None) -> str:
    """The run's page, from ``view`` (a :meth:`Board.snapshot`; taken here when not given),
    its plots over the steps ``x_range`` (the whole run by default)."""
    view = board.snapshot(run_id) if view is None else view
    if view is None:
        view = {"run_id": run_id, "status": None, "alerts": [], "commands": [], "reports": [], "series": {}}
    esc = _attr
    status = view["status"] or {}
    breaker = status.get("breaker") or {}
    alerts = _alerts_by_id(view, status)
    decisions = [(c["step"], f'{c["action"]} (command {c["id"]}) at step {c["step"]}: '
                             f'{(c["ack"] or {}).get("status", "no ack yet")}')
                 for c in view["commands"] if int64(c["step"]) is not None]
    outcome = status.get("outcome") if status.get("outcome") in ("finished", "stopped") else None
    ended = f", {esc(outcome or 'finished')}" if status.get("finished") or outcome else ""
    said = status.get("state") or "no status from a worker yet"  # as `trainguard status` says it
    said = "" if said == breaker.get("status") else f'<b class="run-state">{esc(said)}</b>; '
    state = (f'<p class="state">{said}'
             f'breaker <b class="breaker">{esc(breaker.get("status", "unknown"))}</b>, '
             f'{esc(breaker.get("rollbacks", 0))} rollback(s); last step {esc(status.get("last_step"))}'
             f'{ended}; newest healthy checkpoint '
             f'{esc(status.get("last_healthy_checkpoint_step") or "none")}</p>')
    if status.get("state_freed"):
        kept = status.get("retained_until")
        until = time.strftime("%Y-%m-%d %H:%M", time.localtime(kept)) if kept and 0 < kept < 1e11 else "?"
        state += (f'<p class="outcome">the run ended: <b class="outcome">{esc(status.get("outcome") or "?")}</b>; '
                  f'its detection state was freed, this summary is kept until {esc(until)}</p>')
    if status.get("command"):
        state += f'<p class="command">the breaker\'s last command: {esc(status["command"])}</p>'
    suspect = status.get("suspect_checkpoints") or []
    if suspect:
        state += ('<p class="suspect">suspect checkpoints (never a rollback target): ' + "; ".join(
            f'step {esc(c["step"])}: {esc(c["why"])}' for c in suspect) + "</p>")
    unwatched = status.get("unwatched_metrics") or []
    if unwatched:
        more = f" (+{status['unwatched_more']} more)" if status.get("unwatched_more") else ""
        state += (f'<p class="unwatched">logged but judged by no rule: {esc(", ".join(unwatched))}{more} (add a '
                  f'rule, or map the name to a signal: docs/rules.md)</p>')
    silences = status.get("silences") or []
    if silences:
        state += ('<p class="silences">silences in force: ' + "; ".join(
            f'{esc(s["id"])} ({esc(s["rule"])}, until {esc(s["until"])} UTC)' for s in silences) + "</p>")
    attempts = view.get("attempts") or []
    state += _attempts_note(attempts, view.get("trainer_hosts") or [])
    starts = [(a["step"], f'attempt {i + 1}: a new trainer process{" on " + a["host"] if a["host"] else ""} '
                          f'started at step {a["step"]}') for i, a in enumerate(attempts)
              if i and int64(a["step"]) is not None]
    extent = steps_extent(view)
    shown_range = x_range or extent
    plots = signal_plots(view, board.rules, alerts, decisions, shown_range, starts)

    def attempt_cell(alert: dict) -> str:
        if len(attempts) < 2:
            return ""
        fired = alert["fired"] if type(alert["fired"]) in (int, float) else 0.0
        return f'<td class="attempt">{sum(a["ts"] <= fired for a in attempts) or "?"}</td>'

    alert_rows = "".join(
        f'<tr class="alert {esc(a["state"])}" data-step="{esc(a["step"])}" data-alert="{esc(a["id"])}">'
        f'<td>{esc(a["id"])}</td>{attempt_cell(a)}<td class="when">{esc(utc_time(a["fired"]))}</td>'
        f'<td>{esc(a["step"])}</td>'
        f'<td>{esc(a["severity"])}</td><td>{esc(a["rule"])}</td><td>{esc(a["metric"])}</td><td>{esc(a["value"])}{_forecast(a)}</td>'
        f'<td>{esc(a["state"])}{esc(" " + utc_time(a["resolved_ts"])) if a["resolved_ts"] else ""}</td>'
        f'<td>{"silenced" if a["silenced"] else ""}{" " if a["silenced"] and a["ack"] else ""}{esc(a["ack"])}</td>'
        f'<td>{_alert_zoom(a["step"])}</td></tr>' for a in alerts)
    timeline = sorted([(c["issued"], "command", c) for c in view["commands"]]
                      + [(c["ack"]["ts"], "ack", c) for c in view["commands"] if c["ack"]],
                      key=lambda row: row[0] if type(row[0]) in (int, float) else 0.0)
    command_rows = "".join(
        f'<tr class="{kind}"><td class="when">{esc(utc_time(ts))}</td><td>{esc(c["step"])}</td><td>{kind}</td>'
        f'<td>{esc(c["action"]) if kind == "command" else esc(c["ack"]["status"])}</td><td>{esc(c["id"])}</td>'
        f'<td>{esc(c["detail"] if kind == "command" else c["ack"]["detail"])}</td></tr>'
        for ts, kind, c in timeline)
    report_links = "".join(
        f'<li><a class="report" href="{_run_href(run_id, "report", r["id"])}">{esc(r["action"])} at step '
        f'{esc(r["step"])}</a></li>' for r in view["reports"])
    body = (f'<p><a href="/">all runs</a></p><h1>run {esc(run_id)}</h1>{state}'
            f'<h2>signals</h2>{_zoom_bar(run_id, extent, shown_range, kept_stride(view)) if plots else ""}'
            f'<section class="plots">{"".join(plots) or "<p>no watched signal yet</p>"}</section>'
            f'<h2>alerts</h2><table><tr><th>id</th>{"<th>attempt</th>" if len(attempts) > 1 else ""}'
            f'<th>fired (UTC)</th><th>step</th><th>severity</th><th>rule</th>'
            f'<th>metric</th><th>value</th><th>state</th><th>silence / ack</th><th>zoom</th></tr>{alert_rows}</table>'
            f'<h2>commands and acks</h2><table><tr><th>time (UTC)</th><th>step</th><th>record</th><th>action / ack</th>'
            f'<th>command</th><th>detail</th></tr>{command_rows}</table>'
            f'<h2>diagnosis reports</h2><ul>{report_links or "<li>none</li>"}</ul>{_skipped_note(board)}')
    return html_page(f"trainguard: run {run_id}", body)


def _attempts_note(attempts: list[dict], trainer_hosts: list[str]) -> str:
    """Says that one run id holds several trainer processes, each an attempt of the run, where
    each began, and the hosts whose trainers share the plots."""
    out = ""
    if len(attempts) > 1:
        out += (f'<p class="attempts">{len(attempts)} trainer processes logged this run, its attempts one after '
                f'another on these plots (a purple line where each began): ' + "; ".join(
                    f'attempt {i + 1} started {_attr(utc_time(a["ts"]))} UTC'
                    f'{" at step " + _attr(a["step"]) if a["step"] is not None else ""}'
                    f'{" on " + _attr(a["host"]) if a["host"] else ""}'
                    for i, a in enumerate(attempts)) + "</p>")
    if len(trainer_hosts) > 1:
        out += (f'<p class="trainers">the trainers of {len(trainer_hosts)} hosts logged this run id, their values '
                f'on the same plots: {_attr(", ".join(trainer_hosts))}</p>')
    return out


def _forecast(alert: dict) -> str:
    """A forecast's ETA under its value (the alert's evidence, as the reader kept it)."""
    return f'<br><span class="forecast">{_attr(alert["forecast"])}</span>' if alert.get("forecast") else ""


def _alert_zoom(step) -> str:
    if int64(step) is None:
        return ""
    return f'<a class="zoom-to" href="{zoom_href(step - 50, step + 50)}">zoom to it</a>'


def render_report_page(board: Board, run_id: str, report_id: str) -> str | None:
    """The diagnosis report's page (the reports sink's), or None for a report the board lacks:
    its signals plotted from what the board keeps of them, linked to the run's page."""
    report = board.report(run_id, report_id)
    if report is None:
        return None
    page = report_for_page(report)
    view = board.snapshot(run_id) or {}
    # the report keeps each alert's own metric; the board knows every signal it named
    named = {a["id"]: a["metrics"] for a in view.get("alerts", []) if a["status"] == "firing"}
    for alert in page["alerts"]:
        listed = alert.get("metrics") if isinstance(alert.get("metrics"), list) else []
        alert["metrics"] = [*listed, *(named.get(alert["id"], []) if isinstance(alert.get("id"), str) else [])]
    kept = view.get("series", {})
    series = {}
    for metric in implicated(page):
        name = next((n for n in kept if n == metric or n.startswith(metric + " @")), None)
        if name is not None:
            s = kept[name]
            series[metric] = (s["steps"], s["values"], s["restarts"], s["restarted_at"])
    return render_report(page, run_href=_run_path(run_id), series=series, step=int64(report.get("step")))

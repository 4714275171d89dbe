"""The reports sink: each diagnosis report written as three files, ``<dir>/<run_id>/<report
id>.json``, ``.txt`` and ``.html`` (``sinks/reports.py`` renders them)."""

from __future__ import annotations

import logging
from pathlib import Path

import orjson

from trainguard.core import settings as settings_mod
from trainguard.sinks.base import Sink, safe_segment
from trainguard.sinks.reports import page_url, render_html, render_text

log = logging.getLogger("trainguard.sinks")


class ReportSink(Sink):
    """Writes each report's three files; ``ui_url`` (default ``TRAINGUARD_UI_URL``): where
    ``trainguard ui`` is served, so that the page links the run's page."""

    name = "reports"
    settings = ("TRAINGUARD_REPORTS_DIR", "TRAINGUARD_UI_URL")

    @classmethod
    def from_env(cls, env) -> "ReportSink | None":
        """A sink writing under ``TRAINGUARD_REPORTS_DIR``; None where it is not set."""
        directory = settings_mod.value("TRAINGUARD_REPORTS_DIR", env)
        return cls(directory, ui_url=settings_mod.value("TRAINGUARD_UI_URL", env) or "") if directory else None

    def __init__(self, directory: str | Path, ui_url: str | None = None):
        super().__init__()
        self.directory = Path(directory)
        self.ui_url = (ui_url if ui_url is not None else settings_mod.value("TRAINGUARD_UI_URL") or "").rstrip("/")

    def path_for(self, report: dict) -> Path:
        return self.directory / safe_segment(report["run_id"]) / f"{safe_segment(report['id'])}.json"

    def deliver(self, batch: list[dict]) -> None:
        """Each report on its own: one that cannot be written (a topic's writer chose its
        fields) is logged with why and skipped, and the others in its batch are written."""
        for report in batch or []:
            try:
                self.write([report])
            except Exception as exc:
                self.failed += 1
                what = report if not isinstance(report, dict) else report.get("id")
                run = report.get("run_id") if isinstance(report, dict) else None
                log.error("trainguard: sink reports skipped report %.200r of run %.200r: %s: %.300s",
                          what, run, type(exc).__name__, exc)
            else:
                self.written += 1

    def write(self, batch: list[dict]) -> None:
        for report in batch:
            if not isinstance(report, dict) or report.get("schema") != "report/1":
                continue
            path = self.path_for(report)
            # all three made before any is written: a report that cannot be read leaves no file
            document = orjson.dumps(report, option=orjson.OPT_INDENT_2)
            text = render_text(report)
            run_href = page_url(self.ui_url, report["run_id"]) or None
            page = render_html(report, run_href=run_href)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(document)
            path.with_suffix(".txt").write_text(text, encoding="utf-8")
            path.with_suffix(".html").write_text(page, encoding="utf-8")

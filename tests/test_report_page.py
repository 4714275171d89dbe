"""The diagnosis report as a page, in a real headless browser (Debian's chromium): a report
the engine made from a simulated run's fault is written by the reports sink, rendered, and
checked in the rendered DOM; screenshots are saved under out/screenshots (paths printed at the
end of the test run)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import SCREENSHOTS
from tests.integration import browser
from tests.test_engine import run_sim
from trainguard.sinks.reports import ReportSink
from trainguard.streams import rules as rules_mod
from trainguard.streams.engine import Engine

ROOT = Path(__file__).resolve().parents[1]
def _report_page(fault: str, tmp_path: Path) -> Path:
    """The HTML report of the engine's first decision on a simulated run with ``fault``."""
    outputs = run_sim(Engine(rules_mod.default()), fault, obey=False, steps=120)
    reports = [o.value for _, o in outputs if o.kind == "report"]
    assert reports, f"the {fault} fault made no decision"
    sink = ReportSink(tmp_path / "reports")
    sink.write(reports[:1])
    page = sink.path_for(reports[0]).with_suffix(".html")
    assert page.is_file()
    return page


@pytest.mark.parametrize("fault", ["kl_explosion", "nan_loss"])
def test_the_report_page_plots_the_implicated_signals_up_to_the_decision(fault, tmp_path):
    page = _report_page(fault, tmp_path)
    dom = browser("--dump-dom", page.as_uri())
    plots = re.findall(r'<svg[^>]*class="plot"[^>]*data-metric="([^"]+)"', dom)
    assert plots, "a plot per metric window"
    assert dom.count('class="series"') >= 1, "each plot draws the values"
    assert "decision: <b>ROLLBACK</b>" in dom or "decision: <b>STOP</b>" in dom
    if fault == "nan_loss":
        assert 'class="nonfinite"' in dom, "a NaN is marked, not dropped"
    else:
        assert 'class="decision"' in dom, "the value at the decision is marked"

    shot = ROOT / "out" / "screenshots" / f"report-{fault}.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    shot.unlink(missing_ok=True)
    browser(f"--screenshot={shot}", "--window-size=1000,1400", page.as_uri())
    assert shot.is_file() and shot.stat().st_size > 10_000, "a rendered page, not a blank one"
    SCREENSHOTS.append(shot)

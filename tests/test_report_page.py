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
from trainguard.sinks.reports import ReportSink, implicated
from trainguard.streams import rules as rules_mod
from trainguard.streams.engine import Engine

ROOT = Path(__file__).resolve().parents[1]
UI_URL = "http://trainguard.internal:8321"


def _report_page(fault: str, tmp_path: Path) -> tuple[Path, dict]:
    """The HTML report of the engine's first decision on a simulated run with ``fault``."""
    outputs = run_sim(Engine(rules_mod.default()), fault, obey=False, steps=120)
    reports = [o.value for _, o in outputs if o.kind == "report"]
    assert reports, f"the {fault} fault made no decision"
    sink = ReportSink(tmp_path / "reports", ui_url=UI_URL)
    sink.write(reports[:1])
    page = sink.path_for(reports[0]).with_suffix(".html")
    assert page.is_file()
    return page, reports[0]


@pytest.mark.parametrize("fault", ["kl_explosion", "nan_loss"])
def test_the_report_page_plots_the_implicated_signals_up_to_the_decision(fault, tmp_path):
    page, report = _report_page(fault, tmp_path)
    dom = browser("--dump-dom", page.as_uri())
    plots = re.findall(r'<svg[^>]*class="plot"[^>]*data-metric="([^"]+)"', dom)
    assert plots, "a plot per metric window"
    missing = re.findall(r'<p class="missing">([^:<]+):', dom)
    assert sorted(plots + missing) == sorted(implicated(report)) and len(plots) >= len(report["windows"]), \
        "every implicated signal: plotted, or said to have no values"
    for svg in re.findall(r'<svg[^>]*class="plot".*?</svg>', dom, re.S):
        x0, x1 = (float(v) for v in re.search(r'data-x0="([^"]+)" data-x1="([^"]+)"', svg).groups())
        assert x0 < report["step"] <= x1 and x0 > 0, f"the step axis around the decision at {report['step']}"
        assert len(re.findall(r'class="tick x"', svg)) >= 3, "ticks on the step axis"
        assert f'class="marker command" data-step="{report["step"]}"' in svg, "the decision at its step"
    assert f'class="run" href="{UI_URL}/run/{report["run_id"]}"' in dom, "a link back to the run's page"
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


def test_a_reports_window_is_drawn_at_the_steps_it_covers():
    """The report takes each window when it is made (its step), not at the alert's step: a
    stranger saw values of steps 53-82 drawn from step 50 and an alert's value 3 steps early."""
    from trainguard.sinks.reports import _window_series

    window = {"values": [0.1] * 27 + [2.563, 2.6, 2.7]}  # steps 53..82; the alert's value at 80
    steps, values = _window_series(window, {"step": 80, "value": 2.563}, 82)
    assert (steps[0], steps[-1], len(values)) == (53, 82, 30) and steps[values.index(2.563)] == 80
    nan_now = _window_series({"values": [0.1] * 30}, {"step": 82, "value": float("nan")}, 82)
    assert nan_now[0][-2:] == [81, 82] and nan_now[1][-1] != nan_now[1][-1]  # the NaN drawn at its own step

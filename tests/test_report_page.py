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
from trainguard.sinks.report_files import ReportSink
from trainguard.sinks.reports import implicated
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


def _report(run_id="r", rid="rep", alerts=(), **more) -> dict:
    return {"schema": "report/1", "id": rid, "run_id": run_id, "action": "rollback", "command_id": "c1",
            "ts": 1.7e9, "summary": "s", "incident": {"onset_step": 1, "rules": ["a"], "layers": ["x"]},
            "checkpoint": {"chosen": None, "why": "w"}, "alerts": list(alerts), **more}


@pytest.mark.parametrize("run_id", ["..", ".", "../../x", "/tmp/x", "a/../../b", "\x00", "." * 300])
def test_a_hostile_run_id_writes_its_report_inside_the_reports_folder(run_id, tmp_path):
    folder = tmp_path / "reports"
    sink = ReportSink(folder)
    sink.deliver([_report(run_id, "rep")])
    assert sink.failed == 0
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(written) == 3 and all(p.parent.parent == folder for p in written), written


def test_run_ids_that_differ_never_share_a_folder_and_plain_ones_keep_their_name(tmp_path):
    from trainguard.sinks.base import safe_segment

    ids = ["grpo-qwen-7b", "a/b", "a_b", "a:b", "..", "__", "_.", ".x", "_x", "x" * 200, "x" * 201]
    segments = [safe_segment(i) for i in ids]
    assert len(set(segments)) == len(ids), segments
    assert segments[0] == "grpo-qwen-7b" and segments[2] == "a_b" and segments[1].startswith("a_b~")
    assert all(len(s) <= 120 and "/" not in s and not s.startswith(".") for s in segments)


HOSTILE_ALERTS = [["x"], [{"rule": "r", "evidence": {"lower": 1}}], [{"rule": "r", "evidence": [1]}], [{}],
                  [{"rule": "r", "evidence": {"detector": "forecast", "eta_points": 5, "threshold": 1.0,
                                              "eta_s": 1e308}}], [{"rule": {"a": 1}, "severity": ["P0"]}]]


@pytest.mark.parametrize("alerts", HOSTILE_ALERTS)
def test_a_hostile_report_is_skipped_alone_and_the_good_ones_of_its_batch_are_written(alerts, tmp_path):
    sink = ReportSink(tmp_path)
    sink.deliver([_report("bad", "b1", alerts), _report("good", "g1", [{"rule": "kl_spike", "step": 3}])])
    assert "kl_spike at step 3" in (tmp_path / "good" / "g1.txt").read_text()
    assert sink.written + sink.failed == 2 and sink.written >= 1


def test_a_report_that_cannot_be_written_is_logged_and_skipped(tmp_path, caplog, monkeypatch):
    from trainguard.sinks import report_files

    real = report_files.render_html
    monkeypatch.setattr(report_files, "render_html", lambda r, **kw: 1 / 0 if r["id"] == "b1" else real(r, **kw))
    sink = ReportSink(tmp_path)
    sink.deliver([_report("r", "b1"), _report("r", "g1")])
    assert (sink.written, sink.failed) == (1, 1)
    assert "b1" in caplog.text and "ZeroDivisionError" in caplog.text
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["g1.html", "g1.json", "g1.txt"]


def test_the_text_of_a_report_reads_missing_and_mistyped_parts_as_absent():
    from trainguard.sinks.reports import render_text

    text = render_text(_report(alerts=["x", {"evidence": {"lower": 1, "upper": 2}}, {"rule": "r", "evidence": "e"}],
                               incident={"rules": "ab", "layers": [1]}, checkpoint={"chosen": "yes"},
                               windows={"loss": "v", "kl": {"values": "12"}}, resource_snapshot={"h": 1},
                               history=[1], summary="line\n\x1b[2Jforged"))
    assert "window [1, 2]" in text and "  - - r at step -: -=None" in text and "checkpoint: yes" in text
    assert "\x1b" not in text and "line forged" in text
    render_text({"id": "x", "ts": "late", "incident": None, "checkpoint": None, "alerts": None})

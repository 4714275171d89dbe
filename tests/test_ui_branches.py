"""The run page after a rollback: a series holds two branches over the same steps, the one the
run abandoned (a KL and gradient-norm explosion) and the one it restored. Every alert is drawn
on the branch it fired on, each branch's baseline band comes from its own values, the report
plots every signal its alerts name, and the runs list says what `trainguard runs` says. Built
from the real engine's records in memory (no broker); the page is checked as Debian's chromium
renders it."""

from __future__ import annotations

import math
import re
import time

import numpy as np
import orjson
import pytest

from tests.integration import browser
from trainguard.core.kafka import Topics
from trainguard.schemas import events as ev
from trainguard.sinks.reports import implicated, render_html
from trainguard.streams import rules as rules_mod
from trainguard.streams.engine import Engine
from trainguard.ui import Board, render_index, render_report_page, render_run, rolling_band
from trainguard.ui.plots import branch_band

T0 = 1.7e9
RUN = "branches-1"
SPIKE_FROM = 101
TRAINER = ev.source("trainer", "gpu-a", 0)
_TOP, _BOTTOM = 22, 190  # the plot frame's top and bottom (sinks/reports.py)


class _Feed:
    """The real engine judging a run, its records read by a board as the run page reads them."""

    def __init__(self):
        self.engine = Engine(rules_mod.default())
        self.topics = Topics()
        self.board = Board(rules_mod.default(), self.topics)
        self.offset = 0

    def send(self, event: dict) -> list:
        self.offset += 1
        self.board.take(self.topics.events, event["run_id"].encode(), ev.encode(event))
        outputs = self.engine.handle(ev.encode(event), 0, self.offset)
        for out in outputs:
            topic = {"alert": self.topics.alerts, "report": self.topics.alerts,
                     "command": self.topics.control}.get(out.kind)
            if topic is not None:
                self.board.take(topic, out.key.encode() if isinstance(out.key, str) else out.key,
                                orjson.dumps(out.value))
        return outputs

    def status(self, run_id: str) -> None:
        self.board.take(self.topics.status, run_id.encode(), orjson.dumps(self.engine.status(run_id)))


def _metrics(step: int, exploding: bool, restored: bool) -> dict:
    wobble = 0.01 * (step % 5)
    loss = -200.0 if exploding else 30.0 if restored and step == 150 else 0.2 + wobble
    return {"actor/kl_loss": 1.57 if exploding else 0.1 + wobble,
            "actor/grad_norm": 370.0 + step if exploding else 1.0 + wobble, "actor/pg_loss": loss}


def _rolled_back_run() -> tuple[_Feed, int, float]:
    """Healthy steps with a checkpoint every 10, KL, gradient norm and loss exploding from step
    101; the breaker's rollback obeyed (the trainer back at the checkpoint, logging its steps
    again), then a healthy branch to step 200 with one loss spike at 150. The restored step and
    when the trainer said it rolled back."""
    feed = _Feed()
    feed.send(ev.lifecycle_event(RUN, "started", step=1, src=TRAINER, ts=T0))
    step, clock, restored, rolled_at = 0, 0, None, 0.0
    while step < 200:
        step, clock = step + 1, clock + 1
        outputs = feed.send(ev.metrics_event(RUN, step, _metrics(step, restored is None and step >= SPIKE_FROM,
                                                                 restored is not None), src=TRAINER, ts=T0 + clock))
        if step % 10 == 0 and restored is None:
            feed.send(ev.checkpoint_event(RUN, step, f"/ckpt/{step}", ts=T0 + clock, src=TRAINER))
        command = next((o.value for o in outputs if o.kind == "command" and o.value["action"] == "rollback"), None)
        if command is not None and restored is None:
            restored = command["target"]["step"]
            clock += 1
            rolled_at = T0 + clock
            feed.send(ev.lifecycle_event(RUN, "rolled_back", step=restored, src=TRAINER, ts=T0 + clock))
            ack = ev.encode(ev.ack_event(command["id"], RUN, "applied", step=restored, ts=T0 + clock))
            feed.engine.handle_ack(ack)
            feed.board.take(feed.topics.acks, RUN.encode(), ack)
            step = restored - 1  # it logs the restored step again
    feed.status(RUN)
    assert restored is not None and restored < SPIKE_FROM, "the breaker rolled back to before the explosion"
    return feed, restored, rolled_at


@pytest.fixture(scope="module")
def rolled_back():
    return _rolled_back_run()


# ------------------------------------------------------------------ reading the rendered SVG


def _plots(dom: str) -> dict[str, str]:
    return {m.group(1): m.group(0)
            for m in re.finditer(r'<svg[^>]*class="plot" data-metric="([^"]+)".*?</svg>', dom, re.S)}


def _num(svg: str, name: str) -> float:
    return float(re.search(rf'{name}="([^"]+)"', svg).group(1))


def _lines_by_segment(svg: str) -> dict[int, list[np.ndarray]]:
    """Each segment's drawn polylines (its live and its replaced part) in pixels."""
    out: dict[int, list[np.ndarray]] = {}
    for m in re.finditer(r'<polyline class="series[^"]*" data-segment="(\d+)" points="([^"]+)"', svg):
        nums = np.array(m.group(2).split(), float) / 10  # drawn in tenths of a pixel
        out.setdefault(int(m.group(1)), []).append(nums.reshape(-1, 2))
    return out


def _distance_to(lines: list[np.ndarray], x: float, y: float) -> float:
    """The shortest distance from (x, y) to any of the polylines, in pixels."""
    best = math.inf
    for pts in lines:
        a, b = pts[:-1], pts[1:]
        ab = b - a
        t = np.clip(((x - a[:, 0]) * ab[:, 0] + (y - a[:, 1]) * ab[:, 1]) / np.maximum((ab ** 2).sum(1), 1e-12), 0, 1)
        near = a + t[:, None] * ab
        best = min(best, float(np.hypot(near[:, 0] - x, near[:, 1] - y).min()))
    return best


def _y_of(svg: str, value: float) -> float:
    """Where ``value`` is drawn on the plot's y axis (its range and scale as the SVG says)."""
    lo, hi = _num(svg, "data-y0"), _num(svg, "data-y1")
    if 'data-scale="log"' in svg:
        lo, hi, value = math.log10(lo), math.log10(hi), math.log10(value)
    return _BOTTOM - (value - lo) / (hi - lo) * (_BOTTOM - _TOP)


def _markers(svg: str) -> list[dict]:
    return [{"step": int(m.group(1)), "id": m.group(2), "segment": int(m.group(3)), "x": float(m.group(4)),
             "y": float(m.group(5))}
            for m in re.finditer(r'<circle class="marker alert" data-step="(\d+)" data-alert="([^"]+)"[^>]*?'
                                 r'data-segment="(\d+)" cx="([^"]+)" cy="([^"]+)"', svg)]


# ------------------------------------------------------------------ the page in chromium


def test_after_a_rollback_every_marker_sits_on_the_line_of_the_branch_it_fired_on(rolled_back, tmp_path):
    feed, restored, rolled_at = rolled_back
    board = feed.board
    fired = {a["id"]: a for a in board.snapshot(RUN)["alerts"] if a["status"] == "firing"}
    assert {"kl_explosion", "grad_norm_explosion", "loss_spike"} <= {a["rule"] for a in fired.values()}

    checked = 0
    for name, x_range in (("whole", None), ("zoomed", (restored - 10, SPIKE_FROM + 20))):
        page = tmp_path / f"run-{name}.html"
        page.write_text(render_run(board, RUN, x_range=x_range), encoding="utf-8")
        dom = browser("--dump-dom", page.as_uri())
        plots = _plots(dom)
        assert {"actor/kl_loss", "actor/grad_norm", "actor/pg_loss"} <= set(plots)
        for metric, svg in plots.items():
            lines = _lines_by_segment(svg)
            assert set(lines) == {0, 1}, f"{metric}: the abandoned branch and the restored one"
            assert re.search(r'<polyline class="series replaced" data-segment="0" [^>]*stroke="#999"', svg), \
                f"{metric}: the replaced part of the old branch stays drawn, in grey"
            for marker in _markers(svg):
                alert = fired[marker["id"]]
                old_branch = alert["ts"] < rolled_at  # fired before the trainer went back
                assert marker["segment"] == (0 if old_branch else 1), (metric, alert["rule"], marker)
                on_own = _distance_to(lines[marker["segment"]], marker["x"], marker["y"])
                assert on_own <= 2.0, f"{metric}: {alert['rule']} {on_own:.1f} px off the line of its branch"
                if alert["metric"] == metric:  # its own value, where its branch has it
                    assert abs(marker["y"] - _y_of(svg, alert["value"])) <= 2.0, (metric, alert, marker)
                if old_branch and restored <= alert["step"]:  # the new branch has this step too: far from it
                    assert _distance_to(lines[1], marker["x"], marker["y"]) > 20, (metric, alert["rule"])
                checked += 1
    assert checked >= 8, f"only {checked} markers checked"

    shot = tmp_path / "run-page-after-rollback.png"
    zoomed = tmp_path / "run-zoomed.html"
    browser(f"--screenshot={shot}", "--window-size=1100,1300", zoomed.as_uri())
    assert shot.is_file() and shot.stat().st_size > 10_000, "a rendered page, not a blank one"
    print(f"\nscreenshot: {shot}")


def test_the_report_page_draws_its_alerts_on_the_branch_the_run_was_on(rolled_back):
    feed, _, _ = rolled_back
    report = feed.board.snapshot(RUN)["reports"][0]
    page = render_report_page(feed.board, RUN, report["id"])
    plots = _plots(page)
    assert {"actor/kl_loss", "actor/grad_norm"} <= set(plots), "every signal the decision names"
    for metric in ("actor/kl_loss", "actor/grad_norm"):
        svg = plots[metric]
        markers = _markers(svg)
        assert markers and all(m["segment"] == 0 for m in markers), "the report came before the rollback"
        for m in markers:
            assert _distance_to(_lines_by_segment(svg)[0], m["x"], m["y"]) <= 2.0


# ------------------------------------------------------------------ bands per branch


def test_each_branch_is_banded_from_its_own_values(rolled_back):
    feed, restored, _ = rolled_back
    loss = feed.board.snapshot(RUN)["series"]["actor/pg_loss"]
    steps, values = loss["steps"], loss["values"]
    base = feed.board.rules.baseline_for("actor/pg_loss")
    lo, hi = branch_band(steps, values, base.window, base.k)
    new = np.flatnonzero(np.arange(len(steps)) >= np.flatnonzero(np.diff(steps) <= 0)[0] + 1)
    restored_part = new[steps[new] < 150]  # before the new branch's own spike
    assert np.nanmin(lo[restored_part]) > -1 and np.nanmax(hi[restored_part]) < 1, \
        "the abandoned explosion is in no band of the restored branch"
    mixed_lo, _ = rolling_band(values, base.window, base.k)
    assert np.nanmin(mixed_lo[restored_part]) < -50, "(banded over both branches, it would be)"

    # exactly the band of the values the restored branch holds: the old ones before its step, then its own
    old = np.arange(len(steps)) < new[0]
    lineage = np.concatenate((values[old & (steps < restored)], values[new]))
    want_lo, want_hi = rolling_band(lineage, base.window, base.k)
    np.testing.assert_allclose(lo[new], want_lo[-len(new):], equal_nan=True)
    np.testing.assert_allclose(hi[new], want_hi[-len(new):], equal_nan=True)
    old_lo, _ = rolling_band(values[old], base.window, base.k)
    np.testing.assert_allclose(lo[old], old_lo, equal_nan=True)

    # as the page draws it: the restored branch's band, up to its own spike, hugs its line
    svg = _plots(render_run(feed.board, RUN, x_range=(restored, 149)))["actor/pg_loss"]
    band = re.search(r'<polygon class="band" data-segment="1" points="([^"]+)"', svg).group(1)
    ys = np.array(band.split(), float)[1::2] / 10
    assert ys.max() - ys.min() < 10, "a band a few pixels wide, not the frame's height"


def test_a_branch_restored_twice_and_a_hostile_series_stay_quick():
    steps = np.array([*range(1, 51), *range(30, 61), *range(20, 81)])
    values = np.where(np.arange(len(steps)) < 50, 1.0, 2.0)
    values[np.arange(len(steps)) >= 81] = 3.0
    lo, hi = branch_band(steps, values, window=5, k=2.0)
    third = np.flatnonzero(steps == 20)[-1]
    assert hi[third] == pytest.approx(1.0) and lo[third + 5] == pytest.approx(3.0), \
        "rolled back to step 20: only the first branch's values before it, then its own"

    hostile = np.tile([0, 1], 5000)  # every other step goes back
    started = time.perf_counter()
    branch_band(hostile, np.ones(len(hostile)), window=100, k=3.0)
    assert time.perf_counter() - started < 0.5


# ------------------------------------------------------------------ the report names every signal


def _incident_report() -> dict:
    members = [{"rule": "grad_norm_jump", "id": "a1", "metric": "actor/grad_norm", "value": 370.0, "step": 104,
                "layer": "data"},
               {"rule": "entropy_collapse", "id": "a2", "metric": "actor/entropy", "value": 0.01, "step": 106,
                "layer": "data"}]
    return {"schema": "report/1", "id": "rep-1", "run_id": "inc", "action": "rollback", "command_id": "c1",
            "ts": T0 + 106, "step": 106, "summary": "s",
            "incident": {"onset_step": 104, "rules": ["entropy_collapse_after_spike"], "layers": ["data"]},
            "checkpoint": {"chosen": None, "why": "w"}, "windows": {},
            "alerts": [{"id": "i1", "rule": "entropy_collapse_after_spike", "severity": "P1", "metric": "incident",
                        "value": 2, "step": 106, "evidence": {"detector": "incident", "members": members}},
                       {"id": "n1", "rule": "non_finite", "severity": "P0", "metric": "actor/pg_loss",
                        "value": "NaN", "step": 106, "metrics": ["actor/pg_loss", "critic/grad_norm"]}]}


def test_the_report_shows_every_signal_its_incident_and_alerts_name():
    report = _incident_report()
    assert implicated(report) == ["actor/grad_norm", "actor/entropy", "actor/pg_loss", "critic/grad_norm"], \
        "the incident's members and every metric an alert lists; 'incident' is no signal"
    page = render_html(report)
    named = re.findall(r'<p class="missing">([^:<]+):', page)
    assert sorted(named) == sorted(implicated(report)), "without values, each is still named"
    assert "alert value 370 at step 104" in page, "with what its alert saw"

    topics = Topics()
    board = Board(rules_mod.default(), topics)
    for step in range(90, 111):
        board.take(topics.events, b"inc", ev.encode(ev.metrics_event("inc", step, {
            "actor/grad_norm": 370.0 if step == 104 else 1.0, "actor/entropy": 0.01 if step >= 106 else 1.2,
            "actor/pg_loss": 0.3}, src=TRAINER, ts=T0 + step)))
    board.take(topics.alerts, b"inc", orjson.dumps(report))
    plots = _plots(render_report_page(board, "inc", "rep-1"))
    assert {"actor/grad_norm", "actor/entropy", "actor/pg_loss"} <= set(plots), "plotted from what the page keeps"
    assert 'data-step="104"' in plots["actor/grad_norm"] and 'data-step="106"' in plots["actor/entropy"]


def test_the_report_page_adds_the_signals_the_run_pages_alert_named():
    """A NaN in the loss and the gradient norm at once: one alert names both; the report keeps
    only its metric, the page the alert's every signal."""
    feed = _Feed()
    for step in range(1, 31):
        bad = step >= 25
        feed.send(ev.metrics_event("nan", step, {"actor/pg_loss": math.nan if bad else 0.3,
                                                 "actor/grad_norm": math.nan if bad else 1.0},
                                   src=TRAINER, ts=T0 + step))
        if step % 10 == 0:
            feed.send(ev.checkpoint_event("nan", step, f"/ckpt/{step}", ts=T0 + step, src=TRAINER))
    view = feed.board.snapshot("nan")
    report = feed.board.report("nan", view["reports"][0]["id"])
    assert implicated(report) == ["actor/pg_loss"], "(what the report alone names)"
    plots = _plots(render_report_page(feed.board, "nan", report["id"]))
    assert {"actor/pg_loss", "actor/grad_norm"} <= set(plots)
    assert 'class="nonfinite"' in plots["actor/grad_norm"]


# ------------------------------------------------------------------ the runs list


def _text(page: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page))


def test_the_runs_list_labels_every_column_and_says_what_trainguard_runs_says():
    from trainguard.operate import format_runs

    feed, _, _ = _rolled_back_run()
    # a run that finished: the breaker stays armed, the run is over
    for step in range(1, 6):
        feed.send(ev.metrics_event("done", step, {"actor/pg_loss": 0.3}, src=TRAINER, ts=T0 + step))
    feed.send(ev.lifecycle_event("done", "finished", step=5, src=TRAINER, ts=T0 + 6))
    feed.status("done")
    # a second trainer process under the first run's id
    feed.send(ev.lifecycle_event(RUN, "started", step=150, src=ev.source("trainer", "gpu-b", 0), ts=T0 + 400))
    # records no worker reports on (refused, say, as read from another run's partition)
    feed.board.take(feed.topics.events, b"ghost", ev.encode(ev.metrics_event("ghost", 1, {"actor/pg_loss": 0.3},
                                                                             src=TRAINER, ts=T0)))
    index = render_index(feed.board)
    headers = re.findall(r"<th>([^<]*)</th>", index)
    assert headers and all(h.strip() for h in headers), f"every column labelled: {headers}"
    rows = {m.group(1): m.group(0)
            for m in re.finditer(r'<tr class="run"><td class="run"><a href="/run/([^"]+)">.*?</tr>', index)}
    assert set(rows) == {RUN, "done"}, "a run id no worker reports on makes no run"
    assert "1 more run id(s) on the events topic that no worker reports on" in _text(index)

    statuses = {r: feed.engine.status(r) for r in ("done", RUN)}
    cli = {line.split()[0]: line for line in format_runs(statuses).splitlines()[1:]}
    for run in ("done", RUN):
        state = re.search(r'<td class="state">([^<]*)</td>', rows[run]).group(1)
        assert state in cli[run], f"{run}: the state `trainguard runs` says ({cli[run]!r}), not {state!r}"
    assert '<td class="state">finished</td>' in rows["done"]
    assert "2 attempts" in rows[RUN], "two trainer processes under one run id"

    page = _text(render_run(feed.board, RUN))
    assert "2 trainer processes logged this run, its attempts one after another" in page
    assert "attempt 2 started" in page and "on gpu-b" in page
    assert 'class="marker attempt" data-step="150"' in render_run(feed.board, RUN), "where attempt 2 began"

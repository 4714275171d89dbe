"""`trainguard ui`: the run page against a real worker on the embedded broker, rendered in a
real headless browser (Debian's chromium). A run logs healthy steps, saves a checkpoint and
turns NaN; the page must plot its watched signals with their baseline band, mark the alert and
the breaker's decision at their steps, say the breaker's state and link the diagnosis report.
Screenshots go under out/screenshots (paths printed at the end of the test run)."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import SCREENSHOTS
from tests.integration import WorkerProcess, browser, wait_until
from trainguard.producers.trainer import TrainerLogger
from trainguard.streams import rules as rules_mod
from trainguard.ui import UiServer

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
RUN = "ui-run-1"
NAN_STEP = 41


def _text_of(page: str) -> str:
    """What a person reads on a page: its text, not its markup."""
    from html.parser import HTMLParser

    parts: list[str] = []
    parser = HTMLParser()
    parser.handle_data = parts.append
    parser.feed(page)
    return " ".join(parts)


def _get(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


def _faulty_run(kafka) -> None:
    logger = TrainerLogger(RUN, kafka, host="ui-test")
    try:
        for step in range(1, NAN_STEP + 1):
            loss = float("nan") if step == NAN_STEP else 0.5 + 0.01 * (step % 5)
            logger.log({"actor/pg_loss": loss, "actor/kl_loss": 0.01 + 0.0005 * step,
                        "actor/grad_norm": 1.0 + 0.05 * (step % 3)}, step)
            if step == 30:
                logger.checkpoint_saved(30, "/ckpt/global_step_30")
    finally:
        logger.close(10, quiet=True)


def test_the_run_page_shows_signals_alert_decision_and_report(kafka, tmp_path):
    worker = WorkerProcess(kafka, tmp_path).start()
    ui = None
    try:
        worker.wait_ready()
        _faulty_run(kafka)
        ui = UiServer(kafka, rules_mod.default(), port=0).start()
        run_url = f"{ui.url}run/{RUN}"

        def decided():
            view = json.loads(_get(f"{ui.url}api/run/{RUN}"))
            ready = view["reports"] and view["status"] and view["status"]["breaker"]["status"] == "awaiting"
            return view if ready else None

        view = wait_until(decided, 60, "the alert, the decision and the run's status on the page")
    finally:
        worker.kill()
    try:
        assert any(a["rule"] == "non_finite" and a["step"] == NAN_STEP for a in view["alerts"])
        assert [c["action"] for c in view["commands"]] == ["rollback"] and view["commands"][0]["step"] == NAN_STEP

        dom = browser("--dump-dom", run_url)
        assert 'class="plot" data-metric="actor/pg_loss"' in dom, "a plot per watched signal"
        assert dom.count('class="plot"') >= 3
        assert 'class="band"' in dom, "the baseline band the rules judge against"
        assert f'class="marker alert" data-step="{NAN_STEP}"' in dom, "the alert at its step"
        assert f'class="marker command" data-step="{NAN_STEP}"' in dom, "the breaker's decision at its step"
        assert f'class="nonfinite" data-step="{NAN_STEP}"' in dom, "the NaN is marked, not dropped"
        assert '<b class="breaker">awaiting</b>' in dom, "the breaker waits for the trainer's ack"
        report_link = dom.split('class="report" href="', 1)[1].split('"', 1)[0]
        report_dom = browser("--dump-dom", ui.url.rstrip("/") + report_link)
        assert "decision: <b>ROLLBACK</b>" in report_dom
        assert f'class="run" href="/run/{RUN}"' in report_dom, "the report links back to the run's page"
        loss_plot = _plots(report_dom)["actor/pg_loss"]
        assert _attr_of(loss_plot, "data-x0") < NAN_STEP <= _attr_of(loss_plot, "data-x1"), "on the step axis"
        assert f'class="marker alert" data-step="{NAN_STEP}"' in loss_plot
        for page in (dom, report_dom):
            text = _text_of(page)
            assert not re.search(r"(step|=|:|^)\s*None\b", text, re.M), "no Python None where a value goes"
            long_numbers = [n for n in re.findall(r"\d+\.\d+", text) if len(n.replace(".", "").lstrip("0")) > 4]
            assert not long_numbers, f"values to 4 significant digits, not {long_numbers}"

        index = browser("--dump-dom", ui.url)
        assert f'href="/run/{RUN}"' in index

        shots = ROOT / "out" / "screenshots"
        shots.mkdir(parents=True, exist_ok=True)
        for name, url in (("run-page", run_url), ("run-page-report", ui.url.rstrip("/") + report_link)):
            shot = shots / f"{name}.png"
            shot.unlink(missing_ok=True)
            browser(f"--screenshot={shot}", "--window-size=1100,1600", url)
            assert shot.is_file() and shot.stat().st_size > 10_000, "a rendered page, not a blank one"
            SCREENSHOTS.append(shot)
    finally:
        ui.stop()


def test_hostile_records_inject_nothing_and_blind_nothing(kafka, tmp_path):
    """Records with an injection payload in every string field of every record kind, on every
    topic, beside a real run a real worker judges; malformed and misplaced records one at a time.
    Every page is rendered in chromium: nothing a record holds becomes markup, the reader lives
    through each malformed record while the good run's page is served, and a restarted UI reads
    past them all (chaos/scenarios.py's ui_injections, also run by `make chaos`)."""
    from chaos import scenarios

    r = scenarios.ui_injections(kafka, log_dir=tmp_path)
    assert r["ui_injections"] == 0, r["ui_injection_details"]
    assert r["ui_pages_checked"] >= 8, r
    assert r["ui_payloads_shown_as_text"] >= 20, f"the payloads reach the pages, as text: {r}"
    assert r["ui_malformed_skipped"] == r["ui_malformed_records"], f"each malformed record skipped: {r}"
    assert r["ui_reader_alive_after_each_malformed"] == r["ui_malformed_records"], r
    assert r["ui_records_skipped"] >= r["ui_malformed_records"], r
    assert r["ui_reader_alive"] and r["ui_restarted_reader_alive"], r


def _status_of(url: str, headers: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers)


def test_pages_answer_only_their_own_host_and_need_the_token_beyond_loopback(kafka):
    local = UiServer(kafka, rules_mod.default(), port=0).start()
    try:
        port = local.server.server_address[1]
        assert _status_of(local.url, {})[0] == 200
        assert _status_of(local.url, {"Host": f"localhost:{port}"})[0] == 200
        code, headers = _status_of(local.url, {"Host": f"rebound.example:{port}"})
        assert code == 403, "a page on another site whose name now points here reads nothing"
        assert "script-src" not in headers.get("Content-Security-Policy", "x") and \
            "default-src 'none'" in headers["Content-Security-Policy"]
        for bad in ("from=a&to=9", "from=9&to=3", "from=3"):
            assert _status_of(f"{local.url}run/{RUN}?{bad}", {})[0] == 400, f"?{bad}: a clear error, not a page"
    finally:
        local.stop()

    wide = UiServer(kafka, rules_mod.default(), addr="0.0.0.0", port=0, allowed_hosts=["trainguard.internal"]).start()
    try:
        assert wide.token and wide.login_url.endswith(f"?token={wide.token}")
        host = {"Host": f"trainguard.internal:{wide.server.server_address[1]}"}
        assert _status_of(wide.url, host)[0] == 401, "bound beyond loopback: no page without the token"
        assert _status_of(wide.url + "?token=wrong", host)[0] == 401
        code, headers = _status_of(wide.login_url, host)
        assert code == 200 and "HttpOnly" in headers["Set-Cookie"]
        cookie = headers["Set-Cookie"].split(";", 1)[0]
        assert _status_of(wide.url + "api/runs", {**host, "Cookie": cookie})[0] == 200, "then the cookie will do"
        assert _status_of(wide.login_url, {"Host": "evil.example"})[0] == 403
    finally:
        wide.stop()


def test_the_board_keeps_within_its_limits_and_renders_outside_the_readers_lock():
    """Whoever writes to the topics cannot grow the page's memory without end, and a big page
    holds the lock the reader needs only to copy the run, not to render it."""
    import threading
    import time

    import orjson

    from trainguard.core.kafka import Topics
    from trainguard.schemas import events as ev
    from trainguard.ui import Board, render_run

    topics = Topics()
    board = Board(rules_mod.default(), topics, max_runs=5, max_alerts=3, max_series=4, max_points=10, max_reports=2,
                  max_report_bytes=50_000, max_names=100)
    src = ev.source("node", "h", 0)
    for i in range(40):
        run = f"run-{i % 8}"
        board.take(topics.events, run.encode(), ev.encode(ev.metrics_event(
            run, i, {"gpu/utilization_pct": 1.0, **{f"gpu/{i}_{j}/utilization_pct": 1.0 for j in range(30)}},
            src=src)))
        alert = {"schema": ev.ALERT, "id": f"a{i}", "run_id": run, "rule": "r", "severity": "P1", "status": "firing",
                 "ts": 1.7e9, "onset": {"ts": 1.7e9}, "evidence": {}}
        report = {"schema": ev.REPORT, "id": f"rep{i}", "run_id": run, "action": "stop", "command_id": f"c{i}",
                  "ts": 1.7e9, "incident": {"detail": "x" * 20_000}, "checkpoint": {}, "alerts": []}
        status = {"schema": ev.STATUS, "run_id": run, "ts": 1.7e9, "breaker": {"status": "closed", "rollbacks": 0},
                  "open_alerts": []}
        board.take(topics.alerts, run.encode(), orjson.dumps(alert))
        board.take(topics.alerts, run.encode(), orjson.dumps(report))
        board.take(topics.acks, run.encode(), ev.encode(ev.ack_event(f"c{i}", run, "applied")))
        board.take(topics.status, run.encode(), orjson.dumps(status))
    assert board.skipped()[0] == 0
    assert len(board.runs_by_id) == 5 and len(board._watched) <= 100
    for run in board.runs_by_id.values():
        assert len(run.series) <= 4 and all(len(s) <= 10 for s in run.series.values())
        assert len(run.alerts) <= 3 and len(run.acks) <= 3 and len(run.reports) <= 2
    assert 0 < sum(board.report_bytes.values()) <= 50_000

    big = Board(rules_mod.default(), topics)
    names = [f"actor/pg_loss_{i}" for i in range(64)]
    trainer = ev.source("trainer", "h", 0)
    for step in range(2000):
        big.take(topics.events, b"big", ev.encode(ev.metrics_event(
            "big", step, {n: 0.5 + 0.01 * ((step * i) % 7) for i, n in enumerate(names)}, src=trainer)))

    class TimedLock:
        def __init__(self):
            self.lock, self.held = threading.Lock(), 0.0

        def __enter__(self):
            self.lock.acquire()
            self.since = time.perf_counter()

        def __exit__(self, *exc):
            self.held += time.perf_counter() - self.since
            self.lock.release()

    big.lock = TimedLock()
    started = time.perf_counter()
    page = render_run(big, "big")
    took = time.perf_counter() - started
    assert page.count('class="plot"') == 64
    assert big.lock.held < 0.25 * took, f"the lock held {big.lock.held:.3f} s of a {took:.3f} s page"


def test_a_finished_runs_page_still_shows_how_it_ended_after_its_state_is_freed(kafka, tmp_path):
    """The next morning: the worker freed the run's detection state long ago; a UI started now
    reads the summary the worker left on the status topic."""
    worker = WorkerProcess(kafka, tmp_path, extra_env={"TRAINGUARD_FINISHED_GRACE_S": "1"}).start()
    run = "ui-finished-1"
    try:
        worker.wait_ready()
        logger = TrainerLogger(run, kafka, host="ui-test")
        for step in range(1, 13):
            logger.log({"actor/pg_loss": 0.5 + 0.01 * (step % 5), "actor/kl_loss": 0.01}, step)
        logger.close(10, quiet=True)  # reports the run finished
        wait_until(lambda: f"forgot run {run} (finished)" in worker.log(), 60, "the worker freeing the run's state")
    finally:
        worker.kill()
    ui = UiServer(kafka, rules_mod.default(), port=0).start()
    try:
        def summary():
            view = json.loads(_get(f"{ui.url}api/run/{run}"))
            return view if (view["status"] or {}).get("state_freed") else None

        view = wait_until(summary, 30, "the run's summary on the page")
        assert view["status"]["outcome"] == "finished" and view["status"]["last_step"] == 12
        dom = browser("--dump-dom", f"{ui.url}run/{run}")
        assert '<b class="outcome">finished</b>' in dom and "breaker <b class=\"breaker\">armed</b>" in dom
    finally:
        ui.stop()


LONG_RUN = "ui-long-1"
LONG_STEPS, LONG_NAN, LONG_RESTORED = 50_000, 100, 90


def _long_run(kafka) -> float:
    """50,000 steps: a NaN loss at step 100, the trainer back at checkpoint 90 (a rollback:
    steps 91.. again), KL rising over three decades, a constant entropy. Seconds to log it."""
    import time

    logger = TrainerLogger(LONG_RUN, kafka, host="ui-test")
    started = time.perf_counter()
    try:
        steps = [*range(1, LONG_NAN + 1), *range(LONG_RESTORED + 1, LONG_STEPS + 1)]
        for i, step in enumerate(steps):
            after = i >= LONG_NAN
            loss = float("nan") if i == LONG_NAN - 1 else 0.5 + 0.01 * (step % 5) - (0.05 if after else 0.0)
            logger.log({"actor/pg_loss": loss, "actor/kl_loss": 0.001 * 10 ** (3 * step / LONG_STEPS),
                        "actor/entropy": 1.2}, step)
            if step == LONG_RESTORED and not after:
                logger.checkpoint_saved(LONG_RESTORED, "/ckpt/global_step_90")
    finally:
        logger.close(30, quiet=True)
    return time.perf_counter() - started


def _polylines(svg: str) -> list[list[tuple[int, int]]]:
    pts = re.findall(r'<polyline class="series"[^>]*points="([^"]+)"', svg)
    out = []
    for p in pts:
        nums = [int(n) for n in p.split()]
        out.append(list(zip(nums[0::2], nums[1::2], strict=True)))
    return out


def _plots(dom: str) -> dict[str, str]:
    return {m.group(1): m.group(0) for m in re.finditer(r'<svg[^>]*class="plot" data-metric="([^"]+)".*?</svg>', dom,
                                                         re.S)}


def _attr_of(svg: str, name: str) -> float:
    return float(re.search(rf'{name}="([^"]+)"', svg).group(1))


def test_a_long_run_with_a_rollback_plots_whole_zooms_to_its_alert_and_never_draws_back(kafka, tmp_path):
    """A new user's run next to TensorBoard: 50k steps through a real worker, a NaN at step
    100 and a rollback to 90. The page draws the whole run (downsampled), real axes, the y
    range within the data (a non-negative metric never below 0, a constant one around its
    level, KL on a log scale), no line back at the rollback, and zooming to the alert (through
    the link its row gives) shows it with its id, severity and state."""
    import time

    worker = WorkerProcess(kafka, tmp_path).start()
    ui = None
    try:
        worker.wait_ready()
        logged_s = _long_run(kafka)
        since = time.perf_counter()
        ui = UiServer(kafka, rules_mod.default(), port=0).start()
        api = f"{ui.url}api/run/{LONG_RUN}"

        def seen_whole():
            view = json.loads(_get(api))
            done = (view["status"] or {}).get("last_step") == LONG_STEPS and view["alerts"] and \
                max(view["series"].get("actor/pg_loss", {}).get("steps") or [0]) == LONG_STEPS
            return view if done else None

        view = wait_until(seen_whole, 240, "the worker judging all 50,000 steps and the page reading them")
        seen_s = time.perf_counter() - since
    finally:
        worker.kill()
    try:
        alert = next(a for a in view["alerts"] if a["rule"] == "non_finite" and a["step"] == LONG_NAN)
        loss = view["series"]["actor/pg_loss"]
        assert len(loss["steps"]) <= 10_000 and min(loss["steps"]) == 1, "the whole run, in bounded memory"
        assert "nan" in loss["values"], "the NaN survives the downsampling"
        assert loss["stride"] > 1 and len(loss["steps"]) >= LONG_STEPS / loss["stride"] / 2

        run_url = f"{ui.url}run/{LONG_RUN}"
        started = time.perf_counter()
        page = _get(run_url).decode()
        page_s = time.perf_counter() - started
        dom = browser("--dump-dom", run_url)
        plots = _plots(dom)
        assert {"actor/pg_loss", "actor/kl_loss", "actor/entropy"} <= set(plots)
        assert f"keeps one value per {loss['stride']} logged" in dom, "the page says it keeps fewer points"
        for name, svg in plots.items():
            assert _attr_of(svg, "data-x0") <= 1 and _attr_of(svg, "data-x1") >= LONG_STEPS, f"{name}: the whole run"
            assert _attr_of(svg, "data-drawn") <= 2 * 4 * 700, f"{name}: downsampled to the pixels"
            finite = [v for v in view["series"][name]["values"] if isinstance(v, float)]
            lo, hi, y0, y1 = min(finite), max(finite), _attr_of(svg, "data-y0"), _attr_of(svg, "data-y1")
            assert y0 >= 0, f"{name}: a non-negative metric's range stays above 0"
            if name == "actor/kl_loss":
                assert 'data-scale="log"' in svg and lo / 2 <= y0 < lo and hi < y1 <= hi * 2, (y0, y1)
            elif name == "actor/entropy":
                assert y0 < 1.2 < y1 and y1 - y0 < 0.1, f"a constant metric around its level: {y0}..{y1}"
                labels = re.findall(r'<text class="tick y"[^>]*>([^<]+)</text>', svg)
                assert len(labels) >= 3 and len(set(labels)) == len(labels), labels
            else:
                span = hi - lo
                assert lo - 0.1 * span <= y0 <= lo and hi <= y1 <= hi + 0.1 * span, (name, lo, hi, y0, y1)
            assert len(re.findall(r'<text class="tick x"', svg)) >= 4, "a step axis with ticks"

        # zoom to the alert through its row's link
        row = re.search(rf'<tr class="alert [^"]*" data-step="{LONG_NAN}" data-alert="([^"]+)">.*?</tr>', dom, re.S)
        assert row and row.group(1) == alert["id"], "the alert's row with its id"
        assert "P0" in row.group(0) and ("firing" in row.group(0) or "resolved" in row.group(0))
        href = re.search(r'class="zoom-to" href="([^"]+)"', row.group(0)).group(1).replace("&amp;", "&")
        zoomed = browser("--dump-dom", run_url + href)
        loss_svg = _plots(zoomed)["actor/pg_loss"]
        assert _attr_of(loss_svg, "data-x0") <= LONG_NAN <= _attr_of(loss_svg, "data-x1") <= LONG_NAN + 100
        marker = re.search(rf'class="marker alert" data-step="{LONG_NAN}" data-alert="([^"]+)" '
                           rf'data-severity="([^"]+)" data-state="([^"]+)"', loss_svg)
        assert marker and marker.groups()[:2] == (alert["id"], "P0"), "the alert, with its id, at its step"
        assert f'class="nonfinite" data-step="{LONG_NAN}"' in loss_svg
        assert f'class="marker restart" data-step="{LONG_RESTORED + 1}"' in loss_svg, "where the rollback resumed"
        segments = re.findall(r'<polyline class="series" data-segment="(\d+)"', loss_svg)
        assert {"0", "1"} <= set(segments), "the rollback starts a new segment"
        for svg in [*plots.values(), *_plots(zoomed).values()]:
            for line in _polylines(svg):
                xs = [x for x, _ in line]
                assert xs == sorted(xs), "no line drawn back: x never decreases within a segment"
        assert 'class="hover" href="?from=' in zoomed, "the value under the cursor, and a click zooms in"
        print(f"\nlong run: 50k steps logged in {logged_s:.1f} s, judged by the worker and read by the page "
              f"{seen_s:.1f} s later; the page: {len(page) / 1e3:.0f} kB in {page_s * 1000:.0f} ms")

        shots = ROOT / "out" / "screenshots"
        shots.mkdir(parents=True, exist_ok=True)
        for name, url in (("run-page-50k-steps", run_url), ("run-page-50k-zoomed-to-alert", run_url + href)):
            shot = shots / f"{name}.png"
            shot.unlink(missing_ok=True)
            browser(f"--screenshot={shot}", "--window-size=1100,1500", url)
            assert shot.is_file() and shot.stat().st_size > 10_000
            SCREENSHOTS.append(shot)
    finally:
        ui.stop()


def test_a_series_keeps_the_whole_run_its_nan_and_its_rollback_within_its_limit():
    """100,000 steps with a NaN and a rollback in 1,000 points; whoever writes steps that always
    go back, or only NaN, cannot grow it past its limit."""
    import math

    from trainguard.ui import Series

    series = Series(1000)
    for step in [*range(1, 101), *range(91, 100_001)]:
        series.add(step, math.nan if step == 100 and not series.restarts else 0.5 + 0.01 * (step % 7))
    steps, values = series.copy()
    assert len(series) <= 1000 and steps[0] == 1 and steps[-1] == 100_000, "the whole run, bounded"
    assert steps[np.isnan(values)].tolist() == [100], "the NaN survives every merge"
    back = np.flatnonzero(np.diff(steps) <= 0)
    assert steps[back + 1].tolist() == [91] and series.restarts == [(100, 91)], "the restored step is kept"
    assert np.nanmin(values) == 0.5 and np.nanmax(values) == pytest.approx(0.56), "the envelope survives"

    for hostile in ((lambda i: -i, math.nan), (lambda i: i % 3, 1.0)):
        series = Series(1000)
        for i in range(50_000):
            series.add(hostile[0](i), hostile[1])
        assert len(series) <= 1000 and len(series.restarts) <= 64


def test_the_run_page_shows_who_acknowledged_an_alert_and_the_silences_in_force():
    import orjson

    from trainguard.core.kafka import Topics
    from trainguard.schemas import events as ev
    from trainguard.ui import Board, render_run

    topics = Topics()
    board = Board(rules_mod.default(), topics)
    alert = {"schema": ev.ALERT, "id": "a-41", "run_id": "r", "rule": "non_finite", "severity": "P0",
             "status": "firing", "ts": 1.7e9, "step": 41, "metric": "actor/pg_loss", "value": "nan",
             "onset": {"ts": 1.7e9}, "evidence": {}, "silenced": True}
    status = {"schema": ev.STATUS, "run_id": "r", "ts": 1.7e9, "breaker": {"status": "armed", "rollbacks": 0},
              "open_alerts": [{"rule": "non_finite", "id": "a-41", "step": 41,
                               "acknowledged": {"by": "alice", "reason": "known bad shard", "ts": 1.7e9}}],
              "silences": [{"id": "s-1", "rule": "non_finite", "until": 1.7e9 + 3600}]}
    board.take(topics.alerts, b"r", orjson.dumps(alert))
    board.take(topics.status, b"r", orjson.dumps(status))
    assert board.skipped()[0] == 0, board.skipped()
    text = _text_of(render_run(board, "r"))
    assert "a-41" in text and "2023-11-14 22:13:20" in text, "the alert's id and when it fired (UTC)"
    assert "silenced" in text and "acknowledged by alice: known bad shard" in text
    assert "silences in force: s-1 (non_finite, until 2023-11-14 23:13:20 UTC)" in text


def test_the_run_page_says_what_came_of_the_breakers_command_and_which_checkpoints_are_suspect():
    """The status of a run whose trainer refused the breaker's stop, as a worker publishes it (the
    real engine): the page says the stop was refused, never that the run stopped, and names each
    suspect checkpoint with why."""
    import orjson

    from trainguard.core.kafka import Topics
    from trainguard.schemas import events as ev
    from trainguard.streams.engine import Engine
    from trainguard.ui import Board, render_run

    engine = Engine(rules_mod.default())
    trainer, offset = ev.source("trainer", "h", 0), 0
    for step in range(1, 41):
        offset += 1
        loss = 0.1 if step <= 20 else float("nan")
        engine.handle(ev.encode(ev.metrics_event("r", step, {"actor/pg_loss": loss}, src=trainer, ts=1.7e9 + step)),
                      0, offset)
        if step % 10 == 0:
            offset += 1
            engine.handle(ev.encode(ev.checkpoint_event("r", step, f"/ckpt/{step}", ts=1.7e9 + step)), 0, offset)
    stop = engine.status("r")["command"]
    assert stop["action"] == "rollback", stop  # to step 20, which this trainer refuses
    refusal = ev.ack_event(stop["id"], "r", "rejected", "this loop does not handle rollback", step=41, ts=1.7e9 + 41)
    engine.handle_ack(ev.encode(refusal))
    topics = Topics()
    board = Board(rules_mod.default(), topics)
    board.take(topics.status, b"r", orjson.dumps(engine.status("r")))
    text = _text_of(render_run(board, "r"))
    assert "the breaker's last command: rollback sent at step 21, refused by the trainer: this loop does not " \
           "handle rollback" in text, text
    assert "step 30: saved after a NaN/Inf in actor/pg_loss at step 30; step 40: saved after a NaN/Inf in " \
           "actor/pg_loss at step 40" in text, text
    assert "suspect checkpoints (never a rollback target): step 20: the trainer could not load it" in text, text


def test_negative_steps_and_a_rollback_stay_inside_the_frame_and_go_forward():
    from trainguard.sinks.reports import svg_steps_plot

    steps = [*range(-20, 31), *range(10, 41)]
    svg = svg_steps_plot("m", steps, [float(s % 4) for s in steps], clip_at_zero=True)
    lines = _polylines(svg)
    assert len(lines) == 2, "two segments: before and after the rollback to step 10"
    for line in lines:
        xs = [x / 10 for x, _ in line]
        assert xs == sorted(xs) and all(64 <= x <= 720 - 28 for x in xs), "forward, inside the frame"
    assert _attr_of(svg, "data-x0") == -20 and _attr_of(svg, "data-y0") == 0


def test_slow_and_idle_clients_are_cut_off_and_never_take_every_thread():
    """Real sockets against the page server: a client that sends half a request (or a byte at a
    time) loses its connection at the deadline, connections past the cap get 503 at once, and
    the slots come back for real requests."""
    import select
    import socket
    import threading
    import time

    from trainguard.core.kafka import Topics
    from trainguard.ui import Board
    from trainguard.ui.server import PageServer, make_handler

    server = PageServer(("127.0.0.1", 0), make_handler(Board(rules_mod.default(), Topics())),
                        max_connections=4, request_timeout_s=1.0)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    port = server.server_address[1]

    def half_sent():
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET / HT")  # and nothing more
        return s

    try:
        idle = [half_sent() for _ in range(3)]
        dribbler = socket.create_connection(("127.0.0.1", port), timeout=5)
        time.sleep(0.2)
        started = time.monotonic()
        over = socket.create_connection(("127.0.0.1", port), timeout=5)
        over.sendall(b"GET / HTTP/1.0\r\n\r\n")
        answer = over.recv(4096)
        assert answer.startswith(b"HTTP/1.0 503 ") and b"too many connections" in answer
        assert time.monotonic() - started < 0.5  # at once, not after the slow ones
        # A byte every 0.3 s defeats a per-read timeout alone: the deadline ends it too.
        cut = None
        for byte in b"GET / HTTP/1.0\r\nX-Slow: " + b"a" * 40:
            try:
                dribbler.send(bytes([byte]))
            except OSError:
                cut = time.monotonic() - started
                break
            if select.select([dribbler], [], [], 0.3)[0] and dribbler.recv(100) == b"":
                cut = time.monotonic() - started
                break
        assert cut is not None and cut < 2.5, cut
        for s in idle:
            assert s.recv(100) == b""  # closed by the server at the deadline, not by the client
        # Every slot is back: three idle clients again, and a real request is still answered.
        # (a thread frees its slot just after closing: wait for it, briefly)
        idle += [half_sent() for _ in range(3)]
        wait_until(lambda: _status_of(f"http://127.0.0.1:{port}/", {})[0] == 200, 3, "a free slot")
    finally:
        server.shutdown()
        server.server_close()

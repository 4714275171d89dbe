"""Alerts and commands on the run's TensorBoard, W&B and SwanLab: the sinks that ``build_sinks``
makes from the environment write with the libraries themselves (in a subprocess: W&B and
SwanLab start helper processes; offline), and what those wrote is read back from their files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainguard.readers import open_reader
from trainguard.schemas import events as ev

RUN = "grpo-qwen-7b"


def _events() -> list[dict]:
    alert = {"schema": ev.ALERT, "id": "a1", "run_id": RUN, "rule": "kl_spike", "severity": "P1", "status": "firing",
             "summary": "KL spike", "step": 42, "ts": 1.7e9, "onset": {"step": 42, "ts": 1.7e9}, "evidence": {},
             "diagnosis": "KL to the reference jumped."}
    command = ev.command_event(RUN, "rollback", target={"step": 40, "path": "/ckpt/global_step_40"},
                               detail="after 3 critical anomalies", reason=["a1"], command_id="c1")
    resolved = {**alert, "status": "resolved", "step": 47}
    other = {"schema": ev.METRICS, "run_id": RUN, "step": 42}  # not an alert: not written
    return [alert, command, alert, other, resolved]  # the repeated alert is written once


def _deliver(tmp_path: Path, env: dict) -> str:
    script = textwrap.dedent("""
        import json, sys
        from trainguard.sinks.runner import build_sinks
        sinks = build_sinks(console=False)
        names = [s.name for s in sinks]
        for s in sinks:
            s.deliver(json.loads(sys.argv[1]))
            s.close()
            assert s.failed == 0, s.name
        print(json.dumps(names))
    """)
    full = {**os.environ, "WANDB_SILENT": "true", "WANDB_MODE": "offline", "SWANLAB_MODE": "offline", **env}
    out = subprocess.run([sys.executable, "-c", script, json.dumps(_events())], capture_output=True, text=True,
                         timeout=240, env=full, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_alerts_and_commands_on_the_runs_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    logdir = tmp_path / "tensorboard_log" / "proj"
    assert json.loads(_deliver(tmp_path, {"TRAINGUARD_TENSORBOARD_DIR": str(logdir / "{run_id}")})) == ["tensorboard"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir / RUN), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    marker = [(e.step, e.value) for e in acc.Scalars("trainguard/alert/kl_spike")]
    assert marker == [(42, 3.0), (47, 0.0)]  # P1 while firing, 0 once resolved
    assert [(e.step, e.value) for e in acc.Scalars("trainguard/command/rollback")] == [(42, 1.0)]
    texts = [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors("trainguard/alerts/text_summary")]
    assert texts[0][0] == 42 and texts[0][1].startswith("P1 KL spike at step 42") and len(texts) == 2
    command_text = acc.Tensors("trainguard/commands/text_summary")[0].tensor_proto.string_val[0].decode()
    assert command_text == "command rollback to step 40 at step 42: after 3 critical anomalies"


def test_alerts_and_commands_on_wandb(tmp_path):
    pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2 as pb

    from trainguard.readers.recordlog import RecordLog

    assert json.loads(_deliver(tmp_path, {"TRAINGUARD_WANDB_PROJECT": "p", "TRAINGUARD_WANDB_DIR": str(tmp_path)})) \
        == ["wandb"]
    run_file = next(tmp_path.rglob("run-*.wandb"))
    steps = dict(open_reader(run_file))  # trainguard's own W&B reader: the markers, by history row
    rows = [steps[k] for k in sorted(steps)]
    assert [(r["trainguard/step"], r.get("trainguard/alert/kl_spike"), r.get("trainguard/command/rollback"))
            for r in rows] == [(42, 3.0, None), (42, None, 1.0), (47, 0.0, None)]
    alerts, tables, group = [], [], None
    for _, payload in RecordLog(str(run_file), ident=b":W&B", magic=0xBEE1, versions=(0,), library="W&B"):
        record = pb.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "alert":
            alerts.append((record.alert.title, record.alert.text, record.alert.level))
        elif kind == "run":
            group = record.run.run_group
        elif kind == "history":
            tables += [json.loads(i.value_json) for i in record.history.item
                       if list(i.nested_key) == ["trainguard/events", "path"]]
    assert group == RUN
    assert alerts == [(f"{RUN}: KL spike", "P1 KL spike at step 42 — KL to the reference jumped.", "ERROR")]
    table = json.loads((run_file.parent / "files" / tables[-1]).read_text())  # the newest: every row so far
    assert table["columns"] == ["step", "kind", "name", "severity", "status", "text"]
    assert [row[:5] for row in table["data"]] == [[42, "alert", "kl_spike", "P1", "firing"],
                                                  [42, "command", "rollback", "", ""],
                                                  [47, "alert", "kl_spike", "P1", "resolved"]]


def test_alerts_and_commands_on_swanlab(tmp_path):
    pytest.importorskip("swanlab")
    assert json.loads(_deliver(tmp_path, {"TRAINGUARD_SWANLAB_PROJECT": "p",
                                          "TRAINGUARD_SWANLAB_DIR": str(tmp_path / "swanlog")})) == ["swanlab"]
    run_file = next((tmp_path / "swanlog").rglob("run-*.swanlab"))
    steps = dict(open_reader(run_file))
    rows = [steps[k] for k in sorted(steps)]
    assert [(r["trainguard/step"], r.get("trainguard/alert/kl_spike"), r.get("trainguard/command/rollback"))
            for r in rows] == [(42, 3.0, None), (42, None, 1.0), (47, 0.0, None)]
    assert b"P1 KL spike at step 42" in b"".join(p.read_bytes() for p in (tmp_path / "swanlog").rglob("*")
                                                 if p.is_file())


def _alert(run: str, aid: str, step: int = 5) -> dict:
    return {"schema": ev.ALERT, "id": aid, "run_id": run, "rule": "loss_nan", "severity": "P1", "status": "firing",
            "summary": "s", "step": step, "ts": 1.7e9, "onset": {"step": step, "ts": 1.7e9}, "evidence": {}}


@pytest.mark.parametrize("template", [False, True])
def test_a_hostile_run_id_writes_inside_the_tensorboard_folder(tmp_path, template):
    pytest.importorskip("tensorboard")
    from trainguard.sinks.trackers import TensorBoardSink

    inner = tmp_path / "a" / "inner"
    sink = TensorBoardSink(str(inner / "{run_id}") if template else str(inner))
    hostile = ["../../escape", str(tmp_path / "absolute"), "..", ".", "a/../../b", "", "\x00"]
    sink.deliver([_alert(run, f"id{i}") for i, run in enumerate(hostile)] + [_alert(RUN, "plain")])
    sink.close()
    assert sink.failed == 0
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(written) == len(hostile) - 1 + 1  # "" is no run: nothing written for it
    assert all(p.parent.parent == inner for p in written), written
    assert (inner / RUN).is_dir()  # a plain run id is the trainer's own folder name


def test_many_run_ids_keep_a_bounded_number_of_tensorboard_writers_open(tmp_path):
    pytest.importorskip("tensorboard")
    import threading

    from trainguard.sinks.trackers import MAX_WRITERS, TensorBoardSink

    sink = TensorBoardSink(str(tmp_path))
    before = threading.active_count()
    for i in range(MAX_WRITERS * 3):
        sink.deliver([_alert(f"run{i}", f"a{i}")])
    assert len(sink._writers) == MAX_WRITERS and threading.active_count() - before <= MAX_WRITERS
    sink.deliver([_alert("run0", "again", step=9)])  # an evicted run's writer opens again, in its folder
    sink.close()
    assert sink.failed == 0 and len(list((tmp_path / "run0").iterdir())) == 2
    assert threading.active_count() <= before


class _Fake:
    """A tracker library's few calls, counted."""

    def __init__(self):
        self.inits, self.finished, self.logged = [], [], []
        self.AlertLevel = type("AlertLevel", (), {"ERROR": "ERROR", "WARN": "WARN"})

    def init(self, **kw):
        self.inits.append(kw.get("group") or kw.get("experiment_name"))
        fake, group = self, kw.get("group")

        class Run:
            def define_metric(self, *a, **k):
                pass

            def alert(self, **k):
                pass

            def log(self, row):
                fake.logged.append(row)

            def finish(self):
                fake.finished.append(group)
        return Run()

    def finish(self):
        self.finished.append(None)

    def log(self, row):
        self.logged.append(row)

    def Table(self, **kw):
        return kw

    def Text(self, text):
        return text


def test_many_run_ids_keep_a_bounded_number_of_wandb_runs_open(monkeypatch):
    from trainguard.sinks.trackers import MAX_WANDB_RUNS, WandbSink

    fake = _Fake()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    sink = WandbSink("p")
    for i in range(MAX_WANDB_RUNS * 4):
        sink.deliver([_alert(f"run{i}", f"a{i}")])
    assert sink.failed == 0 and len(sink._runs) == len(sink._rows) == MAX_WANDB_RUNS
    assert fake.finished == [f"run{i}" for i in range(MAX_WANDB_RUNS * 3)]  # the least recent, finished
    sink.close()
    assert len(fake.finished) == MAX_WANDB_RUNS * 4


def test_swanlab_opens_each_runs_experiment_once_for_a_batch_that_alternates(monkeypatch):
    from trainguard.sinks.trackers import SwanLabSink

    fake = _Fake()
    monkeypatch.setitem(sys.modules, "swanlab", fake)
    sink = SwanLabSink("p")
    sink.deliver([_alert("b", "b0")])
    sink.deliver([_alert("a" if i % 2 else "b", f"x{i}", step=i) for i in range(1, 41)])
    assert fake.inits == ["b trainguard", "a trainguard"] and len(fake.finished) == 1
    a_steps = [row["trainguard/step"] for row in fake.logged[21:]]
    assert a_steps == list(range(1, 41, 2))  # each run's events in their order


def test_alerts_whose_step_no_chart_places_cost_the_rest_of_their_batch_nothing(tmp_path):
    """Steps and times of any size (what a writer of the alerts topic chooses) are written without
    a step, and the real alert behind them is on the chart at its step."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainguard.sinks.trackers import TensorBoardSink

    alert = _events()[0]
    poisoned = [{**alert, "id": f"poison-{i}", "step": v, "ts": 1.8e18, "onset": {"step": v, "ts": 1e308}}
                for i, v in enumerate([float("inf"), float("nan"), 1e308, 2.5, 2**70])]
    sink = TensorBoardSink(str(tmp_path / "{run_id}"))
    sink.deliver([*poisoned, alert])
    sink.close()
    acc = EventAccumulator(str(tmp_path / RUN), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    assert 42 in [e.step for e in acc.Scalars("trainguard/alert/kl_spike")]
    assert sink.written == len(poisoned) + 1

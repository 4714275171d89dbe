"""Replay readers: every format to (step, {metric: float}), detection, bad input."""

from __future__ import annotations

import gzip
import json
import math
import os
import shutil
import struct

import pytest

from trainguard.readers import FORMATS, ReadError, count_steps, detect_format, estimate_steps, open_reader, read_steps
from trainguard.readers.tensorboard import crc32c, masked_crc32c
from trainguard.readers.verl import parse_line, parse_value
from trainguard.schemas.events import checkpoint_event, encode, metrics_event, source

DATA = os.path.join(os.path.dirname(__file__), "data")
VERL_LOG = os.path.join(DATA, "verl_kl_blowup.log")


def data(name: str) -> str:
    return os.path.join(DATA, name)


# --------------------------------------------------------------------------- verl console logs


def test_verl_sample_reads_every_step_with_its_damage_counted():
    reader = open_reader(VERL_LOG)
    assert reader.format == "verl"
    steps = list(reader)
    assert [s for s, _ in steps] == list(range(0, 301))
    assert reader.skipped == 1 and "verl_kl_blowup.log:" in reader.problems[0] and "step:120" in reader.problems[0]
    assert reader.stats()["bad_values"] == 2
    by_step = dict(steps)
    assert by_step[0] == {"val-core/openai/gsm8k/reward/mean@1": 0.3116}
    assert math.isnan(by_step[198]["actor/grad_norm"]) and math.isnan(by_step[205]["actor/grad_norm"])
    assert by_step[97]["training/epoch"] == 0.0  # "[repeated 2x across cluster]" removed
    assert "critic/score/mean" in by_step[77] and "training/epoch" not in by_step[77]  # the cut line's first half
    assert len(by_step[120]) > 10  # the garbled step-120 line did not hide the real one
    assert all(isinstance(v, float) for m in by_step.values() for v in m.values())


def test_verl_sample_ground_truth_kl_blowup_then_reward_collapse():
    by_step = dict(read_steps(VERL_LOG))
    kl = lambda a, b: [by_step[s]["actor/kl_loss"] for s in range(a, b)]  # noqa: E731
    score = lambda a, b: [by_step[s]["critic/score/mean"] for s in range(a, b)]  # noqa: E731
    assert max(kl(1, 150)) < 0.006
    assert kl(150, 151)[0] < 0.006 < min(kl(170, 175)) and min(kl(210, 301)) > 1.0
    assert min(score(120, 180)) > 0.6 and max(score(215, 301)) < 0.15


@pytest.mark.parametrize("line, step, expected", [
    ("step:3 - a/b:0.5 - c:np.float64(0.42) - d:np.float32(-1.5e-05)", 3, {"a/b": 0.5, "c": 0.42, "d": -1.5e-05}),
    ("(main_task pid=1234) step:12 - actor/kl_loss:0.001", 12, {"actor/kl_loss": 0.001}),
    ("\x1b[36m(TaskRunner pid=9)\x1b[0m step:7 - x:tensor(0.25, device='cuda:0') - y:tensor(3.)", 7,
     {"x": 0.25, "y": 3.0}),
    ("step:5 - loss:nan - g:inf - h:-inf - i:NaN - j:Infinity", 5,
     {"loss": math.nan, "g": math.inf, "h": -math.inf, "i": math.nan, "j": math.inf}),
    ("step:9 - n:np.int64(1024) - flag:True - z:0 [repeated 4x across cluster]", 9,
     {"n": 1024.0, "flag": 1.0, "z": 0.0}),
    ("Training:  10%|#  | 3/30\rstep:3 - a:1.0", 3, {"a": 1.0}),
    ("2025-01-01 10:00:00 INFO step:4 - a:np.float64(nan)", 4, {"a": math.nan}),
])
def test_verl_line_shapes(line, step, expected):
    got_step, metrics, bad = parse_line(line)
    assert got_step == step and bad == 0
    assert metrics.keys() == expected.keys()
    for k, v in expected.items():
        assert (math.isnan(v) and math.isnan(metrics[k])) or metrics[k] == v


@pytest.mark.parametrize("line", [
    "Saving checkpoint at step: 100 to /ckpt",        # "step:" but not the metrics marker
    "training/global_step:3 - a:1",                   # a metric named ..._step is not the marker
    "val metrics {'step': 3}",
    "Epoch 1/3, global_step:30",
    "",
])
def test_verl_non_metric_lines_are_passed_over(line):
    assert parse_line(line) is None


def test_verl_value_wrappers():
    assert parse_value("np.float64(0.42)") == 0.42
    assert parse_value("numpy.float32(1.5)") == 1.5
    assert parse_value("tensor(2, dtype=torch.int64)") == 2.0
    assert parse_value("hello") is None
    assert parse_value("np.float64(") is None


def test_verl_log_of_garbage_only_is_an_error_naming_the_file(tmp_path):
    p = tmp_path / "run.log"
    p.write_text("step:1 - ???\nstep:2 - !!!\nnothing here\n")
    with pytest.raises(ReadError) as exc:
        list(read_steps(p))
    assert str(p) in str(exc.value) and "no step could be read" in str(exc.value)


def test_verl_log_without_metric_lines_yields_nothing(tmp_path):
    p = tmp_path / "empty_run.log"
    p.write_text("starting\nloading model\n")
    assert list(read_steps(p)) == []


# --------------------------------------------------------------------------- JSON lines


def test_flat_jsonl_sample_with_non_finite_tokens():
    reader = open_reader(data("sample.jsonl"))
    assert reader.format == "jsonl"
    by_step = dict(reader)
    assert sorted(by_step) == list(range(146, 162))
    last = by_step[161]
    assert math.isnan(last["actor/kl_loss"]) and last["actor/grad_norm"] == math.inf
    assert last["actor/entropy"] == -math.inf
    assert reader.skipped == 1 and reader.problems[0].startswith(data("sample.jsonl") + ":17:")


def test_jsonl_flat_variants(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text("\n".join([
        '{"timestamp_utc": "2025-01-01T00:00:00", "step": 1, "loss": null, "ok": true, "x": "1.5"}',
        '{"global_step": 2, "actor": {"kl_loss": 0.1, "entropy": 0.5}}',
        '{"step": 2, "critic/score/mean": 0.4}',   # same step again, right after: merged
        '{"no_step": 1}',
        '[1, 2]',
        '{"step": -1, "a": 1}',
        '{"step": 3}',                             # no metrics: ignored, not an error
    ]) + "\n")
    reader = open_reader(p)
    steps = list(reader)
    assert steps[0][0] == 1 and math.isnan(steps[0][1]["loss"]) and steps[0][1]["x"] == 1.5
    assert "ok" not in steps[0][1] and "timestamp_utc" not in steps[0][1]
    assert steps[1] == (2, {"actor/kl_loss": 0.1, "actor/entropy": 0.5, "critic/score/mean": 0.4})
    assert len(steps) == 2 and reader.skipped == 3 and reader.ignored == 1


def test_jsonl_of_project_metric_events(tmp_path):
    trainer = source("trainer", "host-a", 0)
    lines = [
        encode(metrics_event("run-1", 10, {"actor/kl_loss": 0.01, "actor/grad_norm": math.nan}, src=trainer,
                             layer="data")),
        encode(metrics_event("run-1", 10, {"timing_s/gen": 3.0}, src=trainer, layer="compute")),
        encode(checkpoint_event("run-1", 10, "/ckpt/10")),
        encode(metrics_event("run-1", 3, {"gpu/utilization_pct[0]": 90.0}, src=source("node", "host-a"),
                             layer="resource")),
        encode(metrics_event("run-1", 11, {"actor/kl_loss": math.inf}, src=trainer)),
        b'{"schema": "metrics/1", "run_id": "run-1", "step": "x", "ts": 1, "source": {"kind": "trainer"}, '
        b'"metrics": {}}',
    ]
    p = tmp_path / "events.jsonl"
    p.write_bytes(b"\n".join(lines) + b"\n")
    reader = open_reader(p)
    steps = list(reader)
    assert [s for s, _ in steps] == [10, 11]
    assert steps[0][1]["actor/kl_loss"] == 0.01 and math.isnan(steps[0][1]["actor/grad_norm"])
    assert steps[0][1]["timing_s/gen"] == 3.0
    assert steps[1][1] == {"actor/kl_loss": math.inf}
    assert reader.ignored == 2  # the checkpoint event and the node agent's sample
    assert reader.skipped == 1 and "invalid metrics event: step" in reader.problems[0]


# --------------------------------------------------------------------------- CSV


def test_csv_sample():
    reader = open_reader(data("sample.csv"))
    assert reader.format == "csv"
    by_step = dict(reader)
    assert sorted(by_step) == list(range(146, 162))
    assert "note" not in by_step[146]
    last = by_step[161]
    assert math.isnan(last["actor/kl_loss"]) and last["actor/entropy"] == math.inf
    assert "actor/grad_norm" not in last and last["critic/score/mean"] == 0.5
    assert reader.skipped == 1 and ":18:" in reader.problems[0] and "7 cells" in reader.problems[0]


def test_tsv_and_step_column_variants(tmp_path):
    p = tmp_path / "export.tsv"
    p.write_text("Step\tloss\tNaN col\n1\t0.5\tNaN\n2.0\t-Infinity\t\nx\t1\t1\n")
    reader = open_reader(p)
    steps = list(reader)
    assert steps[0][0] == 1 and steps[0][1]["total_loss"] == 0.5 and math.isnan(steps[0][1]["NaN col"])
    assert steps[1] == (2, {"total_loss": -math.inf})
    assert reader.skipped == 1 and "step must be" in reader.problems[0]


def test_csv_without_step_column_is_an_error_naming_the_line(tmp_path):
    p = tmp_path / "m.csv"
    p.write_text("epoch,loss\n1,0.5\n")
    with pytest.raises(ReadError) as exc:
        list(read_steps(p))
    assert f"{p}:1:" in str(exc.value) and "no step column" in str(exc.value)


# --------------------------------------------------------------------------- trainer_state.json


def test_trainer_state_sample():
    reader = open_reader(data("trainer_state.json"))
    assert reader.format == "hf"
    by_step = dict(reader)
    assert sorted(by_step) == list(range(1, 31))
    assert by_step[1]["epoch"] == 0.0125 and by_step[1]["reward"] == pytest.approx(0.31)
    assert math.isnan(by_step[17]["grad_norm"])
    assert by_step[10]["eval_reward"] == pytest.approx(0.38) and "loss" in by_step[10]  # train + eval merged
    assert by_step[30]["train_runtime"] == 1810.4


def test_trainer_state_directory_and_broken_file(tmp_path):
    ckpt = tmp_path / "checkpoint-30"
    ckpt.mkdir()
    shutil.copy(data("trainer_state.json"), ckpt / "trainer_state.json")
    assert count_steps(ckpt) == 30
    broken = tmp_path / "trainer_state.json"
    broken.write_text('{\n  "log_history": [\n    {"step": 1, "loss": 0.5},\n    {"step": \n')
    with pytest.raises(ReadError) as exc:
        list(read_steps(broken))
    assert str(broken) in str(exc.value) and ":5:" in str(exc.value) and "not valid JSON" in str(exc.value)
    other = tmp_path / "config.json"
    other.write_text('{\n  "lr": 1e-6\n}\n')
    with pytest.raises(ReadError, match="log_history"):
        list(read_steps(other))


def test_one_line_trainer_state_is_not_taken_for_jsonl(tmp_path):
    p = tmp_path / "state.json"
    p.write_text(json.dumps({"log_history": [{"step": 1, "loss": 0.1}, {"step": 2, "loss": 0.2}]}))
    assert detect_format(p) == "hf"
    assert list(read_steps(p)) == [(1, {"total_loss": 0.1}), (2, {"total_loss": 0.2})]


# --------------------------------------------------------------------------- TensorBoard
# The test's own TFRecord/Event writer: written from the format's definition, with a bitwise
# CRC32C independent of the reader's table, so that reader and writer do not share a mistake.


def _crc32c_bitwise(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    crc = _crc32c_bitwise(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _len_field(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _varint(len(payload)) + payload


def _value(tag: str, *, simple: float | None = None, tensor: bytes | None = None, plugin: str | None = None) -> bytes:
    body = _len_field(1, tag.encode())
    if simple is not None:
        body += _key(2, 5) + struct.pack("<f", simple)
    if tensor is not None:
        body += _len_field(8, tensor)
    if plugin is not None:
        body += _len_field(9, _len_field(1, _len_field(1, plugin.encode())))
    return body


def _tensor(dtype: int, *, float_val=None, double_val=None, content: bytes | None = None, dims=()) -> bytes:
    body = _key(1, 0) + _varint(dtype)
    shape = b"".join(_len_field(2, _key(1, 0) + _varint(d)) for d in dims)
    body += _len_field(2, shape)
    if content is not None:
        body += _len_field(4, content)
    if float_val is not None:
        body += _len_field(5, struct.pack(f"<{len(float_val)}f", *float_val))
    if double_val is not None:
        body += _len_field(6, struct.pack(f"<{len(double_val)}d", *double_val))
    return body


def _event(step: int, values: list[bytes] = (), *, wall_time: float = 1.7e9, extra: bytes = b"") -> bytes:
    body = _key(1, 1) + struct.pack("<d", wall_time) + _key(2, 0) + _varint(step)
    if values:
        body += _len_field(5, b"".join(_len_field(1, v) for v in values))
    return body + extra


def _record(data: bytes) -> bytes:
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", _masked(header)) + data + struct.pack("<I", _masked(data))


def write_tfevents(path, events: list[bytes]) -> None:
    with open(path, "wb") as f:
        for e in events:
            f.write(_record(e))


def _sample_events() -> list[bytes]:
    file_version = _event(0, extra=_len_field(3, b"brain.Event:2"))
    events = [file_version]
    for step in range(1, 6):
        events.append(_event(step, [_value("actor/kl_loss", simple=0.001 * step)]))
        events.append(_event(step, [_value("critic/score/mean", tensor=_tensor(1, float_val=[0.1 * step]),
                                           plugin="scalars")]))
        events.append(_event(step, [
            _value("actor/grad_norm", tensor=_tensor(2, content=struct.pack("<d", math.nan if step == 4 else 0.5))),
            _value("timing_s/gen", tensor=_tensor(2, double_val=[3.25])),
            _value("hist", tensor=_tensor(1, float_val=[1, 2, 3], dims=(3,)), plugin="histograms"),
            _value("text", tensor=_tensor(7, content=b"hello"), plugin="text"),
        ]))
    events.append(_event(2 ** 40, [_value("big_step", simple=math.inf)]))
    return events


def test_crc32c_known_vectors():
    assert crc32c(b"123456789") == 0xE3069283 == _crc32c_bitwise(b"123456789")
    assert crc32c(b"") == 0
    assert masked_crc32c(b"\x00" * 32) == _masked(b"\x00" * 32)
    blob = bytes(range(256)) * 3
    for n in (1, 7, 8, 9, 15, 16, 17, 100, 767):  # the 8-byte fast path and its tail
        assert crc32c(blob[:n]) == _crc32c_bitwise(blob[:n]), n


def test_tensorboard_file_from_our_writer(tmp_path):
    p = tmp_path / "events.out.tfevents.1700000000.host.1.0"
    write_tfevents(p, _sample_events())
    assert detect_format(p) == "tensorboard"
    renamed = tmp_path / "run1.bin"
    shutil.copy(p, renamed)
    assert detect_format(renamed) == "tensorboard"  # from the content, not the name
    reader = open_reader(p)
    steps = list(reader)
    assert [s for s, _ in steps] == [1, 2, 3, 4, 5, 2 ** 40]
    first = steps[0][1]
    assert first["actor/kl_loss"] == pytest.approx(0.001) and first["critic/score/mean"] == pytest.approx(0.1)
    assert first["actor/grad_norm"] == 0.5 and first["timing_s/gen"] == 3.25
    assert "hist" not in first and "text" not in first
    assert math.isnan(steps[3][1]["actor/grad_norm"])
    assert steps[-1][1] == {"big_step": math.inf}
    assert reader.ignored == 1 and reader.skipped == 0 and reader.position == reader.total_bytes
    assert count_steps(p) == 6 and estimate_steps(p) == 6
    assert count_steps(tmp_path / "run1.bin", fmt="tb") == 6


def test_tensorboard_directory_reads_files_in_name_order(tmp_path):
    write_tfevents(tmp_path / "events.out.tfevents.1700000001.host.1.0", [_event(1, [_value("a", simple=1.0)])])
    write_tfevents(tmp_path / "events.out.tfevents.1700000002.host.1.0", [_event(2, [_value("a", simple=2.0)])])
    assert detect_format(tmp_path) == "tensorboard"
    assert list(read_steps(tmp_path)) == [(1, {"a": 1.0}), (2, {"a": 2.0})]


def test_a_tensorboard_log_tree_with_one_run_reads_that_run(tmp_path):
    # The Hugging Face Trainer's layout: output/runs/<date_host>/events.out.tfevents.*
    run = tmp_path / "runs" / "Nov30_12-00-00_host"
    run.mkdir(parents=True)
    write_tfevents(run / "events.out.tfevents.1700000001.host.1.0", [_event(3, [_value("train/loss", simple=0.5)])])
    assert detect_format(tmp_path) == "tensorboard"
    assert list(read_steps(tmp_path)) == [(3, {"train/total_loss": 0.5})]


def test_a_tensorboard_log_tree_with_several_runs_names_them_and_the_way_out(tmp_path):
    for experiment in ("grpo-a", "grpo-b"):
        (tmp_path / "proj" / experiment).mkdir(parents=True)
        write_tfevents(tmp_path / "proj" / experiment / "events.out.tfevents.1.host",
                       [_event(1, [_value("a", simple=1.0)])])
    with pytest.raises(ReadError) as err:
        list(read_steps(tmp_path))
    message = str(err.value)
    assert "2 TensorBoard runs" in message and "proj/grpo-a" in message and "proj/grpo-b" in message
    assert f"trainguard replay {tmp_path / 'proj' / 'grpo-a'}" in message
    empty = tmp_path / "nothing"
    empty.mkdir()
    with pytest.raises(ReadError, match="in it or under it"):
        detect_format(empty)


def test_tensorboard_corrupt_record_names_its_offset(tmp_path):
    events = _sample_events()
    p = tmp_path / "events.out.tfevents.1.host"
    write_tfevents(p, events)
    raw = bytearray(p.read_bytes())
    third = sum(16 + len(e) for e in events[:2])  # byte offset of the third record
    raw[third + 12 + 3] ^= 0xFF                    # flip a byte inside its data
    p.write_bytes(bytes(raw))
    reader = open_reader(p)
    with pytest.raises(ReadError) as exc:
        list(reader)
    assert f"{p} at byte {third}:" in str(exc.value) and "CRC" in str(exc.value)
    raw[third + 12 + 3] ^= 0xFF
    raw[third + 2] ^= 0x01                         # now the length field
    p.write_bytes(bytes(raw))
    with pytest.raises(ReadError, match=f"at byte {third}: record length fails its CRC"):
        list(read_steps(p))


def test_tensorboard_truncated_tail_is_counted_not_raised(tmp_path):
    p = tmp_path / "events.out.tfevents.2.host"
    write_tfevents(p, _sample_events())
    p.write_bytes(p.read_bytes()[:-7])  # the last record cut short: a writer still running
    reader = open_reader(p)
    steps = list(reader)
    assert [s for s, _ in steps] == [1, 2, 3, 4, 5]
    assert reader.skipped == 1 and "cut short" in reader.problems[0]


def _check_writer_output(logdir) -> None:
    steps = list(read_steps(logdir))
    assert [s for s, _ in steps] == [0, 1, 2]
    assert steps[1][1]["actor/kl_loss"] == pytest.approx(0.01)
    assert steps[2][1]["critic/score/mean"] == pytest.approx(0.5)
    assert math.isnan(steps[2][1]["actor/grad_norm"])


def test_tensorboard_file_from_torch_summary_writer(tmp_path):
    torch_tb = pytest.importorskip("torch.utils.tensorboard", reason="torch with tensorboard not installed")
    writer = torch_tb.SummaryWriter(log_dir=str(tmp_path))
    for step in range(3):
        writer.add_scalar("actor/kl_loss", 0.01 * step, step)
        writer.add_scalar("critic/score/mean", 0.25 * step, step, new_style=True)
        writer.add_scalar("actor/grad_norm", math.nan if step == 2 else 1.0, step)
    writer.close()
    _check_writer_output(tmp_path)


def test_tensorboard_file_from_tensorboard_event_writer(tmp_path):
    """The writer ``torch.utils.tensorboard`` uses under the hood, for machines with tensorboard but no torch."""
    pytest.importorskip("tensorboard", reason="tensorboard not installed")
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writer = EventFileWriter(str(tmp_path))
    scalars = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="scalars"))
    for step in range(3):
        writer.add_event(Event(step=step, summary=Summary(value=[
            Summary.Value(tag="actor/kl_loss", simple_value=0.01 * step)])))
        writer.add_event(Event(step=step, summary=Summary(value=[Summary.Value(
            tag="critic/score/mean", metadata=scalars,
            tensor=TensorProto(dtype=1, float_val=[0.25 * step], tensor_shape=TensorShapeProto()))])))
        writer.add_event(Event(step=step, summary=Summary(value=[
            Summary.Value(tag="actor/grad_norm", simple_value=math.nan if step == 2 else 1.0)])))
    writer.close()
    _check_writer_output(tmp_path)


# --------------------------------------------------------------------------- detection, counting, errors


@pytest.mark.parametrize("name, fmt", [("verl_kl_blowup.log", "verl"), ("sample.jsonl", "jsonl"),
                                       ("sample.csv", "csv"), ("trainer_state.json", "hf")])
def test_detection_by_content_not_only_by_name(tmp_path, name, fmt):
    assert detect_format(data(name)) == fmt
    anonymous = tmp_path / "recording"
    shutil.copy(data(name), anonymous)
    assert detect_format(anonymous) == fmt
    assert count_steps(anonymous) == count_steps(data(name))


def test_gzip_compressed_input(tmp_path):
    p = tmp_path / "verl_kl_blowup.log.gz"
    with open(VERL_LOG, "rb") as src, gzip.open(p, "wb") as dst:
        dst.write(src.read())
    assert detect_format(p) == "verl"
    steps = list(read_steps(p))
    assert len(steps) == 301 and steps == list(read_steps(VERL_LOG))


def test_count_and_estimate_steps():
    assert count_steps(VERL_LOG) == 301
    assert estimate_steps(VERL_LOG) == 301                       # small file: exact
    guess = estimate_steps(VERL_LOG, sample_bytes=20_000)         # extrapolated from the first 20 kB
    assert 250 <= guess <= 360


def test_progress_position_reaches_the_end():
    reader = open_reader(VERL_LOG)
    seen = []
    for _ in reader:
        seen.append(reader.position)
    assert seen == sorted(seen) and 0 < seen[0] < reader.total_bytes
    assert reader.position == reader.total_bytes


def test_errors_name_the_file(tmp_path):
    with pytest.raises(ReadError, match="no such file"):
        open_reader(tmp_path / "missing.log")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ReadError, match="empty"):
        detect_format(empty)
    odd = tmp_path / "notes.md"
    odd.write_text("# a note\nnothing to replay\n")
    with pytest.raises(ReadError) as exc:
        open_reader(odd)
    assert str(odd) in str(exc.value) and "cannot tell the format" in str(exc.value)
    with pytest.raises(ReadError, match="unknown format 'parquet'"):
        open_reader(data("sample.csv"), fmt="parquet")
    assert set(FORMATS) == {"jsonl", "csv", "hf", "tensorboard", "verl", "hflog", "hfnotebook", "tqdm", "wandb",
                            "swanlab"}


def test_forced_format_with_alias():
    assert open_reader(data("sample.jsonl"), fmt="ndjson").format == "jsonl"
    assert open_reader(VERL_LOG, fmt="console").format == "verl"


def test_a_resumed_run_yields_the_repeated_steps_in_file_order(tmp_path):
    p = tmp_path / "resumed.log"
    p.write_text("step:1 - a:1\nstep:2 - a:2\nstep:3 - a:3\nresuming from global_step_1\nstep:2 - a:20\n"
                 "step:3 - a:30\nresuming from global_step_2\nstep:3 - a:300\n")
    assert list(read_steps(p)) == [(1, {"a": 1.0}), (2, {"a": 2.0}), (3, {"a": 3.0}), (2, {"a": 20.0}),
                                   (3, {"a": 30.0}), (3, {"a": 300.0})]


# -- Hugging Face / TRL console logs -------------------------------------------------------


def test_console_logs_dicts_are_read_as_literals_never_evaluated(tmp_path):
    from trainguard.readers.hfconsole import parse_logs

    metrics, bad = parse_logs("{'loss': nan, 'grad_norm': -inf, 'lr': 1e-05, 'x': None, 'y': np.float64(0.5), "
                              "'z': tensor(2.0, device='cuda:0'), 'name': 'sft', 'epoch': 1}")
    assert math.isnan(metrics["loss"]) and metrics["grad_norm"] == -math.inf and metrics["lr"] == 1e-05
    assert math.isnan(metrics["x"]) and metrics["y"] == 0.5 and metrics["z"] == 2.0 and metrics["epoch"] == 1.0
    assert "name" not in metrics and bad == 0
    marker = tmp_path / "ran"
    evil = "{'loss': __import__('pathlib').Path(%r).touch(), 'ok': 1.0}" % str(marker)
    metrics, bad = parse_logs(evil)
    assert metrics == {"ok": 1.0} and bad == 1 and not marker.exists()
    assert parse_logs("{'a': " * 10_000 + "}" * 10_000) is None  # too deep: not a logs dict, no crash
    assert parse_logs("{**x}") is None and parse_logs("['a']") is None


def test_console_log_detection_and_steps(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("\x1b[32mINFO\x1b[0m starting\n"
                    "{'loss': 2.0, 'grad_norm': 1.0, 'epoch': 0.1}\n"
                    "{'eval_loss': 2.5, 'eval_runtime': 0.3, 'epoch': 0.1}\n"
                    " 50%|#####     | 2/4\r{'loss': 1.9, 'grad_norm': 0.9, 'epoch': 0.2}\n"
                    "{'loss': 1.8, 'grad_norm'\n"
                    "{'loss': 1.7, 'step': 40}\n")
    assert detect_format(path) == "hflog"
    reader = open_reader(path)
    steps = list(reader)
    # A plain Trainer (no RL keys): its loss is a training loss; an eval line joins its step.
    assert steps == [(1, {"total_loss": 2.0, "grad_norm": 1.0, "epoch": 0.1, "eval_loss": 2.5, "eval_runtime": 0.3}),
                     (2, {"total_loss": 1.9, "grad_norm": 0.9, "epoch": 0.2}), (40, {"total_loss": 1.7})]
    assert reader.skipped == 1 and "out.txt:5" in reader.problems[0]
    odd = tmp_path / "odd.out"
    odd.write_text("{'loss': 1.0, 'step': inf}\n{'loss': 2.0, 'step': -3}\n")  # not steps: counted on
    assert [s for s, _ in open_reader(odd)] == [1, 2]
    jsonl = tmp_path / "run.log"
    jsonl.write_text('{"step": 1, "loss": 0.5, "note": "{\'a\': 1}"}\n')
    assert detect_format(jsonl) == "jsonl"


# ---------------------------------------------------------------- hostile input: bounded


def test_an_overlong_line_is_skipped_and_counted_never_held_whole(tmp_path):
    import tracemalloc

    from trainguard.readers.base import MAX_LINE_BYTES

    path = tmp_path / "run.log.gz"
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(b"step:1 - actor/kl_loss:0.1\n")
        for _ in range(16 * MAX_LINE_BYTES >> 20):  # one line of 16x the cap, from a small file
            f.write(b"a" * (1 << 20))
        f.write(b"\nstep:2 - actor/kl_loss:0.2\n")
    reader = open_reader(path)
    tracemalloc.start()
    try:
        steps = list(reader)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert steps == [(1, {"actor/kl_loss": 0.1}), (2, {"actor/kl_loss": 0.2})]
    assert reader.skipped == 1 and f"{path}:2: line longer than" in reader.problems[0]
    assert peak < 6 * MAX_LINE_BYTES, peak  # a capped piece at a time (and buffers), not the line


def test_a_line_at_the_cap_is_read(tmp_path):
    from trainguard.readers.base import MAX_LINE_BYTES

    path = tmp_path / "run.jsonl"
    pad = MAX_LINE_BYTES - len('{"step": 1, "loss": 0.5, "n": ""}\n')
    path.write_text('{"step": 0, "loss": 0.4}\n{"step": 1, "loss": 0.5, "n": "%s"}\n' % ("x" * pad))
    reader = open_reader(path)
    assert [s for s, _ in reader] == [0, 1] and reader.skipped == 0


def test_an_integer_past_floats_range_is_no_value_and_is_counted(tmp_path):
    from trainguard.readers.base import to_float

    assert to_float(10 ** 400) is None and to_float(2 ** 53) == 2.0 ** 53
    big = "1" + "0" * 400
    jsonl = tmp_path / "run.jsonl"
    jsonl.write_text('{"step": 0, "loss": 0.5}\n{"step": 1, "loss": %s, "kl": 0.1}\n{"step": 2, "loss": 0.4}\n' % big)
    reader = open_reader(jsonl)
    assert list(reader) == [(0, {"loss": 0.5}), (1, {"kl": 0.1}), (2, {"loss": 0.4})]
    assert reader.stats()["bad_values"] == 1
    console = tmp_path / "train.log"
    console.write_text("{'loss': 0.5, 'reward': 1.0}\n{'loss': %s, 'reward': 1.0}\n" % big)
    reader = open_reader(console)
    assert list(reader) == [(1, {"loss": 0.5, "reward": 1.0}), (2, {"reward": 1.0})]
    assert reader.stats()["bad_values"] == 1


def test_a_console_value_behind_a_thousand_signs_is_no_value(tmp_path):
    from trainguard.readers.hfconsole import MAX_SIGNS, parse_logs

    assert parse_logs("{'a': --1.5, 'b': -+-inf, 'c': -np.float64(0.5), 'd': -True}") == (
        {"a": 1.5, "b": math.inf, "c": -0.5, "d": -1.0}, 0)
    assert parse_logs("{'a': %s2.0}" % ("-" * MAX_SIGNS)) == ({"a": 2.0}, 0)
    assert parse_logs("{'a': %s2.0, 'b': 1.0}" % ("-" * (MAX_SIGNS + 1))) == ({"b": 1.0}, 1)
    path = tmp_path / "train.log"
    path.write_text("{'loss': 0.5, 'reward': 1.0}\n{'loss': " + "-" * 1500 + "1.0, 'reward': 1.0}\n"
                    "{'loss': " + "-" * 1500 + "1.0}\n")
    assert detect_format(path) == "hflog"
    reader = open_reader(path)
    assert list(reader) == [(1, {"loss": 0.5, "reward": 1.0}), (2, {"reward": 1.0})]
    assert reader.stats()["bad_values"] == 2 and reader.skipped == 1 and "train.log:3" in reader.problems[0]


def test_verl_line_parsing_is_linear_in_a_run_of_spaces():
    import time

    from trainguard.readers.verl import strip_repeated

    started = time.perf_counter()
    assert parse_line("step:1 - a:1 -" + " " * 1_000_000 + "x") == (1, {"a": 1.0}, 1)
    assert time.perf_counter() - started < 1.0  # quadratic: hours
    assert strip_repeated(" a:1 [repeated 3x across cluster]  ") == "a:1"
    assert strip_repeated("a:1[repeated 12x across cluster]") == "a:1"
    assert strip_repeated("a:1 [repeated x across cluster]") == "a:1 [repeated x across cluster]"
    assert strip_repeated("a:[repeated 2x across cluster] b:2") == "a:[repeated 2x across cluster] b:2"


def test_a_huge_tensorboard_record_is_passed_over_in_bounded_time_and_memory(tmp_path):
    import time
    import tracemalloc

    from trainguard.readers.tensorboard import MAX_RECORD_BYTES

    # A real file may hold a large non-scalar record (a graph): passed over, the scalars read.
    path = tmp_path / "events.out.tfevents.1.host"
    big = _event(0, extra=_len_field(4, b"\0" * (2 * MAX_RECORD_BYTES)))
    write_tfevents(path, [_event(1, [_value("loss", simple=0.5)]), big, _event(2, [_value("loss", simple=0.25)])])
    reader = open_reader(path)
    assert list(reader) == [(1, {"total_loss": 0.5}), (2, {"total_loss": 0.25})]
    assert reader.skipped == 1 and "passed over unread" in reader.problems[0]
    # A corrupt one: a 64 MiB length (its CRC valid), zeros, a wrong data CRC, in a 65 KB .gz.
    corrupt = tmp_path / "events.out.tfevents.2.host.gz"
    header = struct.pack("<Q", 64 << 20)
    with gzip.open(corrupt, "wb") as f:
        f.write(header + struct.pack("<I", masked_crc32c(header)))
        for _ in range(64):
            f.write(b"\0" * (1 << 20))
        f.write(b"\0\0\0\0")
    started = time.perf_counter()
    tracemalloc.start()
    try:
        with pytest.raises(ReadError, match="no step could be read as tensorboard.*passed over unread"):
            list(open_reader(corrupt))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - started < 5 and peak < 8 * MAX_RECORD_BYTES, peak
    # Past any record's size it is no record: the file is corrupt.
    header = struct.pack("<Q", 1 << 40)
    corrupt.write_bytes(header + struct.pack("<I", masked_crc32c(header)))
    with pytest.raises(ReadError, match="record claims 1099511627776 bytes; corrupt file"):
        list(open_reader(corrupt, "tensorboard"))


def test_a_trainer_state_past_its_cap_is_refused_not_read_whole(tmp_path):
    import tracemalloc

    from trainguard.readers.hf import MAX_STATE_BYTES

    path = tmp_path / "trainer_state.json.gz"
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(b'{"log_history": [{"step": 1, "loss": 0.5}')
        for _ in range(3 * MAX_STATE_BYTES >> 20):  # 3x the cap, from a small file
            f.write(b" " * (1 << 20))
        f.write(b"]}")
    tracemalloc.start()
    try:
        with pytest.raises(ReadError, match=f"{path}: larger than {MAX_STATE_BYTES >> 20} MiB: not a trainer_state"):
            list(open_reader(path, "hf"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2.5 * MAX_STATE_BYTES, peak  # the cap read, never the whole file

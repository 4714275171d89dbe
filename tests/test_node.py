"""The node agent: host metrics without NVML, per-GPU metrics through NVML, events on Kafka."""

from __future__ import annotations

import logging
import sys
import threading
import time
import types

import pytest

from trainguard.producers import node as node_mod
from trainguard.producers.node import NodeAgent, main
from trainguard.schemas.events import decode

HOST_METRICS = ("system/cpu_pct", "system/cpu_load_avg", "system/memory_used_pct", "system/memory_used_gb")


class _Recorder:
    """Stands in for the Publisher where a test only looks at what would be published."""

    def __init__(self):
        self.messages = []
        self.sent = self.dropped = self.delivery_failed = 0

    def publish(self, topic, key, value, partition=None):
        self.messages.append((topic, key, value))
        self.sent += 1
        return True

    def flush(self, timeout=10.0):
        return 0

    def stats(self):
        return {"sent": self.sent, "dropped": 0, "delivery_failed": 0, "pending": 0}


def _no_nvml_module(reason: str = "Driver Not Loaded") -> types.ModuleType:
    fake = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def nvmlInit():
        raise NVMLError(reason)

    fake.NVMLError = NVMLError
    fake.nvmlInit = nvmlInit
    return fake


def _nvml_messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "NVML unavailable" in r.getMessage()]


# --------------------------------------------------------------------------- without NVML


def test_collect_without_nvml_returns_host_metrics_and_says_so_once(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", _no_nvml_module())
    caplog.set_level(logging.INFO, logger="trainguard.node")
    agent = NodeAgent(None, "run-1", interval_s=0.2, host="host-a", publisher=_Recorder())
    first = agent.collect()
    time.sleep(0.05)
    second = agent.collect()
    agent.collect()
    for name in HOST_METRICS:
        assert isinstance(first[name], float), name
    assert 0 <= first["system/memory_used_pct"] <= 100 and first["system/memory_used_gb"] > 0
    assert "system/disk_io_wait_ms" in second and second["system/disk_io_wait_ms"] >= 0  # a delta: from sample 2
    assert not any(k.startswith("gpu/") for k in first)
    assert _nvml_messages(caplog) == ["NVML unavailable (Driver Not Loaded): publishing host metrics only"]
    assert agent.nvml_error == "Driver Not Loaded" and agent.gpu_count == 0


def test_without_pynvml_installed_the_message_says_how_to_get_it(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    caplog.set_level(logging.INFO, logger="trainguard.node")
    agent = NodeAgent(None, "run-1", publisher=_Recorder())
    assert set(HOST_METRICS) <= set(agent.collect())
    agent.collect()
    messages = _nvml_messages(caplog)
    assert len(messages) == 1 and "pynvml is not installed" in messages[0]


def test_this_machine_as_it_is():
    """No fakes: on a machine without a GPU NVML is unavailable; on one with GPUs they show up."""
    agent = NodeAgent(None, "run-1", publisher=_Recorder())
    metrics = agent.collect()
    assert set(HOST_METRICS) <= set(metrics)
    if agent.nvml_error is None:
        assert agent.gpu_count >= 1 and "gpu/memory_total_gb[0]" in metrics
    else:
        assert not any(k.startswith("gpu/") for k in metrics)
    agent.close()


def test_arguments_are_checked():
    with pytest.raises(ValueError):
        NodeAgent(None, "", publisher=_Recorder())
    with pytest.raises(ValueError):
        NodeAgent(None, "run", interval_s=0, publisher=_Recorder())


# --------------------------------------------------------------------------- the NVML path, faked


def _fake_nvml(calls: dict) -> types.ModuleType:
    """A stand-in for ``pynvml`` with 2 GPUs: GPU 0 a data-centre part with ECC and 2 NVLinks,
    GPU 1 a part whose ECC queries raise NotSupported and that has no NVLink. GPU 1 raised
    XID 79 (fallen off the bus) once."""
    nv = types.ModuleType("pynvml")

    class NVMLError(Exception):
        def __init__(self, value=999):
            self.value = value
            super().__init__(f"NVML error {value}")

    class NVMLError_NotSupported(NVMLError):
        def __init__(self):
            super().__init__(3)

    class NVMLError_Timeout(NVMLError):
        def __init__(self):
            super().__init__(10)

    class NVMLError_GpuIsLost(NVMLError):
        def __init__(self):
            super().__init__(15)

    nv.NVMLError, nv.NVMLError_NotSupported = NVMLError, NVMLError_NotSupported
    nv.NVMLError_Timeout, nv.NVMLError_GpuIsLost = NVMLError_Timeout, NVMLError_GpuIsLost
    nv.NVML_ERROR_NOT_SUPPORTED = 3
    nv.NVML_TEMPERATURE_GPU, nv.NVML_CLOCK_SM = 0, 1
    nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 0, 1
    nv.NVML_VOLATILE_ECC, nv.NVML_AGGREGATE_ECC = 0, 1
    nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
    nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
    nv.NVML_FEATURE_ENABLED, nv.NVML_NVLINK_MAX_LINKS = 1, 18
    nv.NVML_NVLINK_ERROR_DL_REPLAY, nv.NVML_NVLINK_ERROR_DL_RECOVERY = 0, 1
    nv.NVML_NVLINK_ERROR_DL_CRC_FLIT, nv.NVML_NVLINK_ERROR_DL_CRC_DATA = 2, 3
    nv.nvmlEventTypeXidCriticalError = 8
    nv.nvmlClocksThrottleReasonHwSlowdown = 0x8
    handles = [types.SimpleNamespace(index=0), types.SimpleNamespace(index=1)]
    pending_xids = [types.SimpleNamespace(device=handles[1], eventType=8, eventData=79)]
    fail_power_once = {"armed": False}

    def count(name):
        calls[name] = calls.get(name, 0) + 1

    def nvmlInit():
        count("init")

    def nvmlShutdown():
        count("shutdown")

    def nvmlDeviceGetMemoryInfo(h):
        return types.SimpleNamespace(used=(20 + h.index) * 2 ** 30, total=80 * 2 ** 30, free=0)

    def nvmlDeviceGetUtilizationRates(h):
        return types.SimpleNamespace(gpu=97 - 40 * h.index, memory=55)

    def nvmlDeviceGetPowerUsage(h):
        if fail_power_once["armed"] and h.index == 0:
            fail_power_once["armed"] = False
            raise NVMLError(999)  # an unknown error: this value is left out, the loop goes on
        return 350_000 + 1000 * h.index

    def nvmlDeviceGetTotalEccErrors(h, kind, counter):
        count(f"ecc{h.index}")
        if h.index == 1:
            raise NVMLError_NotSupported()
        return 2 if kind == nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else 17

    def nvmlDeviceGetRetiredPages(h, cause):
        return ["0x1000"] if cause == 0 else []

    def nvmlDeviceGetRemappedRows(h):
        if h.index == 1:
            raise NVMLError_NotSupported()
        return (1, 0, 0, 0)

    def nvmlDeviceGetNvLinkState(h, link):
        if h.index == 0 and link < 2:
            return 1
        raise NVMLError_NotSupported()

    def nvmlDeviceGetNvLinkErrorCounter(h, link, counter):
        return {0: 5, 1: 0, 2: 1, 3: 2}[counter]

    def nvmlEventSetWait_v2(event_set, timeout_ms):
        if pending_xids:
            return pending_xids.pop()
        raise NVMLError_Timeout()

    nv.nvmlInit, nv.nvmlShutdown = nvmlInit, nvmlShutdown
    nv.nvmlDeviceGetCount = lambda: 2
    nv.nvmlDeviceGetHandleByIndex = lambda i: handles[i]
    nv.nvmlDeviceGetIndex = lambda h: h.index
    nv.nvmlDeviceGetMemoryInfo = nvmlDeviceGetMemoryInfo
    nv.nvmlDeviceGetUtilizationRates = nvmlDeviceGetUtilizationRates
    nv.nvmlDeviceGetTemperature = lambda h, sensor: 61 + h.index
    nv.nvmlDeviceGetPowerUsage = nvmlDeviceGetPowerUsage
    nv.nvmlDeviceGetClockInfo = lambda h, clock: 1980
    nv.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: 0x8 if h.index == 1 else 0
    nv.nvmlDeviceGetTotalEccErrors = nvmlDeviceGetTotalEccErrors
    nv.nvmlDeviceGetRetiredPages = nvmlDeviceGetRetiredPages
    nv.nvmlDeviceGetRetiredPagesPendingStatus = lambda h: 0
    nv.nvmlDeviceGetRemappedRows = nvmlDeviceGetRemappedRows
    nv.nvmlDeviceGetPcieReplayCounter = lambda h: 3 * h.index
    nv.nvmlDeviceGetNvLinkState = nvmlDeviceGetNvLinkState
    nv.nvmlDeviceGetNvLinkErrorCounter = nvmlDeviceGetNvLinkErrorCounter
    nv.nvmlEventSetCreate = lambda: "event-set"
    nv.nvmlDeviceRegisterEvents = lambda h, types_, event_set: None
    nv.nvmlEventSetWait_v2 = nvmlEventSetWait_v2
    nv.nvmlEventSetFree = lambda event_set: count("event_set_free")
    nv.fail_power_once = fail_power_once
    return nv


def test_two_gpus_through_a_fake_nvml(monkeypatch, caplog):
    """Mocked NVML, because no real GPU exists on the machine these tests run on: the fake
    returns fixed numbers for 2 GPUs, one of which answers NotSupported to ECC queries.
    ``test_this_machine_as_it_is`` covers the real library."""
    calls: dict = {}
    fake = _fake_nvml(calls)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    caplog.set_level(logging.INFO, logger="trainguard.node")
    agent = NodeAgent(None, "run-1", host="gpu-node-7", publisher=_Recorder())
    m = agent.collect()

    assert agent.nvml_error is None and agent.gpu_count == 2 and not _nvml_messages(caplog)
    assert m["gpu/utilization_pct[0]"] == 97.0 and m["gpu/utilization_pct[1]"] == 57.0
    assert m["gpu/memory_used_gb[0]"] == 20.0 and m["gpu/memory_used_gb[1]"] == 21.0
    assert m["gpu/memory_total_gb[0]"] == m["gpu/memory_total_gb[1]"] == 80.0
    assert m["gpu/temperature_c[0]"] == 61.0 and m["gpu/temperature_c[1]"] == 62.0
    assert m["gpu/power_w[0]"] == 350.0 and m["gpu/power_w[1]"] == 351.0
    assert m["gpu/ecc_uncorrected[0]"] == 2.0 and m["gpu/ecc_corrected[0]"] == 17.0
    assert "gpu/ecc_uncorrected[1]" not in m and "gpu/ecc_corrected[1]" not in m  # NotSupported: absent
    assert m["gpu/retired_pages_sbe[0]"] == 1.0 and m["gpu/retired_pages_dbe[0]"] == 0.0
    assert m["gpu/remapped_rows_corrected[0]"] == 1.0 and "gpu/remapped_rows_corrected[1]" not in m
    assert m["gpu/pcie_replay_count[0]"] == 0.0 and m["gpu/pcie_replay_count[1]"] == 3.0
    assert m["gpu/nvlink_replay_errors[0]"] == 10.0 and m["gpu/nvlink_crc_errors[0]"] == 6.0  # 2 links
    assert "gpu/nvlink_replay_errors[1]" not in m
    assert m["gpu/xid_errors[0]"] == 0.0 and m["gpu/xid_errors[1]"] == 1.0 and m["gpu/last_xid[1]"] == 79.0
    assert m["gpu/hw_slowdown[0]"] == 0.0 and m["gpu/hw_slowdown[1]"] == 1.0
    assert m["gpu/responding[0]"] == m["gpu/responding[1]"] == 1.0
    assert set(HOST_METRICS) <= set(m)

    ecc1_calls = calls["ecc1"]
    fake.fail_power_once["armed"] = True
    m2 = agent.collect()
    assert calls["ecc1"] == ecc1_calls            # NotSupported is asked once, not every sample
    assert "gpu/power_w[0]" not in m2 and m2["gpu/power_w[1]"] == 351.0  # one read failed, the rest went on
    assert m2["gpu/temperature_c[0]"] == 61.0 and agent.read_errors == 1
    assert m2["gpu/xid_errors[1]"] == 1.0         # cumulative since the agent started
    m3 = agent.collect()
    assert m3["gpu/power_w[0]"] == 350.0          # and it is back on the next sample
    agent.close()
    assert calls["shutdown"] == 1 and calls["event_set_free"] == 1


def test_a_gpu_that_stops_answering_is_reported_not_fatal(monkeypatch):
    """Mocked NVML (no real GPU on this machine): GPU 0 falls off the bus after the first sample."""
    fake = _fake_nvml({})

    def lost(h):
        if h.index == 0:
            raise fake.NVMLError_GpuIsLost()
        return types.SimpleNamespace(used=2 ** 30, total=2 ** 31, free=0)

    monkeypatch.setitem(sys.modules, "pynvml", fake)
    agent = NodeAgent(None, "run-1", publisher=_Recorder())
    assert agent.collect()["gpu/responding[0]"] == 1.0
    fake.nvmlDeviceGetMemoryInfo = lost
    m = agent.collect()
    assert m["gpu/responding[0]"] == 0.0 and "gpu/memory_used_gb[0]" not in m
    assert m["gpu/responding[1]"] == 1.0 and m["gpu/memory_used_gb[1]"] == 1.0
    assert m["gpu/utilization_pct[0]"] == 97.0   # other reads of GPU 0 are still tried


def test_run_publishes_one_event_per_interval_with_a_sample_counter(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml({}))
    rec = _Recorder()
    agent = NodeAgent(None, "run-9", interval_s=0.05, host="h", publisher=rec)
    stop = threading.Event()
    seen = []
    t = threading.Thread(target=agent.run, args=(stop,), kwargs={"on_sample": lambda a, m: seen.append(len(m))})
    t.start()
    deadline = time.monotonic() + 10
    while len(rec.messages) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    t.join(5)
    assert not t.is_alive()
    events = [decode(v) for _, _, v in rec.messages]
    assert [e["step"] for e in events] == list(range(len(events))) and len(events) >= 3
    assert all(k == "run-9" and topic == agent.settings.topics.events for topic, k, _ in rec.messages)
    assert events[0]["source"] == {"kind": "node", "host": "h", "rank": None, "gpu": None}
    assert events[0]["layer"] == "resource" and "gpu/power_w[1]" in events[0]["metrics"]
    assert len(seen) == len(events)


# --------------------------------------------------------------------------- on a real broker


def _read_events(settings, want: int, timeout: float = 30.0) -> list[tuple[bytes, dict]]:
    from trainguard.core.reader import topic_reader

    consumer, _missing = topic_reader(settings, [settings.topics.events])
    try:
        got = []
        deadline = time.monotonic() + timeout
        while len(got) < want and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None or msg.error():
                continue
            got.append((msg.key(), decode(msg.value())))
        return got
    finally:
        consumer.close()


@pytest.mark.integration
def test_agent_publishes_decodable_events_to_kafka(kafka, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _no_nvml_module())
    agent = NodeAgent(kafka, "run-kafka", interval_s=0.2, host="host-k")
    stop = threading.Event()
    started = time.monotonic()
    # two intervals: samples at 0 s and 0.2 s, then stop
    t = threading.Thread(target=agent.run, args=(stop,),
                         kwargs={"on_sample": lambda a, m: a.step >= 2 and stop.set()})
    t.start()
    t.join(20)
    assert time.monotonic() - started >= 0.2
    assert not t.is_alive()
    assert agent.publisher.stats()["pending"] == 0 and agent.publisher.delivery_failed == 0
    got = _read_events(kafka, want=2)
    assert len(got) == 2
    for key, event in got:
        assert key == b"run-kafka"
        assert event["schema"] == "metrics/1" and event["run_id"] == "run-kafka" and event["layer"] == "resource"
        assert event["source"]["kind"] == "node" and event["source"]["host"] == "host-k"
        assert set(HOST_METRICS) <= set(event["metrics"])
    assert sorted(e["step"] for _, e in got) == [0, 1]
    agent.close()


@pytest.mark.integration
def test_cli_once_publishes_one_sample(kafka, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pynvml", _no_nvml_module())
    monkeypatch.setenv("TRAINGUARD_TOPIC_PREFIX", kafka.topics.events.rsplit(".", 1)[0])
    rc = main(["--run-id", "run-cli", "--once", "--bootstrap", kafka.bootstrap, "--host", "cli-host"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "system/cpu_pct" in out and "trainguard node cli-host: no GPUs (NVML unavailable)" in out
    got = _read_events(kafka, want=1)
    assert len(got) == 1 and got[0][1]["run_id"] == "run-cli" and got[0][1]["source"]["host"] == "cli-host"


def test_cli_needs_a_run_id(monkeypatch, capsys):
    monkeypatch.delenv("TRAINGUARD_RUN_ID", raising=False)
    with pytest.raises(SystemExit) as exc:
        main(["--once"])
    assert exc.value.code == 2 and "--run-id" in capsys.readouterr().err


def test_status_line_names_host_gpus_and_counts(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml({}))
    agent = NodeAgent(None, "run-1", host="gpu-node-7", publisher=_Recorder())
    metrics = agent.publish_once()
    line = node_mod._status_line(agent, metrics)
    assert "gpu-node-7" in line and "2 GPU(s)" in line and "events sent 1 (" in line and "lost 0" in line
    assert "pending" not in line and "queued" not in line  # neither reads like a backlog


def test_no_nvml_is_said_on_the_first_status_line_only(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _no_nvml_module())
    agent = NodeAgent(None, "run-1", host="cpu-node", publisher=_Recorder())
    first = node_mod._status_line(agent, agent.publish_once(), first=True)
    later = node_mod._status_line(agent, agent.publish_once(), first=False)
    assert "no GPUs (NVML unavailable)" in first
    assert "NVML" not in later and "GPU" not in later
    assert later.startswith("trainguard node cpu-node: sample 2 (") and "events sent 2 (" in later

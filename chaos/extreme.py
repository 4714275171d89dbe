"""``make chaos``'s ``extreme_values``: one astronomic value per metric blinds no detector.

One rule per registered value detector, at each of its test settings, watches a metric of its own
(``xv/<setting>``). Four runs log the same values side by side, one metric per detector: normal ones,
then after ``GAP`` steps the anomaly that detector catches (its own kind, calibrated offline on normal
data: ``tests/test_extreme_values.py``). The control run has nothing else; each of the other three has
one extreme value in every metric (fp32's maximum at the first step, 1e308 once the detectors are
ready, -1e308 at the first step). The worker is killed with -9 after the extreme values and started
again, so what it learned from them comes back through its changelog. A detector is blinded when its
rule fires on the control run's anomaly and not on one of the others'.

The same events run through ``Engine`` in the tests (``blinded_through_engine``), without a broker.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import yaml

from tests.test_detectors import detector_settings
from tests.test_extreme_values import FP32_MAX, ONSET, PREFIX, SHAPE_LEN, own_kinds, sequence
from trainguard.schemas import events as ev

RUNS = {"control": None, "fp32-first": (FP32_MAX, 0), "1e308-ready": (1e308, PREFIX - 1), "-1e308-first": (-1e308, 0)}
PROXY = "reward"  # read as reward_mean: the trained-on reward a detector of two signals is paired with
RESTART_AT = PREFIX + 20  # steps logged before the worker is killed and started again


def rule_name(setting: str) -> str:
    return "xv_" + setting.replace("-", "_")


def rules_text() -> str:
    """The rules file: one rule per detector setting, each on its own metric, firing once per episode."""
    rules = []
    for setting, (cls, params) in detector_settings().items():
        rule = {"name": rule_name(setting), "metric": f"xv/{setting}", "unmapped": True,
                "detector": {"kind": cls.kind, **params}, "severity": "P2", "keep_firing_for": 1,
                "flap_episodes": 1000, "summary": f"{setting} flagged its metric",
                "diagnosis": "An anomaly of the kind this detector judges.", "suggestion": "None: a chaos check."}
        if hasattr(cls, "pair"):
            rule["paired"] = "reward_mean"
        rules.append(rule)
    return yaml.safe_dump({"version": 1, "rules": rules}, sort_keys=False)


def events(run_id: str, t0: float) -> list[dict]:
    """The run's metrics events, one a step: every detector's series side by side, and the proxy."""
    extreme, position = RUNS[run_id.rsplit(":", 1)[-1]] or (None, 0)
    series = {setting: sequence(own_kinds(setting, 0)[0], 0, extreme, position) for setting in detector_settings()}
    src = ev.source("trainer", "chaos-xv", 0)
    out = []
    for step in range(ONSET + SHAPE_LEN):
        metrics = {f"xv/{setting}": values[step][0] for setting, values in series.items()}
        metrics[PROXY] = next(iter(series.values()))[step][1]  # the proxy is the same in every series
        out.append(ev.metrics_event(run_id, step, metrics, src=src, ts=t0 + step))
    return out


def verdict(alerts: list[dict], prefix: str) -> dict:
    """Figures from the firing alerts of the runs named ``prefix + run``: the settings whose rule fired
    on the control run's anomaly, and those of them that did not on a run with an extreme value."""
    fired: dict[str, set[str]] = {run: set() for run in RUNS}
    for a in alerts:
        run = a.get("run_id", "")[len(prefix):]
        if a.get("status") == "firing" and run in fired and (a.get("step") or 0) >= ONSET:
            fired[run].add(a.get("rule"))
    settings = {rule_name(s): s for s in detector_settings()}
    checked = {settings[r] for r in fired["control"] if r in settings}
    blinded = {run: sorted(settings[r] for r in {rule_name(s) for s in checked} - got)
               for run, got in fired.items() if run != "control"}
    return {"extreme_value_detectors": len(settings), "extreme_value_detectors_checked": len(checked),
            "extreme_value_detectors_unchecked": sorted(set(settings.values()) - checked),
            "extreme_value_blinded_detectors": len({s for names in blinded.values() for s in names}),
            "extreme_value_blinded": blinded}


def blinded_through_engine() -> dict:
    """``verdict`` of the runs through the worker's ``Engine`` (no broker), a restart through its saved
    state included: what ``extreme_values`` measures end to end."""
    from trainguard.streams import rules as rules_mod
    from trainguard.streams.engine import Engine

    ruleset = rules_mod.parse(rules_text())
    engine, alerts, offset = Engine(ruleset), [], 0
    runs = {run: events(f"xv:{run}", time.time() - ONSET - SHAPE_LEN) for run in RUNS}
    for step in range(ONSET + SHAPE_LEN):
        if step == RESTART_AT:
            engine = _restored(engine, ruleset)
        for run_events in runs.values():
            for out in engine.handle(ev.encode(run_events[step]), 0, offset) or ():
                if isinstance(getattr(out, "value", None), dict):
                    alerts.append(out.value)
            offset += 1
    return verdict(alerts, "xv:")


def _restored(engine, ruleset):
    """A new engine whose state is what the old one writes to the changelog, read back."""
    from trainguard.streams.engine import Engine

    return Engine(ruleset, {key: engine.serialize(key) for key in engine.store})


def extreme_values(log_dir=None) -> dict:
    """The runs through a real worker on the broker ``make chaos`` gives (its cluster, or an embedded
    one), the worker killed with -9 after the extreme values and started again."""
    import signal
    import tempfile

    from confluent_kafka import Consumer, Producer, TopicPartition

    from chaos.scenarios import _settings, broker_on
    from tests.integration import TopicReader, WorkerProcess
    from trainguard.broker import free_port
    from trainguard.core.admin import create_topics

    port = free_port()
    settings = _settings(port)
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="chaos-"))
    rules_path = log_dir / "extreme-values.yaml"
    rules_path.write_text(rules_text(), encoding="utf-8")
    prefix = f"xv-{uuid.uuid4().hex[:6]}:"
    runs = {f"{prefix}{run}": events(f"{prefix}{run}", time.time() - ONSET - SHAPE_LEN) for run in RUNS}
    with broker_on(port):
        create_topics(settings)
        app_id = f"chaos-xv-{uuid.uuid4().hex[:6]}"
        worker = WorkerProcess(settings, log_dir, app_id=app_id, rules_path=rules_path).start()
        alerts = TopicReader(settings, settings.topics.alerts)
        producer = Producer(settings.confluent(**{"partitioner": "murmur2_random", "log_level": 0}))

        def send(steps: range) -> None:
            for step in steps:
                for run_id, run_events in runs.items():
                    producer.produce(settings.topics.events, ev.encode(run_events[step]), run_id)
                producer.poll(0)
            producer.flush(30)

        try:
            worker.wait_ready()
            send(range(RESTART_AT))
            committed = _wait_committed(settings, app_id, Consumer, TopicPartition)
            worker.kill(signal.SIGKILL)
            worker = WorkerProcess(settings, log_dir, app_id=app_id, rules_path=rules_path).start()
            worker.wait_ready()
            send(range(RESTART_AT, ONSET + SHAPE_LEN))
            expected = len(detector_settings())
            try:
                alerts.wait_for(lambda _: sum(1 for a in alerts.seen if a.get("run_id") == f"{prefix}control"
                                              and (a.get("step") or 0) >= ONSET) >= expected,
                                timeout=90, what="the control run's anomalies", worker=worker)
            except AssertionError:
                pass
            time.sleep(5)  # the other runs' alerts, interleaved with the control's
            seen = list(alerts.seen) + list(alerts.drain())
        finally:
            alerts.close()
            worker.kill()
    return {**verdict(seen, prefix), "extreme_value_restart_after_commit": committed}


def _wait_committed(settings, group: str, Consumer, TopicPartition, timeout: float = 90.0) -> bool:
    """Until the worker's group has committed every event sent so far (its state then in the changelog):
    whether it did within ``timeout``."""
    from chaos.scenarios import _committed

    c = Consumer(settings.confluent(**{"group.id": uuid.uuid4().hex, "log_level": 0}))
    try:
        ends = {p: c.get_watermark_offsets(TopicPartition(settings.topics.events, p), timeout=10)[1]
                for p in range(settings.partitions)}
    finally:
        c.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_committed(settings, group, settings.topics.events, p) >= end for p, end in ends.items() if end > 0):
            return True
        time.sleep(1.0)
    return False

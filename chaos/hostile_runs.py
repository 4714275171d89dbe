"""Attacks on one run by anyone who can write to the events topic, with no key, against a real
worker holding the secret and the README loop (``TrainerLogger`` and ``ControlListener`` with
the run's own trainer key) as the victim:

- ``cross_partition``: one event of each victim run written to another partition, past 200 events
  there, so its offset is past all of the victim's own; one victim's loss turns NaN before the
  worker is killed and restarted, the other's after. ``cross_partition_blinded_runs``: victims
  whose NaN was not paged or not rolled back (target 0).
- ``oversize``: four node events of the victim run, 256 names of 256 control characters each
  (six bytes apiece in JSON) from hosts named the same way, then its NaN.
  ``oversize_alerts_lost``: its P0 alert, its report or its rollback missing, plus its outputs
  dead-lettered as too large and its state left out of the changelog (target 0).

The invented-runs figure is ``chaos/scenarios.py: tiny_runs`` at 1, 4 and 20 events a run.
"""

from __future__ import annotations

import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import orjson

from chaos.scenarios import _applied_until, _environment, _settings, broker_on
from trainguard.broker import free_port
from trainguard.core.admin import create_topics
from trainguard.core.kafka import partition_for
from trainguard.producers.control import ControlListener
from trainguard.producers.trainer import TrainerLogger
from trainguard.schemas import events as ev
from trainguard.schemas.signing import Keyring, Scope, SigningKey, exports, new_key_line

HEALTHY = {"actor/pg_loss": -0.01, "actor/kl_loss": 0.001}


class _Victim:
    """One run of the README loop: its logger and listener, with its own trainer key only."""

    def __init__(self, settings, master: SigningKey, run_id: str):
        self.run_id = run_id
        env = {k: v.strip("'") for k, _, v in (e.removeprefix("export ").partition("=")
                                               for e in exports(master, "trainer", Scope.run(run_id)))}
        # The trainer side reads its key once per run, on first use: here, inside its environment.
        with _environment(**env):
            self.logger = TrainerLogger(run_id, settings, host="chaos")
            self.listener = ControlListener(run_id, settings, keys=Keyring.from_env().command_keys(),
                                            publisher=self.logger.publisher).start()
            self.listener.wait_ready(10)
            self.logger.lifecycle("started", step=0)
            for step in range(1, 21):
                self.logger.log(HEALTHY, step)
            self.logger.checkpoint_saved(20, f"/ckpt/{run_id}/global_step_20")
            self.logger.publisher.flush(10)

    def nan(self, step: int = 25) -> None:
        for s in range(21, step):
            self.logger.log(HEALTHY, s)
        self.logger.log({**HEALTHY, "actor/pg_loss": float("nan")}, step)
        self.logger.publisher.flush(10)

    def rolled_back(self, seconds: float = 60.0) -> int:
        """1 once the listener applied a rollback of this run (acked and reported back), else 0."""
        applied, _ = _applied_until(self.listener, {"never"}, 0.0)
        deadline = time.monotonic() + seconds
        while not any(c["action"] == "rollback" for c in applied) and time.monotonic() < deadline:
            more, _ = _applied_until(self.listener, {"never"}, 1.0)
            applied += more
        for command in applied:
            if command["action"] == "rollback":
                self.logger.lifecycle("rolled_back", step=command["target"]["step"],
                                      detail={"command_id": command["id"]})
                self.logger.publisher.flush(10)
                return 1
        return 0

    def close(self) -> None:
        self.listener.close()
        self.logger.close(5, quiet=True)


def _paged(alerts, run_id: str, rule: str = "non_finite", seconds: float = 60.0) -> dict | None:
    try:
        return alerts.wait_for(lambda a: a.get("run_id") == run_id and a.get("rule") == rule
                               and a.get("status") == "firing", timeout=seconds, what=f"{run_id}'s {rule}")
    except AssertionError:
        return None


def _keyed_worker(settings, log_dir: Path, line: str, app_id: str | None = None):
    """A worker holding the secret ``line``."""
    from tests.integration import WorkerProcess

    return WorkerProcess(settings, log_dir, app_id=app_id, extra_env={"TRAINGUARD_COMMAND_KEY": line}).start()


def _secret() -> tuple[str, SigningKey]:
    line = new_key_line("chaos")
    key_id, secret = line.split(":", 1)
    return line, SigningKey(key_id, secret.encode())


@contextmanager
def broker_for(settings):
    """The scenario's settings on a broker: its own (embedded, or ``make chaos``'s cluster), or the
    one ``settings`` name (a test's), its topics made where they are missing."""
    if settings is not None:
        create_topics(settings)
        yield settings
        return
    port = free_port()
    settings = _settings(port)
    with broker_on(port):
        create_topics(settings)
        yield settings


def cross_partition(log_dir=None, fillers: int = 200, settings=None) -> dict:
    from confluent_kafka import Producer

    from tests.integration import TopicReader

    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="chaos-"))
    tag = uuid.uuid4().hex[:6]
    runs = {"before_restart": f"chaos-xpart-a-{tag}", "after_restart": f"chaos-xpart-b-{tag}"}
    victims: dict[str, _Victim] = {}
    found: dict[str, dict] = {}
    with broker_for(settings) as settings, _environment(TRAINGUARD_COMMAND_KEY="", TRAINGUARD_COMMAND_KEY_FILE=""):
        line, master = _secret()
        worker = _keyed_worker(settings, log_dir, line)
        second = None
        n = settings.partitions
        alerts = TopicReader(settings, settings.topics.alerts)
        control = TopicReader(settings, settings.topics.control)
        dlq = TopicReader(settings, settings.topics.dlq, decode=orjson.loads)
        attacker = Producer(settings.confluent(**{"partitioner": "murmur2_random", "log_level": 0}))
        try:
            worker.wait_ready()
            for when, run_id in runs.items():
                victims[when] = _Victim(settings, master, run_id)
            src = ev.source("trainer", "chaos", 0)
            for run_id in runs.values():  # the attack: no key, another partition, offsets past the run's own
                other = (partition_for(run_id, n) + 1) % n
                filler = next(f"filler-{tag}-{i}" for i in range(100_000)
                              if partition_for(f"filler-{tag}-{i}", n) == other)
                for step in range(fillers):
                    attacker.produce(settings.topics.events, ev.encode(ev.metrics_event(filler, step, HEALTHY,
                                                                                        src=src)), filler,
                                     partition=other)
                attacker.produce(settings.topics.events, ev.encode(ev.metrics_event(run_id, 21, HEALTHY, src=src)),
                                 run_id, partition=other)
            attacker.flush(10)
            dead = 0
            for run_id in runs.values():
                try:
                    dlq.wait_for(lambda r, run_id=run_id: f"run {run_id!r} belongs on partition" in r.get("reason", ""),
                                 timeout=60, what="the misplaced event's dead letter")
                    dead += 1
                except AssertionError:
                    pass
            victim = victims["before_restart"]
            victim.nan()
            found["before_restart"] = {"paged": _paged(alerts, victim.run_id) is not None,
                                       "rolled_back": victim.rolled_back()}
            time.sleep(3)  # its state and offsets, the misplaced events' included, are written and committed
            worker.kill()
            second = _keyed_worker(settings, log_dir, line, app_id=worker.app_id).wait_ready()
            victim = victims["after_restart"]
            victim.nan()
            found["after_restart"] = {"paged": _paged(alerts, victim.run_id) is not None,
                                      "rolled_back": victim.rolled_back()}
            commands = [c for c in control.drain(1.0) if c.get("run_id") in runs.values()]
        finally:
            for v in victims.values():
                v.close()
            for reader in (alerts, control, dlq):
                reader.close()
            worker.kill()
            if second is not None:
                second.kill()
    blinded = sum(1 for f in found.values() if not (f["paged"] and f["rolled_back"]))
    return {"victims": len(runs), "cross_partition_blinded_runs": blinded + len(runs) - len(found),
            "misplaced_dead_letters": dead, "filler_events_per_partition": fillers,
            "commands": len(commands), **{f"{when}_{k}": v for when, f in found.items() for k, v in f.items()}}


def oversize(log_dir=None, hosts: int = 4, settings=None) -> dict:
    from confluent_kafka import Producer

    from tests.integration import TopicReader

    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="chaos-"))
    run_id = f"chaos-oversize-{uuid.uuid4().hex[:6]}"
    with broker_for(settings) as settings, _environment(TRAINGUARD_COMMAND_KEY="", TRAINGUARD_COMMAND_KEY_FILE=""):
        line, master = _secret()
        worker = _keyed_worker(settings, log_dir, line)
        alerts = TopicReader(settings, settings.topics.alerts)
        dlq = TopicReader(settings, settings.topics.dlq, decode=orjson.loads)
        attacker = Producer(settings.confluent(**{"partitioner": "murmur2_random", "log_level": 0,
                                                  "message.max.bytes": 2_000_000}))
        victim = None
        try:
            worker.wait_ready()
            victim = _Victim(settings, master, run_id)
            for h in range(hosts):
                metrics = {f"{h:02d}{i:03d}" + "\x01" * 251: 1.0 for i in range(256)}
                host = f"{h:02d}" + "\x02" * 254
                attacker.produce(settings.topics.events, ev.encode(ev.metrics_event(
                    run_id, 21, metrics, src=ev.source("node", host))), run_id)
            attacker.flush(10)
            time.sleep(2)
            victim.nan()
            alert = _paged(alerts, run_id)
            try:
                report = alerts.wait_for(lambda a: a.get("schema") == ev.REPORT and a.get("run_id") == run_id,
                                         timeout=60, what="the report")
            except AssertionError:
                report = None
            rolled_back = victim.rolled_back()
            time.sleep(3)  # a flush of the state after the NaN
            too_large = [r for r in dlq.drain(1.0) if "message limit" in r.get("reason", "")]
            unwritten = worker.log().count("left out of the changelog")
        finally:
            if victim is not None:
                victim.close()
            for reader in (alerts, dlq):
                reader.close()
            worker.kill()
    sizes = {k: len(orjson.dumps(v)) for k, v in (("alert", alert), ("report", report)) if v is not None}
    lost = int(alert is None or alert.get("severity") != "P0") + int(report is None) + int(not rolled_back)
    return {"hostile_node_events": hosts, "oversize_alerts_lost": lost + len(too_large) + unwritten,
            "alert_bytes": sizes.get("alert"), "report_bytes": sizes.get("report"),
            "rolled_back": rolled_back, "dead_lettered_as_too_large": len(too_large),
            "state_records_unwritten": unwritten,
            "snapshot_cut_said": bool(alert and all("cut" in h for h in (alert.get("node_snapshot") or {}).values()))}

"""Who may steer a run, end to end: a real worker holding the secret, the README's loop as the
victim (holding only its part of the keys), and a forger with write access to the events topic.

- ``unsigned_metric_commands``: forged metrics (no key, or a node agent's key) the breaker once
  acted on: 4 events (a finite value, then 3 NaNs) stopped a run with no checkpoint; 8 made a run
  with checkpoints roll back again and again. Counts the commands the worker signed on them
  (target 0), and checks the run's own NaN still rolls it back.
- ``scope_forgeries_accepted``: a run id that is a pattern (``*``, ``exp*``) gets no per-run key,
  and keys a forger can hold (an old untyped ``exp*`` key, its own run's key with another scope
  claimed, another run's key) speak for no other run. Counts the forgeries the worker took (target 0).

Each takes ``settings`` of a running broker (the tests' Apache Kafka) or starts its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import io
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path

import orjson

from chaos.hostile_runs import broker_for
from chaos.scenarios import _environment
from trainguard.core.kafka import KafkaSettings
from trainguard.schemas import events as ev
from trainguard.schemas.signing import (
    NODE,
    Scope,
    SigningKey,
    canonical_bytes,
    exports,
    new_key_line,
    signed_bytes,
)

NAN = float("nan")
TOTAL_STEPS = 120  # the README loop's run: 4 s of steps after its own NaN at batch 40 for the rollback to arrive


def _trainer_env(master: SigningKey, scope: Scope) -> dict:
    """The trainer's part of the keys, as its exports give it, and no secret."""
    lines = exports(master, "trainer", scope)
    return {k: v.strip("'") for k, _, v in (e.removeprefix("export ").partition("=") for e in lines)}


def _forged_steps(run_id: str, first: int, values: list[float], src: dict) -> list[dict]:
    """What the forger writes: the victim's own metric names and source, its next steps."""
    return [ev.metrics_event(run_id, step, {"actor/pg_loss": v, "actor/grad_norm": 0.5}, src=src)
            for step, v in enumerate(values, first)]


def unsigned_metric_commands(settings: KafkaSettings | None = None, log_dir=None) -> dict:
    """The README's loop trains with keys; while it waits at a step boundary (no checkpoint yet,
    then two checkpoints), a forger writes its next steps: the stop attack (a finite value, 3
    NaNs) and the rollback loop (that, twice), unsigned and again signed with a node agent's key
    (a node agent claiming to be the trainer), and as a node's own samples. Then the loop's own
    batch 40 turns it NaN: the rollback goes to the checkpoint saved meanwhile."""
    from confluent_kafka import Producer

    from tests.integration import TopicReader, WorkerProcess
    from tests.test_readme_loop import ToyTrainer, run_readme_loop
    from trainguard.producers import control

    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="chaos-"))
    run_id = f"chaos-steer-{uuid.uuid4().hex[:6]}"
    line = new_key_line("chaos")
    key_id, secret = line.split(":", 1)
    master = SigningKey(key_id, secret.encode())
    node_key = master.trainer_key(Scope.prefix(""), NODE)  # any node agent of the cluster
    victim = ev.source("trainer", socket.gethostname(), 0)  # what the loop's logger says it is
    gates = {5: threading.Event(), 25: threading.Event()}   # batches the loop waits before
    reached = {b: threading.Event() for b in gates}

    class GatedToy(ToyTrainer):
        def train_one_step(self, batch: int) -> dict:
            if batch in gates and not gates[batch].is_set():
                reached[batch].set()
                gates[batch].wait(240)
            return super().train_one_step(batch)

    with broker_for(settings) as settings:
        env = {"TRAINGUARD_BOOTSTRAP": settings.bootstrap, "TRAINGUARD_PARTITIONS": str(settings.partitions),
               "TRAINGUARD_TOPIC_PREFIX": settings.topics.events.rsplit(".", 1)[0],
               "TRAINGUARD_COMMAND_KEY": "", "TRAINGUARD_COMMAND_KEY_FILE": "", "TRAINGUARD_ALLOW_UNSIGNED": "",
               **_trainer_env(master, Scope.run(run_id))}
        with _environment(**env):
            control._TRAINER_KEYS.pop(run_id, None)
            worker = WorkerProcess(settings, log_dir, extra_env={"TRAINGUARD_COMMAND_KEY": line}).start()
            forger = Producer(settings.confluent(**{"partitioner": "murmur2_random", "log_level": 0}))
            commands = TopicReader(settings, settings.topics.control)
            alerts = TopicReader(settings, settings.topics.alerts)
            toy = GatedToy(poisoned={40}, ckpt_dir=log_dir / f"{run_id}-ckpt")
            namespace = toy.namespace(total_steps=TOTAL_STEPS)
            loop = threading.Thread(target=run_readme_loop, args=(namespace, run_id), daemon=True)
            forged_commands, phases = [], {}
            try:
                worker.wait_ready()
                loop.start()
                for batch, values in ((5, [0.5, NAN, NAN, NAN]), (25, [0.5, NAN, NAN, NAN] * 2)):
                    assert reached[batch].wait(120), f"the loop never reached batch {batch}"
                    # The trainer's own identity, then its rank 1's (alerts of their own, not one
                    # still open); unsigned, and signed by a node agent claiming to be the trainer;
                    # and a node's own samples, unsigned.
                    trainer_like = victim if batch == 5 else {**victim, "rank": 1}
                    node_like = ev.source("node", f"forged-{batch}")
                    sent = 0
                    for key, as_who in ((None, trainer_like), (node_key, trainer_like), (None, node_like)):
                        for event in _forged_steps(run_id, batch + 1, values, as_who):
                            forger.produce(settings.topics.events, signed_bytes(event, key), run_id)
                            sent += 1
                    forger.flush(10)
                    seen: set = set()

                    def marked(a, batch=batch, seen=seen):
                        if a["run_id"] == run_id and a.get("status") == "firing" and a.get("step", 0) > batch \
                                and a.get("authority") == "unauthenticated":
                            seen.add((a.get("source") or {}).get("kind"))
                        return {"trainer", "node"} <= seen

                    alerts.wait_for(marked, timeout=60, what=f"the forged alerts after batch {batch}", worker=worker)
                    time.sleep(3.0)  # a command would follow its alert within a step: give it ample time
                    forged_commands += [c for c in commands.drain(1.0) if c["run_id"] == run_id]
                    phases[batch] = sent
                    gates[batch].set()
                loop.join(120)
                rollback = commands.wait_for(lambda c: c["run_id"] == run_id and c["action"] == "rollback",
                                             timeout=30, what="the loop's own rollback", worker=worker)
                ours = [a for a in alerts.drain(2.0) if a["run_id"] == run_id and a.get("status") == "firing"]
            finally:
                for gate in gates.values():
                    gate.set()
                commands.close()
                alerts.close()
                worker.kill()
                control._TRAINER_KEYS.pop(run_id, None)
    forged = [a for a in ours if a.get("authority") == "unauthenticated"]
    unmarked = [a for a in forged if not (a["summary"].startswith("Unauthenticated") and "sends no command"
                                          in a["diagnosis"])]
    return {"unsigned_metric_commands": len(forged_commands),
            "forged_commands": sorted({c["action"] for c in forged_commands}),
            "forged_events": sum(phases.values()),
            "unauthenticated_alerts": len(forged),
            "unauthenticated_node_alerts": sum(1 for a in forged if (a.get("source") or {}).get("kind") == "node"),
            "unmarked_unauthenticated_alerts": len(unmarked),
            "genuine_rollback_target": rollback["target"]["step"],
            "genuine_rollback_applied": int(any(p.endswith("global_step_40.json") for p in toy.loaded)),
            "loop_stopped": int(bool(namespace.get("stop"))), "loop_ended_at": namespace.get("step")}


def _mac_as(event: dict, key_id: str, secret: bytes, claimed_scope: str) -> bytes:
    """``event`` MACed with ``secret``, its signature claiming ``claimed_scope``."""
    mac = hmac.new(secret, canonical_bytes(event), hashlib.sha256).hexdigest()
    return ev.encode({**event, "signature": {"key_id": key_id, "scope": claimed_scope, "mac": mac}})


def scope_forgeries_accepted(settings: KafkaSettings | None = None, log_dir=None) -> dict:
    """A victim run (``exp-victim-…``, a trainer with its own key) logs and saves a checkpoint; a
    forger holds what it could: per-run keys asked for runs named ``*`` and ``exp*`` (refused at
    issue: counted if one is made), old untyped ``exp*`` and ``*`` keys, and its own run's key
    (``exp-mine``), as it is and with ``prefix:exp`` claimed. With each it sends what steers a run
    (started, finished, rolled_back, a checkpoint to its own path; a failed ack of the victim's
    pending rollback) and NaN metrics. Counts what the worker took (target 0) and checks that the
    victim's own events are taken."""
    from confluent_kafka import Producer

    from tests.integration import TopicReader, WorkerProcess
    from trainguard.operate import read_statuses
    from trainguard.producers import control
    from trainguard.producers.trainer import TrainerLogger
    from trainguard.schemas.signing import main as key_command

    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="chaos-"))
    tag = uuid.uuid4().hex[:6]
    victim_run, mine = f"exp-victim-{tag}", f"exp-mine-{tag}"
    line = new_key_line("chaos")
    key_id, secret = line.split(":", 1)
    master = SigningKey(key_id, secret.encode())

    issued = 0  # per-run keys for a pattern that were handed out anyway
    for pattern in ("*", "exp*"):
        said = io.StringIO()
        with _environment(TRAINGUARD_COMMAND_KEY=line), contextlib.redirect_stderr(said), \
                contextlib.redirect_stdout(said):
            try:
                issued += int(key_command(["trainer", "--run", pattern]) == 0)
            except SystemExit:
                pass
        try:
            master.trainer_key(pattern)
            issued += 1
        except ValueError:
            pass

    own = master.trainer_key(mine).secret
    held = {  # what the forger signs with, and the scope its signature claims
        "an old untyped exp* key": (master.derive("trainer:exp*"), "exp*"),
        "an old untyped * key": (master.derive("trainer:*"), "*"),
        "its own run's key, a prefix claimed": (own, "prefix:exp"),
        "its own run's key": (own, f"run:{mine}")}
    src = ev.source("trainer", "forger", 0)
    with broker_for(settings) as settings:
        env = {"TRAINGUARD_BOOTSTRAP": settings.bootstrap, "TRAINGUARD_PARTITIONS": str(settings.partitions),
               "TRAINGUARD_TOPIC_PREFIX": settings.topics.events.rsplit(".", 1)[0],
               "TRAINGUARD_COMMAND_KEY": "", "TRAINGUARD_COMMAND_KEY_FILE": "", "TRAINGUARD_ALLOW_UNSIGNED": "",
               **_trainer_env(master, Scope.run(victim_run))}
        with _environment(**env):
            control._TRAINER_KEYS.pop(victim_run, None)
            worker = WorkerProcess(settings, log_dir, extra_env={"TRAINGUARD_COMMAND_KEY": line}).start()
            forger = Producer(settings.confluent(**{"partitioner": "murmur2_random", "log_level": 0}))
            dlq = TopicReader(settings, settings.topics.dlq, decode=orjson.loads)
            commands = TopicReader(settings, settings.topics.control)
            alerts = TopicReader(settings, settings.topics.alerts)
            logger = TrainerLogger(victim_run, settings, host="victim")
            try:
                worker.wait_ready()
                for step in range(1, 21):
                    logger.log({"actor/pg_loss": -0.01, "actor/kl_loss": 0.001}, step)
                logger.checkpoint_saved(20, f"/ckpt/{victim_run}/global_step_20")
                logger.publisher.flush(10)
                sent = 0
                for secret_held, claimed in held.values():
                    for event in (ev.lifecycle_event(victim_run, "finished", step=21, src=src),
                                  ev.lifecycle_event(victim_run, "started", step=0, src=src),
                                  ev.lifecycle_event(victim_run, "rolled_back", step=3, src=src),
                                  ev.checkpoint_event(victim_run, 21, "/tmp/forger/weights.pt", src=src)):
                        forger.produce(settings.topics.events, _mac_as(event, key_id, secret_held, claimed),
                                       victim_run)
                        sent += 1
                    for event in _forged_steps(victim_run, 21, [0.5, NAN, NAN, NAN], src):
                        forger.produce(settings.topics.events, _mac_as(event, key_id, secret_held, claimed),
                                       victim_run)
                forger.flush(10)

                def refused(record: dict) -> bool:
                    return record.get("reason", "").startswith("refused") and victim_run in record.get("raw_text", "")

                def refusals(wanted: int):
                    return lambda _record: sum(1 for r in dlq.seen if refused(r)) >= wanted

                with contextlib.suppress(AssertionError):  # a missing refusal is counted below, not raised
                    dlq.wait_for(refusals(sent), timeout=60, what="the events' refusals", worker=worker)
                # The victim's own: its steps go on healthy, then its NaN rolls it back to its checkpoint.
                for step in range(21, 26):
                    logger.log({"actor/pg_loss": -0.01, "actor/kl_loss": 0.001}, step)
                logger.log({"actor/pg_loss": NAN, "actor/kl_loss": 0.001}, 26)
                logger.publisher.flush(10)
                rollback = commands.wait_for(lambda c: c["run_id"] == victim_run and c["action"] == "rollback",
                                             timeout=60, what="the victim's own rollback", worker=worker)
                # With the pending rollback's id (read off the control topic): a failed ack would
                # re-arm the breaker, and with on_command_failure: stop, stop the run.
                for secret_held, claimed in held.values():
                    forged_ack = ev.ack_event(rollback["id"], victim_run, "failed", "forged: disk full")
                    forger.produce(settings.topics.acks, _mac_as(forged_ack, key_id, secret_held, claimed), victim_run)
                    sent += 1
                forger.flush(10)
                with contextlib.suppress(AssertionError):
                    dlq.wait_for(refusals(sent), timeout=60, what="every refusal", worker=worker)
                dead = [r for r in dlq.drain(1.0) if refused(r)]
                sent_commands = [c for c in commands.drain(1.0) if c["run_id"] == victim_run]
                victim_alerts = [a for a in alerts.drain(1.0) if a["run_id"] == victim_run]
                status = read_statuses(settings).get(victim_run) or {}
            finally:
                for reader in (dlq, commands, alerts):
                    reader.close()
                logger.close(5, quiet=True)
                worker.kill()
                control._TRAINER_KEYS.pop(victim_run, None)
    forged_metrics_steered = sum(1 for c in sent_commands if c["id"] != rollback["id"]) + sum(
        1 for a in victim_alerts if a.get("authority") == "trainer" and a.get("step", 0) in (22, 23, 24))
    effects = {
        "pattern_keys_issued": issued,
        "steering_forgeries_taken": max(0, sent - len(dead)),
        "forged_metrics_steered": forged_metrics_steered,
        "victim_finished": int(bool(status.get("finished"))),
        "rollback_to_forged_path": int(rollback["target"]["path"] != f"/ckpt/{victim_run}/global_step_20"),
        "forged_acks_taken": sum(1 for a in victim_alerts if a.get("rule") == "command_failed"),
    }
    return {**effects, "scope_forgeries_accepted": sum(effects.values()), "forgeries_sent": sent + 4 * len(held),
            "refused_dead_letters": len(dead), "genuine_rollback": int(rollback["target"]["step"] == 20)}

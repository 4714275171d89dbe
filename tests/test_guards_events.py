"""The guards' decisions as events: published through the trainer's own logger to a real
broker, read back from the topic, and judged by the engine with the default rules."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tests.integration import TopicReader
from trainguard.producers.guards import (
    CheckpointError,
    CircuitBreaker,
    RewardGate,
    RolloutValidator,
    check_checkpoint,
    write_manifest,
)
from trainguard.producers.trainer import TrainerLogger
from trainguard.schemas import events as ev
from trainguard.streams import rules as rules_mod
from trainguard.streams.engine import Engine, OutputKind

pytestmark = pytest.mark.integration


def test_guard_decisions_reach_the_topic_and_the_default_rules_alert_on_them(kafka, tmp_path):
    run_id = "guards-events"
    logger = TrainerLogger(run_id, kafka, host="h")
    rng = np.random.default_rng(0)
    gate = RewardGate(events=logger)
    rollouts = RolloutValidator(max_tokens=None, events=logger)
    hang, release = threading.Event(), threading.Event()

    def reward_model(batch):
        if hang.is_set():
            release.wait(30)
        return [1.0] * len(batch)

    breaker = CircuitBreaker(reward_model, name="rm", timeout_s=0.2, failure_threshold=2, reset_after_s=0.0,
                             fallback=lambda batch: [0.0] * len(batch), events=logger)
    try:
        for step in range(1, 21):
            logger.log({"actor/pg_loss": 0.1, "critic/score/mean": 0.4}, step=step)
            hang.set() if step == 8 else hang.clear() if step == 10 else None
            breaker.at_step(step)(["a", "b"])
            rewards = rng.binomial(1, 0.4, 64) + rng.choice([0.1, -0.1], 64)
            if step == 13:
                rewards[:6] = 10.0                                   # a reward hack's payoff
            gate.check(rewards, step=step)
            rollouts.filter(["fine", "", "\x00"] if step == 15 else ["fine", "also fine"], step=step)
        with pytest.raises(CheckpointError, match="checkpoint manifest missing"):
            check_checkpoint(tmp_path, events=logger, step=20)
        logger.log({"actor/pg_loss": 0.1, "critic/score/mean": 0.4}, step=21)
        whole = tmp_path / "checkpoint-21"
        whole.mkdir()
        for part in ("model.pt", "optimizer.pt"):
            (whole / part).write_bytes(b"weights")
        write_manifest(whole, parts={"parameters": "model.pt", "optimizer": "optimizer.pt"}, events=logger,
                       meta={"step": 21, "scheduler_step": 21, "rng_seeds": {}, "dataset_offset": 21})
    finally:
        release.set()
    stats = logger.close()
    assert stats["lost"] == 0

    raws: list[bytes] = []
    reader = TopicReader(kafka, kafka.topics.events, decode=lambda raw: (raws.append(raw), ev.decode(raw))[1])
    reader.wait_for(lambda e: e["schema"] == ev.LIFECYCLE and e["event"] == "finished", what="the run's end")
    guard = [e for e in reader.seen if e["schema"] == ev.METRICS and e["source"]["kind"] == "guard"]
    assert {e["source"]["host"] for e in guard} == {"h"}
    decisions = [(e["tags"]["guard"], e["tags"].get("decision"), e["step"]) for e in guard]
    assert ("rm", "open", 9) in decisions and ("rm", "closed", 10) in decisions
    assert ("reward_gate", "held", 13) in decisions and ("rollout", "dropped", 15) in decisions
    assert ("checkpoint", "refused", 20) in decisions
    held = next(e for e in guard if e["tags"].get("decision") == "held")
    assert held["tags"]["reason"] == "variance,extremes" and held["metrics"]["guard/reward_gate/held"] == 1.0
    # the trainer's own steps are untouched: one event per step from the trainer
    assert [e["step"] for e in reader.seen if e["schema"] == ev.METRICS
            and e["source"]["kind"] == "trainer"] == list(range(1, 22))

    engine = Engine(rules_mod.default())
    alerts = [o.value for raw in raws for o in engine.handle(raw) if o.kind is OutputKind.ALERT]
    seen = {(a["rule"], a["status"], a["step"]) for a in alerts if a["rule"].startswith("guard_")}
    assert ("guard_breaker_open", "firing", 9) in seen and ("guard_breaker_open", "resolved", 10) in seen
    assert ("guard_reward_batch_held", "firing", 13) in seen and ("guard_reward_batch_held", "resolved", 14) in seen
    assert ("guard_checkpoint_refused", "firing", 20) in seen
    # a checkpoint written whole afterwards ends it: later checkpoints are rollback targets again
    assert ("guard_checkpoint_refused", "resolved", 21) in seen
    assert not [a for a in alerts if a["rule"] == "guard_rollouts_dropped"]    # one batch: not yet

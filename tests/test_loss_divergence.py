"""A training loss that diverges and stays up: one verdict, a page and a rollback, whichever way
the numbers arrive (the live HF callback's events, trainer_state.json, a CSV, the console log)."""

from __future__ import annotations

import csv
import json
import math

import pytest

from producers.integrations.hf import rewrite_logs
from trainguard.replay import replay
from trainguard.schemas import events as ev
from trainguard.streams import rules as rules_mod

CHECKPOINT_EVERY = 10
RISE = 41  # the first step at the far too high learning rate


def _sft_logs() -> list[dict]:
    """A tiny SFT run's logs dicts as the Trainer makes them, one per step: the loss falls from
    2.9, then 4 steps at a learning rate 500x too high push it to ~51, and it settles near 20."""
    logs = []
    for step in range(1, 81):
        if step < RISE:
            loss = 2.9 - 0.02 * step + 0.04 * math.sin(step)
        elif step < RISE + 4:
            loss = (51.0, 44.0, 37.0, 30.0)[step - RISE]
        else:
            loss = 20.0 + 0.6 * math.sin(step)
        logs.append({"loss": round(loss, 4), "grad_norm": round(1.0 + 0.1 * math.cos(step), 4),
                     "learning_rate": 2e-5, "epoch": round(step / 400, 4), "step": step})
    return logs


def _write_events(path, logs) -> None:
    """What the live callback publishes: metrics/1 events, the plain loss as train/total_loss."""
    src = ev.source("trainer", "sft-host", 0)
    with open(path, "wb") as f:
        for i, entry in enumerate(logs):
            metrics = rewrite_logs({k: v for k, v in entry.items() if k != "step"}, rl=False)
            f.write(ev.encode(ev.metrics_event("sft", entry["step"], metrics, src=src, ts=1.7e9 + 10 * i)) + b"\n")


def _write_trainer_state(path, logs) -> None:
    path.write_text(json.dumps({"global_step": len(logs), "log_history": logs}))


def _write_csv(path, logs) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["step", "loss", "grad_norm", "learning_rate", "epoch"])
        w.writeheader()
        w.writerows(logs)


def _write_console(path, logs) -> None:
    path.write_text("".join(str({k: v for k, v in e.items() if k != "step"}) + "\n" for e in logs))


WRITERS = {"events.jsonl": _write_events, "trainer_state.json": _write_trainer_state, "metrics.csv": _write_csv,
           "train.log": _write_console}


def _verdict(result) -> dict:
    loud = [(a["rule"], a["status"], a["step"]) for a in result.alerts if a["severity"] in ("P0", "P1")]
    rollbacks = [(c["target"]["step"], step) for c, step in zip(result.commands, result.command_steps, strict=True)
                 if c["action"] == "rollback"]
    return {"loud": loud, "first_rollback": rollbacks[:1]}


@pytest.mark.parametrize("name", list(WRITERS))
def test_a_diverged_loss_that_stays_up_pages_and_is_rolled_back(tmp_path, name):
    logs = _sft_logs()
    path = tmp_path / name
    WRITERS[name](path, logs)
    checkpoints = [{"step": s, "path": f"/ckpt/checkpoint-{s}"} for s in range(CHECKPOINT_EVERY, 81, CHECKPOINT_EVERY)]
    result = replay(path, rules=rules_mod.default(), checkpoints=checkpoints, find_file_checkpoints=False)
    verdict = _verdict(result)
    # One page, the loss rule, opened within 2 steps of the rise and never resolved while the
    # loss stays ~7x up (a trailing reference resolved it by itself a few points later).
    assert [(rule, status) for rule, status, _ in verdict["loud"]] == [("loss_divergence", "firing")], verdict
    assert RISE <= verdict["loud"][0][2] <= RISE + 2, verdict
    # The breaker rolls back, within a few steps of the rise, to a checkpoint saved before it (the
    # newest, or the one before when its change-point search dates the change a step early).
    assert verdict["first_rollback"], verdict
    assert RISE - 2 * CHECKPOINT_EVERY <= verdict["first_rollback"][0][0] < RISE, verdict
    assert verdict["first_rollback"][0][1] <= RISE + 4, verdict


def test_every_format_gives_the_same_verdict(tmp_path):
    logs = _sft_logs()
    checkpoints = [{"step": s, "path": f"/ckpt/checkpoint-{s}"} for s in range(CHECKPOINT_EVERY, 81, CHECKPOINT_EVERY)]
    verdicts = {}
    for name, write in WRITERS.items():
        write(tmp_path / name, logs)
        result = replay(tmp_path / name, rules=rules_mod.default(), checkpoints=checkpoints,
                        find_file_checkpoints=False)
        verdicts[name] = (_verdict(result), sorted({a["rule"] for a in result.alerts}))
    assert len({json.dumps(v) for v in verdicts.values()}) == 1, verdicts


def test_an_rl_trainers_loss_stays_a_policy_loss_in_its_trainer_state(tmp_path):
    """TRL's GRPO logs its policy-gradient loss as ``loss`` beside its rewards: not a training loss."""
    logs = [{"loss": 0.01 * (-1) ** s, "reward": 0.5, "kl": 0.001, "step": s} for s in range(1, 6)]
    path = tmp_path / "trainer_state.json"
    _write_trainer_state(path, logs)
    result = replay(path, rules=rules_mod.default())
    assert "loss" in result.metrics and "total_loss" not in result.metrics

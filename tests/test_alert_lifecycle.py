"""The alert lifecycle through the real engine: keep_firing_for, flap damping, recovery, and what
an open page means for checkpoints. No broker: the engine is the same object the worker runs."""

from __future__ import annotations

import pytest

from trainguard.schemas import events as ev
from trainguard.streams import rules as rules_mod
from trainguard.streams.engine import Engine

TRAINER = ev.source("trainer", "h", 0)

KL_RULES = """
version: 1
rules:
  - name: kl_high
    signal: kl
    above: 0.1
    severity: P2
"""


def _driver(engine: Engine, run: str = "r"):
    offset = [0]

    def send(step: int, metrics: dict) -> list[dict]:
        offset[0] += 1
        raw = ev.encode(ev.metrics_event(run, step, metrics, src=TRAINER, ts=1000.0 + step))
        return [o.value for o in engine.handle(raw, 0, offset[0]) if o.kind == "alert"]

    return send


def test_a_metric_that_crosses_its_threshold_back_and_forth_is_one_flapping_episode():
    send = _driver(Engine(rules_mod.parse(KL_RULES, "kl.yaml")))
    alerts = []
    for step in range(1, 301):  # KL wanders around 0.1: above it for 3 steps in every 30
        alerts += send(step, {"kl": 0.12 if step % 30 < 3 else 0.09})
    firing = [a for a in alerts if a["status"] == "firing"]
    assert len(firing) == 2, "the first episode, then one flapping notice"
    assert "flapping" not in firing[0] and firing[1]["flapping"] is True
    # the flapping episode holds while KL keeps coming back, and resolves after 100 clean points
    assert [a["status"] for a in alerts].count("resolved") == 1
    tail = []
    for step in range(301, 420):
        tail += send(step, {"kl": 0.05})
    assert [a["status"] for a in tail] == ["resolved"] and tail[0]["step"] == 301 + 100


def test_keep_firing_for_counts_clean_points_in_a_row():
    rules = rules_mod.parse(KL_RULES.replace("severity: P2", "severity: P2\n    keep_firing_for: 2"), "kl.yaml")
    send = _driver(Engine(rules))
    assert [a["status"] for a in send(1, {"kl": 0.2})] == ["firing"]
    assert send(2, {"kl": 0.05}) == [] and send(3, {"kl": 0.2}) == [], "one clean point, then it holds again"
    assert send(4, {"kl": 0.05}) == [] and send(5, {"kl": 0.05}) == []
    assert [a["status"] for a in send(6, {"kl": 0.05})] == ["resolved"]


def test_a_loss_that_jumps_and_stays_high_keeps_its_page_open_and_spoils_later_checkpoints():
    engine = Engine(rules_mod.default())
    send = _driver(engine, "sft")
    alerts = []
    for step in range(1, 61):  # a supervised loss settling near 3.9
        alerts += send(step, {"actor/pg_loss": 3.9 + 0.01 * (step % 5)})
    assert alerts == []
    for step in range(61, 90):  # it diverges to 14 and stays there
        alerts += send(step, {"actor/pg_loss": 14.0 + 0.01 * (step % 3)})
    engine.handle(ev.encode(ev.checkpoint_event("sft", 80, "/ckpt/80", ts=1080.0)), 0, 10_000)
    spikes = [a for a in alerts if a["rule"] == "loss_spike"]
    assert [a["status"] for a in spikes] == ["firing"], "no resolution while the loss is still at 14"
    status = engine.status("sft")
    assert "loss_spike" in [a["rule"] for a in status["open_alerts"]]
    assert status["last_healthy_checkpoint"] is None, "a checkpoint saved during an open P1 is not healthy"


@pytest.mark.parametrize("text, problem", [
    ("alerting: {P9: {keep_firing_for: 1}}", "'alerting' keys are severities"),
    ("alerting: {P2: {keep_for: 1}}", r"team.yaml:8: unknown key\(s\) keep_for in alerting.P2"),
    ("alerting: {P2: {flap_episodes: 1}}", "flap_episodes must be at least 2"),
])
def test_the_alerting_section_is_checked_with_its_line(text, problem):
    with pytest.raises(rules_mod.RulesError, match=problem):
        rules_mod.parse(KL_RULES + text + "\n", "team.yaml")


def test_alerting_defaults_apply_to_rules_of_that_severity():
    rules = rules_mod.parse(KL_RULES + "alerting: {P2: {keep_firing_for: 0, flap_episodes: 50}}\n", "team.yaml")
    send = _driver(Engine(rules))
    statuses = []
    for step in range(1, 21):
        statuses += [a["status"] for a in send(step, {"kl": 0.2 if step % 2 else 0.05})]
    assert statuses == ["firing", "resolved"] * 10


def test_a_sparse_reward_run_with_a_dead_step_in_eight_warns_once_and_never_pages():
    """Zero gradients now and then are this run's normal: judged against its own history."""
    send = _driver(Engine(rules_mod.default()), "sparse")
    alerts = []
    for step in range(1, 801):
        dead = step % 8 == 0 or step % 97 in (1, 2)  # one step in eight, and a streak of 3 now and then
        alerts += send(step, {"actor/grad_norm": 0.0 if dead else 0.4 + 0.01 * (step % 7)})
    firing = [(a["rule"], a["severity"]) for a in alerts if a["status"] == "firing"]
    assert not [f for f in firing if f[1] in ("P0", "P1")], firing
    assert len(firing) <= 2, firing


def test_a_run_dead_from_its_first_points_pages_and_a_streak_far_past_its_own_pages_too():
    send = _driver(Engine(rules_mod.default()), "dead")
    first = [a["rule"] for step in range(1, 6) for a in send(step, {"actor/grad_norm": 0.0})
             if a["status"] == "firing"]
    assert first == ["zero_gradient", "no_update"], "a warning at the first dead point, a page at the fifth"
    send2 = _driver(Engine(rules_mod.default()), "later")
    alerts = []
    for step in range(1, 200):
        alerts += send2(step, {"actor/grad_norm": 0.0 if step % 10 == 0 else 0.5})  # streaks of one
    assert not [a for a in alerts if a["rule"] == "no_update"]
    # mid-run, a streak of 10 past twice the run's longest (tiny-batch runs live through shorter ones)
    pages = [a for step in range(200, 211) for a in send2(step, {"actor/grad_norm": 0.0})
             if a["rule"] == "no_update" and a["status"] == "firing"]
    assert [a["step"] for a in pages] == [209], "a streak of 10 against the run's longest of 1"
    assert pages[0]["evidence"]["longest_earlier_streak"] == 1

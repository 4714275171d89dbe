"""One incident, one thread, on every chat channel: the README's loop taken to a NaN beside a real
worker and a real sinks process whose DingTalk, WeCom, Slack and generic webhooks post to real HTTP
receivers. An incident the breaker rolled back costs at most two messages per channel, the last of
which names the rollback; one it cannot cure (no checkpoint yet) says "needs a human" in its first
line."""

from __future__ import annotations

import time
import uuid

import pytest

from chaos.scenarios import chat_texts, sinks_env, sinks_started
from tests.integration import Receiver, SinksProcess, WorkerProcess, wait_until
from tests.test_readme_loop import ToyTrainer, _env, run_readme_loop

pytestmark = pytest.mark.integration

CHANNELS = ("dingtalk", "wecom", "slack", "webhook")


def _first_lines(channel: str, body: dict) -> list[str]:
    """What a person reads first in one message of ``channel``."""
    texts = dict(chat_texts("/hook", body))
    text = {"dingtalk": texts.get("dingtalk.text"), "wecom": texts.get("wecom.content"),
            "slack": texts.get("slack.header"), "webhook": texts.get("webhook.text")}[channel] or ""
    return [text.splitlines()[0] if text else ""]


def _for_run(receiver: Receiver, run_id: str) -> list[dict]:
    return [b for b in receiver.bodies() if run_id in str(b)]


def test_a_rolled_back_incident_is_two_messages_per_channel_and_an_uncurable_one_needs_a_human(
        kafka, tmp_path, monkeypatch):
    _env(kafka, monkeypatch)
    ok = b'{"errcode":0,"errmsg":"ok"}'
    receivers = {name: Receiver(ok_body=ok if name in ("dingtalk", "wecom") else b"ok") for name in CHANNELS}
    env = sinks_env(receivers["webhook"].url, tmp_path,
                    TRAINGUARD_DINGTALK_WEBHOOK=receivers["dingtalk"].url + "?access_token=t",
                    TRAINGUARD_WECOM_WEBHOOK=receivers["wecom"].url, TRAINGUARD_SLACK_WEBHOOK=receivers["slack"].url)
    worker = WorkerProcess(kafka, tmp_path).start()
    sinks = sinks_started(SinksProcess(kafka, tmp_path, env).start())
    healed, uncured = f"healed-{uuid.uuid4().hex[:6]}", f"early-{uuid.uuid4().hex[:6]}"
    try:
        worker.wait_ready()
        # Batch 30 turns step 31 NaN: rolled back to step 30's checkpoint, the loop trains to its end.
        toy = ToyTrainer(poisoned={30}, ckpt_dir=tmp_path / "ckpt-healed")
        namespace = run_readme_loop(toy.namespace(total_steps=60), run_id=healed)
        assert [p.rsplit("/", 1)[-1] for p in toy.loaded] == ["global_step_30.json"] and namespace["step"] == 60
        # Batch 4 turns step 5 NaN before any checkpoint: nothing to roll back to.
        early = ToyTrainer(poisoned={4}, ckpt_dir=tmp_path / "ckpt-early")
        run_readme_loop(early.namespace(total_steps=30), run_id=uncured)

        def settled():
            got = {name: _for_run(r, healed) for name, r in receivers.items()}
            done = all(any(b.get("status") == "resolved" or "resolved" in str(_first_lines(name, b))
                           for b in bodies) for name, bodies in got.items())
            later = {name: _for_run(r, uncured) for name, r in receivers.items()}
            return (got, later) if done and all(later.values()) else None

        wait_until(settled, 90, "the healed thread's resolution and the uncured page on every channel")
        time.sleep(5)  # anything more would come now
        got = {name: _for_run(r, healed) for name, r in receivers.items()}
        later = {name: _for_run(r, uncured) for name, r in receivers.items()}
    finally:
        sinks.stop()
        worker.kill()
        for r in receivers.values():
            r.stop()

    for name in CHANNELS:
        firsts = [_first_lines(name, b)[0] for b in got[name]]
        assert 1 <= len(got[name]) <= 2, (name, firsts)
        assert "resolved by the rollback to step 30" in firsts[-1], (name, firsts)
        assert "needs a human" not in firsts[0], (name, firsts)
        first_uncured = _first_lines(name, later[name][0])[0]
        assert "needs a human" in first_uncured, (name, first_uncured)
        assert "(resolved: the run stopped)" in _first_lines(name, later[name][-1])[0], (name, later[name])
    generic = got["webhook"][-1]
    assert generic["resolved_by"]["to_step"] == 30 and generic["resolved_by"]["at_step"] == 31, generic
    assert generic["thread"]["open"] == 0

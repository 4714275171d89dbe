"""The paging stage on its own: alert events in (with their times), the messages a chat sink
would send out."""

from __future__ import annotations

import json

from trainguard.sinks.paging import DIGEST, PAGE, Pager, PagingSettings

T0 = 1_764_400_000.0


def _alert(i: int, severity: str = "P2", status: str = "firing", rule: str = "kl_spike", run: str = "ppo-7b",
           ts: float | None = None, **extra) -> dict:
    return {"schema": "alert/1", "id": extra.pop("id", f"{run}-{rule}-{i}"), "run_id": run, "rule": rule,
            "summary": "KL spike", "severity": severity, "status": status, "metric": "actor/kl_loss",
            "value": 0.5, "step": 100 + i, "ts": T0 + i * 10 if ts is None else ts,
            "source": {"kind": "trainer", "host": "gpu-1", "rank": 0}, **extra}


def _run(pager: Pager, alerts) -> list:
    return [m for a in alerts for m in pager.feed(a)]


def test_p0_and_p1_page_at_once_and_their_resolutions_follow():
    pager = Pager()
    fire = _alert(0, "P1")
    [page] = pager.feed(fire)
    assert (page.kind, page.run_id, page.ts, page.event) == (PAGE, "ppo-7b", fire["ts"], fire)
    assert pager.feed(fire) == []  # a replay of the same id and status
    # a run started again under the same id: the same alert ids, later times: it pages again
    assert [m.event["ts"] for m in pager.feed({**fire, "ts": T0 + 86_400})] == [T0 + 86_400]
    [resolved] = pager.feed({**fire, "status": "resolved", "ts": T0 + 50})
    assert resolved.event["status"] == "resolved"
    # the resolution of an alert whose firing was never paged here says nothing to anyone
    assert pager.feed({**_alert(1, "P0"), "status": "resolved"}) == []


def test_a_p2_burst_becomes_one_digest_per_run_per_interval():
    pager = Pager(PagingSettings(digest_interval_s=900))
    burst = [_alert(i) for i in range(30)]  # 30 KL warnings over 300 s
    burst += [_alert(i, rule="entropy_drop", summary="Entropy collapsed") for i in range(30, 35)]
    burst += [_alert(i, status="resolved") for i in range(10)]  # P2 resolutions are not sent
    burst += [_alert(i, run="grpo-1") for i in range(3)]
    assert _run(pager, burst) == []  # nothing until the interval ends
    assert pager.flush(T0 + 899) == []
    digests = pager.flush(T0 + 900)
    assert [(m.kind, m.run_id, m.ts) for m in digests] == [(DIGEST, "ppo-7b", T0 + 900), (DIGEST, "grpo-1", T0 + 900)]
    event = digests[0].event
    assert event["count"] == 35 and event["severity"] == "P2"
    assert [(e["rule"], e["count"], e["first_step"], e["last_step"]) for e in event["entries"]] == [
        ("kl_spike", 30, 100, 129), ("entropy_drop", 5, 130, 134)]
    assert pager.flush(T0 + 10_000) == []  # sent once
    # the next warning opens the next interval; time moves with the alerts too
    assert pager.feed(_alert(40, ts=T0 + 1000)) == []
    [late] = pager.feed(_alert(41, ts=T0 + 1950))
    assert late.kind == DIGEST and late.event["count"] == 1 and late.ts == T0 + 1900
    assert [m.event["count"] for m in pager.flush()] == [1]  # flush(): every open digest


def test_muted_alerts_page_nobody():
    pager = Pager()
    silenced = _alert(0, "P0", silenced={"id": "s1", "until": T0 + 3600})
    inhibited = _alert(1, "P1", inhibited_by="incident-1")
    acked = _alert(2, "P1", acknowledged={"by": "ops"})
    warned = _alert(3, "P2", silenced={"id": "s1"})
    assert _run(pager, [silenced, inhibited, acked, warned]) == [] and pager.flush() == []
    assert _run(pager, [{**a, "status": "resolved"} for a in (silenced, inhibited, acked)]) == []
    assert pager.feed(_alert(9, "P3")) == [] and pager.flush() == []  # below every paging severity


def test_a_flapping_rule_pages_once_until_it_settles():
    pager = Pager()
    flaps = []
    for i in range(20):  # firing and resolved over and over, each firing a new alert id
        fire = _alert(i, "P1", flapping=True)
        flaps += [fire, {**fire, "status": "resolved", "ts": fire["ts"] + 5}]
    messages = _run(pager, flaps)
    assert len(messages) == 1 and messages[0].event["flapping"] is True
    [settled] = pager.feed({**_alert(20, "P1"), "status": "resolved"})  # the rule settled: said once
    assert settled.event["status"] == "resolved"
    [again] = pager.feed(_alert(21, "P1"))  # a later firing pages as usual
    assert again.event["id"] == _alert(21)["id"]


def test_flapping_warnings_are_marked_in_the_digest():
    pager = Pager(PagingSettings(digest_interval_s=60))
    _run(pager, [_alert(i, flapping=i % 2 == 0) for i in range(4)])
    [digest] = pager.flush()
    assert digest.event["entries"][0]["flapping"] is True and digest.event["count"] == 4


def test_the_state_survives_a_restart_as_json():
    settings = PagingSettings(digest_interval_s=900)
    first = Pager(settings)
    fire = _alert(0, "P0")
    first.feed(fire)
    _run(first, [_alert(i) for i in range(1, 4)])
    second = Pager(settings, json.loads(json.dumps(first.state())))
    assert second.feed(fire) == []  # already considered
    assert [m.event["status"] for m in second.feed({**fire, "status": "resolved"})] == ["resolved"]
    [digest] = second.flush(T0 + 10_000)
    assert digest.event["count"] == 3


def test_settings_from_the_environment():
    assert PagingSettings.from_env({}) == PagingSettings(page=("P0", "P1"), digest=("P2",), digest_interval_s=7200)
    s = PagingSettings.from_env({"TRAINGUARD_NOTIFY_SEVERITIES": "P0,P1,P2", "TRAINGUARD_DIGEST_SEVERITIES": "P2,P3",
                                 "TRAINGUARD_DIGEST_INTERVAL_S": "60"})
    assert s.page == ("P0", "P1", "P2") and s.digest == ("P3",) and s.digest_interval_s == 60
    import pytest

    with pytest.raises(ValueError, match="TRAINGUARD_DIGEST_INTERVAL_S"):
        PagingSettings.from_env({"TRAINGUARD_DIGEST_INTERVAL_S": "soon"})


def test_a_digest_gathers_from_arrival_when_the_alerts_carry_old_times():
    # a trainer's clock, or a backlog: stamped a day ago, arriving now; one digest, not one each
    pager = Pager(PagingSettings(digest_interval_s=900))
    now = T0 + 86_400
    for i in range(5):
        assert pager.feed(_alert(i), now=now + i) == []
    assert pager.flush(now + 899) == []
    [digest] = pager.flush(now + 900)
    assert digest.event["count"] == 5 and digest.event["since"] == T0 and digest.event["until"] == T0 + 40


def test_an_interval_whose_warnings_all_resolved_sends_nothing():
    # Alertmanager notifies no group that only holds resolved alerts: a one-off warning the run
    # got over before the digest was due stays on the run page, out of the channel
    pager = Pager(PagingSettings(digest_interval_s=900))
    spike = _alert(0)
    assert _run(pager, [spike, {**spike, "status": "resolved", "ts": T0 + 300}]) == []
    assert pager.flush(T0 + 900) == [] and pager.flush() == []
    # one of two still firing: the digest is sent, listing both and saying which still fires
    _run(pager, [_alert(1, ts=T0 + 1000), _alert(2, rule="kl_high", ts=T0 + 1010),
                 {**_alert(1, ts=T0 + 1000), "status": "resolved", "ts": T0 + 1200}])
    [digest] = pager.flush(T0 + 1900)
    assert digest.event["count"] == 2 and digest.event["open"] == 1
    assert [(e["rule"], e["open"]) for e in digest.event["entries"]] == [("kl_spike", 0), ("kl_high", 1)]
    from trainguard.sinks.webhooks.messages import Templates

    lines = [line for line in Templates().render("markdown.md", digest.event, escape=str).splitlines()
             if line.startswith("- **KL")]
    assert lines[0].endswith("step 101") and lines[1].endswith("step 102, 1 still firing"), lines


def test_a_digest_saved_before_warnings_were_followed_is_still_sent():
    state = {"digests": {"ppo-7b": {"opened": T0, "since": T0, "until": T0, "entries": {
        "kl_spike": {"rule": "kl_spike", "summary": "KL spike", "severity": "P2", "count": 2, "first_step": 1,
                     "last_step": 2, "metric": "kl", "flapping": False}}}}}
    [digest] = Pager(PagingSettings(digest_interval_s=900), json.loads(json.dumps(state))).flush()
    assert digest.event["count"] == 2 and digest.event["open"] == 2


def test_a_paging_state_of_another_shape_on_disk_starts_empty_or_drops_the_bad_digest(tmp_path):
    """The pager's file, damaged or edited by hand, raised in the sinks process as it started
    (a list, a number for ``seen``) or at every batch after (a digest without ``since``)."""
    from trainguard.sinks.paging import PagingSink

    path = tmp_path / "pager.json"
    settings = PagingSettings(digest_interval_s=900)
    for bad in ([1, 2], {"seen": 5}, {"flapping": [1]}, {"digests": [1]}):
        path.write_text(json.dumps(bad))
        pager = PagingSink([], settings, state_path=path).pager
        assert pager.state() == {"seen": [], "paged": [], "flapping": {}, "digests": {}, "threads": {}}
        assert [m.kind for m in _run(pager, [_alert(0, "P0")])] == [PAGE]
    good = {"opened": T0, "since": T0, "until": T0, "open": {"a": "kl_spike"}, "entries": {
        "kl_spike": {"rule": "kl_spike", "severity": "P2", "count": 1, "first_step": 1, "last_step": 1}}}
    path.write_text(json.dumps({"seen": ["x"], "digests": {"ok": good, "no-since": {"entries": {}},
                                                           "odd": {**good, "entries": [1]}, "str": "x"}}))
    pager = PagingSink([], settings, state_path=path).pager
    assert [m.run_id for m in pager.flush(T0 + 1000)] == ["ok"]


def test_a_runs_pages_are_one_thread_that_resolves_once_naming_the_rollback():
    """Four P1s of one incident and their resolutions by a rollback: one page, one resolution
    that says what resolved it; an escalation and a failed command still go out at once."""
    pager = Pager(PagingSettings(group_interval_s=300))
    rules = ("kl_explosion", "grad_norm_spike", "pg_loss_spike", "entropy_spike")
    fired = [_alert(i, "P1", rule=rule) for i, rule in enumerate(rules)]
    [page] = _run(pager, fired)
    assert page.event["id"] == fired[0]["id"] and "thread" not in page.event
    rolled = {"resolution": "resolved by the rollback to step 100, skipping 6 batches, at step 107",
              "resolved_by": {"action": "rollback", "to_step": 100, "skip_batches": 6, "at_step": 107}}
    resolutions = [{**a, "status": "resolved", "ts": a["ts"] + 60, **(rolled if a is fired[2] else {})} for a in fired]
    [done] = _run(pager, resolutions)
    assert done.event["status"] == "resolved" and done.event["resolution"] == rolled["resolution"]
    assert done.event["resolved_by"] == rolled["resolved_by"]
    assert done.event["thread"] == {"id": fired[0]["id"], "update": False, "alerts": 4, "folded": 3, "open": 0,
                                    "rules": dict.fromkeys(rules, 1)}
    assert pager.state()["threads"] == {}

    # a new thread: a P0 on top of a P1 is an update; so is the notice that a command failed
    p1 = _alert(10, "P1", rule="kl_explosion", ts=T0 + 1000)
    p0 = _alert(11, "P0", rule="non_finite", ts=T0 + 1001)
    failed = _alert(12, "P1", rule="command_not_applied", ts=T0 + 1002)
    again = _alert(13, "P1", rule="kl_spike", ts=T0 + 1003)
    messages = _run(pager, [p1, p0, failed, again])
    assert [m.event["id"] for m in messages] == [p1["id"], p0["id"], failed["id"]]
    assert messages[1].event["thread"]["update"] and messages[1].event["thread"]["alerts"] == 2
    # past the group interval, a further alert of the thread is an update, not silence
    [late] = pager.feed(_alert(14, "P1", rule="kl_spike", id="late", ts=T0 + 1400))
    assert late.event["thread"]["update"] and late.event["thread"]["alerts"] == 5

    # other runs have threads of their own
    assert [m.run_id for m in pager.feed(_alert(20, "P1", run="grpo-1"))] == ["grpo-1"]


def test_threads_survive_a_restart_and_every_page_stands_alone_with_a_zero_interval(tmp_path):
    pager = Pager(PagingSettings(group_interval_s=300))
    fired = [_alert(i, "P1", rule=r) for i, r in enumerate(("kl_explosion", "grad_norm_spike"))]
    assert len(_run(pager, fired)) == 1
    again = Pager(PagingSettings(group_interval_s=300), json.loads(json.dumps(pager.state())))
    assert again.feed({**fired[0], "status": "resolved"}) == []
    [done] = again.feed({**fired[1], "status": "resolved"})
    assert done.event["thread"]["alerts"] == 2
    # damaged thread state on disk: dropped alone, said
    broken = Pager(PagingSettings(), {"threads": {"r": {"id": 3}}, "paged": ["x"]})
    assert broken.state()["threads"] == {} and broken.state()["paged"] == ["x"]

    each = Pager(PagingSettings(group_interval_s=0))
    assert len(_run(each, [_alert(i, "P1", rule=f"r{i}") for i in range(3)])) == 3

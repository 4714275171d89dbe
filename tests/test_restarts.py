"""A broker that goes away and comes back, without one: what a long-running client says about
an outage (``ConnectionNews``), how the worker recognises a broker that came back empty
(``Continuity``) and why its recovery no longer stops it (``WorkerRecovery``). The whole story,
on a real broker restarted under a worker, the sinks, tail and the run page, is
``tests/test_chaos.py``'s and ``make chaos``'s (``broker_restart_readers``)."""

from __future__ import annotations

import asyncio
from collections import Counter
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from confluent_kafka import KafkaError, KafkaException

from trainguard.core.connection import ConnectionNews
from trainguard.core.kafka import KafkaSettings
from trainguard.streams.continuity import Continuity


class _Error:
    """What librdkafka hands an ``error_cb``."""

    def __init__(self, name: str, text: str = ""):
        self._name, self._text = name, text or name

    def name(self) -> str:
        return self._name

    def str(self) -> str:
        return self._text


def _down():
    raise KafkaException(KafkaError(KafkaError._TIMED_OUT))


REFUSED = ("127.0.0.1:9092/bootstrap: Connect to ipv4#127.0.0.1:9092 failed: Connection refused "
           "(after 0ms in state CONNECT)")


def test_an_outage_is_said_in_two_lines_however_many_errors_librdkafka_reports():
    said, now = [], [100.0]
    news = ConnectionNews("trainguard sinks", "127.0.0.1:9092", said.append, clock=lambda: now[0])
    for _ in range(200):
        news.on_error(_Error("_TRANSPORT", REFUSED))
    assert news.check(_down) is None
    assert len(said) == 1 and said[0].startswith("trainguard sinks: cannot reach Kafka at 127.0.0.1:9092 (Connect to "
                                                 "ipv4#127.0.0.1:9092 failed: Connection refused")
    assert "`trainguard broker`" in said[0] and "TRAINGUARD_BOOTSTRAP" in said[0]  # the way out
    now[0] += 0.5
    assert news.check(lambda: pytest.fail("probed before its second")) is None
    for _ in range(200):
        now[0] += 0.1
        news.on_error(_Error("_ALL_BROKERS_DOWN", "1/1 brokers are down"))
        news.check(_down)
    assert len(said) == 1
    now[0] += 1.3
    assert news.check(lambda: "metadata") == "metadata"
    assert said[1] == ("trainguard sinks: reconnected to Kafka at 127.0.0.1:9092 after 22 s "
                       "(400 connection error(s) while it was away)")
    assert not news.suspect and news.outages == 1


def test_a_dropped_connection_the_broker_answers_at_once_says_nothing():
    said = []
    news = ConnectionNews("trainguard tail", "k:9092", said.append)
    news.on_error(_Error("_TRANSPORT", "k:9092/1: Disconnected (after 600000ms in state UP)"))  # an idle close
    assert news.suspect
    assert news.check(lambda: {}) == {}
    assert said == [] and not news.suspect


def test_other_client_problems_are_said_once_for_each_kind():
    said = []
    news = ConnectionNews("trainguard sinks", "k:9092", said.append)
    for i in range(5):
        news.on_error(_Error("SASL_AUTHENTICATION_FAILED", f"k:9092/{i}: SASL authentication error: bad password"))
    news.on_error(_Error("_MAX_POLL_EXCEEDED", "Application maximum poll interval (6000ms) exceeded by 12ms"))
    assert len(said) == 2 and "bad password" in said[0] and "exceeded" in said[1]
    assert not news.suspect


def _described(ids: dict):
    """An admin client whose describe_topics answers with ``ids`` (None: no such topic)."""
    def describe_topics(topics, request_timeout=None):
        futures = {}
        for name in topics.topic_names:
            future: Future = Future()
            if ids.get(name) is None:
                future.set_exception(KafkaException(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)))
            else:
                future.set_result(SimpleNamespace(topic_id=ids[name]))
            futures[name] = future
        return futures
    return SimpleNamespace(describe_topics=describe_topics)


def test_a_topic_with_a_new_id_makes_the_worker_start_afresh(tmp_path):
    started_afresh = []
    continuity = Continuity(KafkaSettings(bootstrap="127.0.0.1:9"), ["t.events", "t.acks"], ["app-state-changelog"],
                            started_afresh.append, folder=tmp_path)
    continuity.admin = _described({"t.events": "AaJE1", "t.acks": "AaJE2"})  # no changelog yet
    asyncio.run(continuity.verify())
    assert started_afresh == [] and continuity.ids == {"t.events": "AaJE1", "t.acks": "AaJE2"}
    continuity.admin = _described({"t.events": "AaJE1", "t.acks": "AaJE2", "app-state-changelog": "AaJE3"})
    asyncio.run(continuity.verify())  # a topic seen for the first time is remembered, not judged
    assert started_afresh == []
    continuity.admin = _described({"t.events": "AaJE1"})  # missing for a while (the broker creating them)
    asyncio.run(continuity.verify())
    continuity.admin = SimpleNamespace(describe_topics=lambda *a, **k: _down())  # the broker is away
    asyncio.run(continuity.verify())
    assert started_afresh == []
    continuity.admin = _described({"t.events": "BbXF1", "t.acks": "BbXF2", "app-state-changelog": "AaJE3"})
    asyncio.run(continuity.verify())
    assert started_afresh == ["t.events, t.acks came back with new topic ids"]


def test_a_broker_without_topic_ids_is_never_judged(tmp_path):
    started_afresh = []
    continuity = Continuity(KafkaSettings(bootstrap="127.0.0.1:9"), ["t.events"], [], started_afresh.append)
    for _ in range(2):
        continuity.admin = _described({"t.events": "AAAAAAAAAAAAAAAAAAAAAA"})  # Kafka before 2.8: the zero id
        asyncio.run(continuity.verify())
    assert started_afresh == [] and continuity.ids == {}


def test_only_the_start_right_after_starting_afresh_distrusts_what_it_finds(tmp_path):
    settings = KafkaSettings(bootstrap="127.0.0.1:9")
    first = Continuity(settings, ["t.events"], [], print, folder=tmp_path)
    assert not first.pending
    first.mark()  # written just before the process executes itself again
    again = Continuity(settings, ["t.events"], [], print, folder=tmp_path)
    assert again.pending
    again.done()
    assert not again.pending
    assert not Continuity(settings, ["t.events"], [], print, folder=tmp_path).pending  # the marker is used up
    (tmp_path / Continuity.MARKER).write_text("1\n")  # another process's: not this one's to act on
    assert not Continuity(settings, ["t.events"], [], print, folder=tmp_path).pending


class _Changelog:
    """The consumer calls recovery makes to place a changelog partition: it ends at offset 3."""

    async def earliest_offsets(self, *tps):
        return {tp: 0 for tp in tps}

    async def highwaters(self, *tps):
        return {tp: 3 for tp in tps}


class _Verified:
    def __init__(self, pending: bool = False):
        self.pending = pending
        self.verified = 0

    async def verify(self) -> None:
        self.verified += 1


def _recovery():
    from trainguard.streams.transport import WorkerApp, WorkerRecovery, WorkerTableManager

    app = WorkerApp("test-recovery", broker="kafka://127.0.0.1:9", store="memory://", TableManager=WorkerTableManager)
    assert isinstance(app.tables.recovery, WorkerRecovery)
    return app, app.tables.recovery


def test_a_changelog_ending_below_what_the_worker_read_is_checked_and_read_from_its_end():
    """Faust stopped the worker with ConsistencyError here (the offset read, 500, past the end, 3):
    the worker asks whether the broker lost its logs (it starts afresh if so); if not, it reads
    the changelog from its end (some brokers report the end at the last batch's start)."""
    from faust.types import TP

    app, recovery = _recovery()
    app.trainguard_continuity = continuity = _Verified()
    tp, fresh = TP("test-recovery-state-changelog", 0), TP("test-recovery-state-changelog", 1)
    offsets = Counter({tp: 500, fresh: -1})
    asyncio.run(recovery._build_offsets(_Changelog(), {tp, fresh}, offsets, "active"))
    assert offsets[tp] == 2 and offsets[fresh] == -1  # Faust's check: offset > end - 1 raises
    assert continuity.verified == 1


def test_after_starting_afresh_the_changelogs_records_are_not_restored():
    from faust.types import TP

    app, recovery = _recovery()
    app.trainguard_continuity = _Verified(pending=True)
    tp = TP("test-recovery-state-changelog", 0)
    offsets = Counter({tp: -1})
    asyncio.run(recovery._build_offsets(_Changelog(), {tp}, offsets, "active"))
    assert offsets[tp] == 2  # read up to its end already: nothing of the previous start comes back


def test_a_repeated_line_said_again_with_its_count_formats_under_faust():
    """An outage repeats the worker's lines; the one that says how many were held back came out as a
    logging error under Faust's formatter, which makes ``args=None`` an argument."""
    import logging
    import time

    from mode.utils.logging import ExtensionFormatter

    from trainguard.streams.app import RepeatFilter

    def record():
        return logging.LogRecord("trainguard.worker", logging.INFO, __file__, 1, "trainguard: %d events, 100%% read",
                                 (5,), None)

    repeats = RepeatFilter(interval_s=0.05)
    assert repeats.filter(record()) and not repeats.filter(record())
    time.sleep(0.06)
    again = record()
    assert repeats.filter(again)
    assert ExtensionFormatter(fmt="%(message)s").format(again) == \
        "trainguard: 5 events, 100% read [and 1 more like it in the last 0 s]"

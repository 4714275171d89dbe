"""A node's ranks folded into one event per step (producers/ranks.py), on a real broker with a
real worker: what the worker still catches through the folded events, and that no rank waits."""

import math
import os
import socket
import stat
import threading
import time

import orjson
import pytest

from tests.integration import TopicReader
from trainguard.core.kafka import KafkaSettings
from trainguard.producers.ranks import RankFolder, RankLogger, fold
from trainguard.schemas import events as ev

pytestmark = pytest.mark.integration


@pytest.fixture
def folder_at(kafka, tmp_path):
    folders = []

    def start(**kw):
        f = RankFolder(kafka, path=str(tmp_path / f"ranks-{len(folders)}.sock"), **kw).start()
        folders.append(f)
        return f

    yield start
    for f in folders:
        f.close()


def _step_metrics(rank: int, step: int, slow_rank: int | None = None, nan_at: tuple | None = None) -> dict:
    return {"timing_s/update_actor": (2.5 if rank == slow_rank and step >= 4 else 1.0) + 0.01 * ((rank + step) % 3),
            "actor/pg_loss": math.nan if nan_at == (rank, step) else -0.01 - 0.001 * (rank % 4)}


def _decoded_or_none(raw: bytes) -> dict:
    try:
        return ev.decode(raw)
    except ev.SchemaError:
        return {"schema": None}


def _metrics_events(kafka, run_id: str, want: int, timeout: float = 30.0) -> list[dict]:
    reader = TopicReader(kafka, kafka.topics.events, decode=_decoded_or_none)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = [e for e in reader.drain(1.0) if e["schema"] == ev.METRICS and e["run_id"] == run_id]
        if sum(len(e["source"].get("ranks") or [0]) for e in got) >= want:
            return got
    raise AssertionError(f"fewer than {want} rank steps of {run_id} on the events topic")


def test_a_straggler_and_a_nan_on_one_rank_are_caught_through_the_folded_events(kafka, worker, folder_at):
    folder = folder_at(max_wait_s=1.0, ranks_per_node=8)
    worker.wait_ready()
    loggers = [RankLogger("fold-1", r, kafka, host=f"n{r // 8}", path=folder.path) for r in range(16)]
    for step in range(12):
        for r, lg in enumerate(loggers):
            assert lg.log(_step_metrics(r, step, slow_rank=13, nan_at=(5, 8)), step)
        time.sleep(0.05)
    # Whatever else reaches the socket goes on unchanged, so the worker dead-letters it with the reason.
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(folder.path)
        s.send(b"\x00not json")

    alerts = TopicReader(kafka, kafka.topics.alerts)
    straggler = alerts.wait_for(lambda a: a["rule"] == "straggler_rank" and a["run_id"] == "fold-1",
                                what="the straggler alert", worker=worker)
    assert straggler["evidence"]["rank"] == "13" and straggler["source"]["rank"] == 13
    assert straggler["step"] == 4 and straggler["value"] == pytest.approx(2.5, abs=0.05)
    nan = alerts.wait_for(lambda a: a["rule"] == "non_finite" and a["run_id"] == "fold-1",
                          what="the NaN alert", worker=worker)
    assert nan["metric"] == "actor/pg_loss" and nan["step"] == 8 and nan["value"] == "NaN"
    assert nan["source"]["host"] == "n0" and nan["source"]["ranks"] == list(range(8)), "rank 5's node"
    others = [a for a in alerts.drain(1.0) if a["rule"] in ("straggler_rank", "non_finite")
              and a["status"] == "firing" and a["id"] not in (straggler["id"], nan["id"])]
    assert not others, f"no other rank was flagged: {others}"

    events = _metrics_events(kafka, "fold-1", 16 * 12)
    assert len(events) == 2 * 12, "one event per node and step"
    assert all(e["source"]["rank"] is None and len(e["source"]["ranks"]) == 8 for e in events)
    nan_step = next(e for e in events if e["source"]["host"] == "n0" and e["step"] == 8)
    assert math.isnan(nan_step["per_rank"]["actor/pg_loss[5]"]), "each rank's own value travels with the node's"
    assert nan_step["metrics"]["timing_s/update_actor"] == pytest.approx(
        sum(_step_metrics(r, 8)["timing_s/update_actor"] for r in range(8)) / 8), "the node's mean"
    assert folder.stats()["late_rank_steps"] == 0
    dlq = TopicReader(kafka, kafka.topics.dlq, decode=orjson.loads)
    dlq.wait_for(lambda r: "not valid JSON" in r["reason"], what="the dead letter of the garbage", worker=worker)


def test_a_late_rank_holds_no_one_back_and_is_still_judged_with_its_peers(kafka, worker, folder_at):
    folder = folder_at(max_wait_s=0.3, ranks_per_node=8)
    worker.wait_ready()
    loggers = [RankLogger("fold-2", r, kafka, host="n0", path=folder.path) for r in range(8)]
    late, steps = 6, 10
    slowest = [0.0]
    sent = {}

    def timed_log(r, step):
        t = time.perf_counter()
        assert loggers[r].log(_step_metrics(r, step, slow_rank=late), step)
        slowest[0] = max(slowest[0], time.perf_counter() - t)

    def late_rank():  # its steps come one and a half steps after its peers' (its peers do not wait)
        for step in range(steps):
            while step not in sent:
                time.sleep(0.01)
            time.sleep(max(0.0, sent[step] + 0.75 - time.monotonic()))
            timed_log(late, step)

    t = threading.Thread(target=late_rank)
    t.start()
    for step in range(steps):
        for r in range(8):
            if r != late:
                timed_log(r, step)
        sent[step] = time.monotonic()
        time.sleep(0.5)
    t.join(30)
    assert slowest[0] < 0.05, f"a log() call waited {slowest[0] * 1000:.1f} ms"

    events = _metrics_events(kafka, "fold-2", 8 * steps)
    peers = [e for e in events if e["source"]["ranks"] != [late]]
    alone = [e for e in events if e["source"]["ranks"] == [late]]
    assert len(peers) == steps and all(len(e["source"]["ranks"]) == 7 for e in peers), "the peers went without it"
    assert sorted(e["step"] for e in alone) == list(range(steps)), "the late rank's values went out alone, all of them"
    assert folder.stats()["late_rank_steps"] == steps

    alerts = TopicReader(kafka, kafka.topics.alerts)
    straggler = alerts.wait_for(lambda a: a["rule"] == "straggler_rank" and a["run_id"] == "fold-2",
                                what="the straggler alert for the late rank", worker=worker)
    assert straggler["evidence"]["rank"] == str(late) and straggler["step"] == 4


def test_without_a_folder_every_rank_publishes_its_own_event(kafka, tmp_path):
    loggers = [RankLogger("fold-3", r, kafka, host="n0", path=str(tmp_path / "nobody.sock")) for r in range(4)]
    for step in range(3):
        for r, lg in enumerate(loggers):
            assert lg.log(_step_metrics(r, step), step)
    for lg in loggers:
        stats = lg.close(10.0)
        assert stats["direct"] == 3 and stats["relayed"] == 0 and stats["lost"] == 0
    events = _metrics_events(kafka, "fold-3", 12)
    assert sorted((e["source"]["rank"], e["step"]) for e in events) == [(r, s) for r in range(4) for s in range(3)]


def test_folded_events_cannot_grow_a_runs_ranks_past_its_source_cap():
    """Anyone who can write to the events topic can invent rank numbers: folded events carry up
    to 1,024 each, and their ranks count against the run's source cap as unfolded ranks do."""
    from trainguard.schemas import events as ev
    from trainguard.streams import rules as rules_mod
    from trainguard.streams.engine import Engine, Limits

    engine = Engine(rules_mod.default(), limits=Limits(sources_per_run=64))
    for i in range(8):
        ranks = list(range(i * 1024, (i + 1) * 1024))
        event = {"schema": "metrics/1", "run_id": "r", "step": i + 1, "ts": 1.7e9 + i,
                 "source": {"kind": "trainer", "host": f"h{i % 4}", "rank": None, "ranks": ranks},
                 "metrics": {"timing_s/step": 1.0}, "per_rank": {f"timing_s/step[{r}]": 1.0 for r in ranks}}
        engine.handle(ev.encode(event), 0, i)
    run = engine._run(b"r")
    assert len(run.ranks) == 64 and run.limits["sources_per_run"]["of"] == "ranks"
    assert engine.status("r")["limits"]["sources_per_run"]["left_out"] == 8  # every event left some out


# -- folding without a broker: what reaches the worker is what the ranks logged ---------------


class _Pub:
    def __init__(self):
        self.sent: list[bytes] = []

    def publish(self, topic, key, value, partition=None, on_delivery=None):
        self.sent.append(value)
        return True

    def flush(self, timeout=0.0):
        return 0

    def close(self, timeout=0.0):
        return 0


def _rank_event(run_id: str, step: int, rank: int, metrics: dict, host: str = "h") -> bytes:
    return ev.encode(ev.metrics_event(run_id, step, metrics, src=ev.source("trainer", host, rank)))


def test_the_node_mean_of_finite_values_is_finite():
    """Two ranks at 1e308 sum to inf: a node summary of inf would be judged a non-finite value
    (a page and a rollback) that no rank logged."""
    per_rank = {r: ev.decode(_rank_event("r", 1, r, {"actor/grad_norm": 1e308, "x": -1.7e308 + r}))
                for r in range(8)}
    event = ev.decode(ev.encode(fold("r", 1, "h", per_rank)))
    assert event["metrics"]["actor/grad_norm"] == pytest.approx(1e308)
    assert math.isfinite(event["metrics"]["x"])
    per_rank[3]["metrics"]["actor/grad_norm"] = math.inf
    assert fold("r", 1, "h", per_rank)["metrics"]["actor/grad_norm"] == math.inf, "a rank's inf is its node's"


def test_the_folders_memory_stays_bounded_however_many_hosts_report():
    from trainguard.producers import ranks as ranks_mod

    folder = RankFolder(path="/nonexistent/ranks.sock", publisher=_Pub(), max_wait_s=60.0)
    for i in range(3 * ranks_mod.MAX_KNOWN):
        folder.take(_rank_event("r", 1, 0, {"loss": 1.0}, host=f"h{i}"))
    assert len(folder.known) <= ranks_mod.MAX_KNOWN and len(folder.pending) <= ranks_mod.MAX_PENDING
    assert set(folder.done) <= set(folder.known), "what is sent is remembered only for the groups known"


def test_a_folded_event_cannot_carry_values_for_ranks_it_does_not_fold():
    from trainguard.schemas import events as ev

    event = {"schema": "metrics/1", "run_id": "r", "step": 1, "ts": 1.7e9, "metrics": {"timing_s/step": 1.0},
             "source": {"kind": "trainer", "host": "b", "rank": None, "ranks": [0]},
             "per_rank": {"timing_s/step[0]": 1.0, "timing_s/step[7]": 50.0}}
    with pytest.raises(ev.SchemaError, match=r"timing_s/step\[7\].* does not fold"):
        ev.decode(ev.encode(event))
    del event["per_rank"]["timing_s/step[7]"]
    assert ev.decode(ev.encode(event))["per_rank"] == {"timing_s/step[0]": 1.0}


def _delivered(pub: _Pub) -> dict[tuple[int, str], float]:
    """Every rank's value in what the folder sent, each event decoded as the worker decodes it."""
    got: dict[tuple[int, str], float] = {}
    for raw in pub.sent:
        event = ev.decode(raw)  # a SchemaError here: the worker would dead-letter it
        src = event["source"]
        if src.get("ranks") is None:
            got.update({(src["rank"], n): v for n, v in event["metrics"].items()})
            continue
        for name, v in event["per_rank"].items():
            base, _, rank = name.rpartition("[")
            got[(int(rank[:-1]), base)] = v
    return got


@pytest.mark.parametrize("ranks, metrics", [
    (8, {"m/" + "a" * 254: 1.0, "loss": 1.0}),              # name[r] would pass 256 characters
    (8, {f"m{j}": 1.0 for j in range(1500)}),                # 12,000 values in one event
    (1000, {f"m{j}/" + "b" * 120: 1.0 for j in range(9)}),   # 9,000 values but over 1 MiB
    (4000, {f"metric/{j}": 1.0 for j in range(2)}),          # more ranks than one event carries
])
def test_a_step_too_large_to_fold_reaches_the_worker_whole(ranks, metrics):
    """A folded event over the schema's limits would be dead-lettered, and every rank's values of
    that step lost with it, a NaN on one rank included."""
    pub = _Pub()
    folder = RankFolder(path="/nonexistent/ranks.sock", publisher=pub, max_wait_s=60.0, ranks_per_node=ranks)
    nan_rank, name = ranks // 2, next(iter(metrics))
    for r in range(ranks):
        folder.take(_rank_event("r", 7, r, {**metrics, name: math.nan} if r == nan_rank else metrics))
    folder.close()
    got = _delivered(pub)
    assert len(got) == ranks * len(metrics), "every rank's every value"
    assert math.isnan(got[(nan_rank, name)])
    assert all(v == 1.0 for k, v in got.items() if k != (nan_rank, name))
    assert any(math.isnan(ev.decode(raw)["metrics"][name]) for raw in pub.sent), "the NaN is judged"
    assert all(len(ev.decode(raw)["source"].get("ranks") or [0]) <= ev.MAX_FOLDED_RANKS for raw in pub.sent)
    assert len(folder.pending) == 0


def test_a_step_holds_no_more_ranks_than_one_event_carries():
    pub = _Pub()
    folder = RankFolder(path="/nonexistent/ranks.sock", publisher=pub, max_wait_s=60.0)
    for r in range(3 * ev.MAX_FOLDED_RANKS + 5):
        folder.take(_rank_event("r", 1, r, {"loss": 1.0}))
        assert all(len(held.ranks) <= ev.MAX_FOLDED_RANKS for held in folder.pending.values())
    folder.close()
    assert len(_delivered(pub)) == 3 * ev.MAX_FOLDED_RANKS + 5


def test_a_ranks_own_events_say_where_it_runs_whatever_a_folded_event_claimed_first():
    from trainguard.schemas import events as ev
    from trainguard.streams import rules as rules_mod
    from trainguard.streams.engine import Engine

    engine = Engine(rules_mod.default())
    claim = {"schema": "metrics/1", "run_id": "r", "step": 1, "ts": 1.7e9, "metrics": {"timing_s/step": 1.0},
             "source": {"kind": "trainer", "host": "evil-host", "rank": None, "ranks": list(range(8))}}
    engine.handle(ev.encode(claim), 0, 0)
    for rank in range(8):
        engine.handle(ev.encode(ev.metrics_event("r", 2, {"timing_s/step": 1.0},
                                                 src=ev.source("trainer", f"node-{rank // 4}", rank), ts=1.7e9 + 1)),
                      0, 1 + rank)
    assert {r: s["host"] for r, s in engine._run(b"r").ranks.items()} == {str(r): f"node-{r // 4}" for r in range(8)}


# -- the node's socket belongs to one user ------------------------------------------------------


def test_the_default_socket_is_this_users_own(monkeypatch, tmp_path):
    from trainguard.producers.ranks import socket_path

    monkeypatch.delenv("TRAINGUARD_RANK_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert socket_path() == str(tmp_path / "trainguard-ranks.sock")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert socket_path() == f"/tmp/trainguard-ranks-{os.getuid()}.sock"
    monkeypatch.setenv("TRAINGUARD_RANK_SOCKET", str(tmp_path / "x.sock"))
    assert socket_path() == str(tmp_path / "x.sock") and socket_path("/a.sock") == "/a.sock"


def test_the_folder_replaces_only_a_dead_socket_of_its_own_user(tmp_path):
    kept = tmp_path / "ranks.sock"
    kept.write_text("someone's data\n")
    with pytest.raises(OSError, match="not a socket"):
        RankFolder(path=str(kept), publisher=_Pub()).bind()
    assert kept.read_text() == "someone's data\n", "a file at the path is left alone"

    path = str(tmp_path / "dead.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    dead.bind(path)
    dead.close()  # a folder that died leaves its socket file behind
    first = RankFolder(path=path, publisher=_Pub()).bind()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with pytest.raises(OSError, match="listening already"):
        RankFolder(path=path, publisher=_Pub()).bind()
    first.close()
    assert not os.path.exists(path)


def test_a_rank_sends_nothing_to_a_socket_another_user_listens_on(monkeypatch, tmp_path, caplog):
    from trainguard.producers import ranks as ranks_mod

    class Direct(_Pub):
        def __init__(self, settings=None):
            super().__init__()

    monkeypatch.setattr(ranks_mod, "Publisher", Direct)
    path = str(tmp_path / "ranks.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(8)
    raw = _rank_event("secret-run", 1, 0, {"loss": 0.5})
    try:
        mine = ranks_mod.NodeRelay(KafkaSettings.from_env(), path=path)
        assert ranks_mod.peer_uid(mine._connected(), path) == os.getuid()
        assert mine.publish(mine.settings.topics.events, "r", raw) and mine.relayed == 1

        me = os.getuid()
        monkeypatch.setattr(ranks_mod.os, "getuid", lambda: me + 1)  # the listener is now someone else's
        relay = ranks_mod.NodeRelay(KafkaSettings.from_env(), path=path)
        with caplog.at_level("WARNING", logger="trainguard.ranks"):
            for _ in range(3):
                assert relay.publish(relay.settings.topics.events, "r", raw)
        assert relay.relayed == 0 and relay.direct == 3 and relay._kafka.sent == [raw] * 3
        assert sum("not by this user" in r.message for r in caplog.records) == 1, "said once"
    finally:
        listener.close()

"""A node's ranks folded into one event per step (the seeds' local aggregation on the node).

Every event of a run is keyed by its run id, so a run whose 1,024 ranks each publish a step
puts 1,024 events a step on one partition and one worker. Folded on the node, the 8 ranks of a
machine make one event per step, and the worker reads 8 times fewer events for the same steps:

- each rank logs through a :class:`RankLogger` (a :class:`~trainguard.producers.trainer.TrainerLogger`
  whose events go to the node's local socket, ``TRAINGUARD_RANK_SOCKET``, by default this user's
  own: see :func:`socket_path`). The send never waits: when no folder of this user's listens
  (another user's gets nothing), or its queue is full, the event goes straight to Kafka as an
  unfolded per-rank event, so nothing is lost when the node agent is down;
- a :class:`RankFolder` (``trainguard node --fold-ranks``) gathers each run's step from the ranks
  of its machine and publishes one ``metrics/1`` event once every rank it expects has reported, or
  ``max_wait_s`` after the step's first report: a late rank holds no one back, and its values,
  when they come, go out in an event of their own (a straggler is still judged with its peers).

The folded event's ``source`` is ``{"kind": "trainer", "host": ..., "rank": null, "ranks": [8, 9,
...]}``; its ``metrics`` are the node's summary (each name's mean over the ranks, a non-finite value
if any rank's is), which the per-source rules judge as one series per node; its ``per_rank`` keeps
every rank's values, named ``metric[rank]`` (``timing_s/update_actor[9]``), for the rules that
compare ranks (the straggler rule). A NaN on one rank is a NaN of its node's summary.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import selectors
import socket
import stat
import struct
import threading
import time
from collections import OrderedDict, deque
from typing import Any, cast

from trainguard.core import settings as settings_mod
from trainguard.core.kafka import KafkaSettings
from trainguard.core.publisher import Publisher
from trainguard.producers.trainer import TrainerLogger
from trainguard.schemas import events as ev

log = logging.getLogger("trainguard.ranks")

DROPPED = "trainguard/dropped_events"
MAX_DATAGRAM = 100_000  # a step's message, under half of Linux's default socket buffer; larger go to Kafka
MAX_PENDING = 4096      # steps held at once (every run, every rank group); the oldest goes out first
MAX_KNOWN = 4096        # (run, host) pairs whose ranks are remembered


def socket_path(path: str | None = None) -> str:
    """``path``, else ``TRAINGUARD_RANK_SOCKET``, else this user's own: in ``$XDG_RUNTIME_DIR``
    (a folder only its user can enter) when set, else ``/tmp/trainguard-ranks-<uid>.sock``. A
    path shared by every user would let another local user listen there first and receive every
    rank's steps."""
    found = path or settings_mod.value("TRAINGUARD_RANK_SOCKET")
    if found:
        return found
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime):
        return os.path.join(runtime, "trainguard-ranks.sock")
    return f"/tmp/trainguard-ranks-{os.getuid()}.sock"


def peer_uid(sock: socket.socket, path: str) -> int | None:
    """The uid of the process listening at the other end of a connected local socket (Linux's
    ``SO_PEERCRED``; elsewhere the socket file's owner), or None when it cannot be told."""
    try:
        if hasattr(socket, "SO_PEERCRED"):
            _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                   struct.calcsize("3i")))
            return uid
        return os.stat(path).st_uid
    except OSError:
        return None


def fold(run_id: str, step: int, host: str, per_rank: dict[int, dict]) -> dict:
    """One ``metrics/1`` event from the decoded events of several ranks at one step: in
    ``metrics`` the node's summary of each name (the mean over the ranks that logged it; a
    non-finite value if any rank's is, so a NaN on one rank is a NaN of its node), in
    ``per_rank`` every rank's values named ``metric[rank]``, the ranks in ``source.ranks``, the
    earliest report's ``ts``, and the ranks' dropped-event counts summed."""
    finite: dict[str, list[float]] = {}
    dropped: float | None = None
    bad: dict[str, float] = {}
    values: dict[str, float] = {}
    tags: dict[str, str] = {}
    layers = set()
    for rank in sorted(per_rank):
        event = per_rank[rank]
        for name, value in event["metrics"].items():
            if name == DROPPED:
                dropped = (dropped or 0.0) + value
                continue
            values[f"{name}[{rank}]"] = value
            if math.isfinite(value):
                finite.setdefault(name, []).append(value)
            else:
                bad.setdefault(name, value)
                finite.setdefault(name, [])
        for k, v in (event.get("tags") or {}).items():
            tags.setdefault(k, v)
        layers.add(event.get("layer"))
    summary = {name: bad[name] if name in bad else _mean(vals) for name, vals in finite.items()}
    if dropped is not None:
        summary[DROPPED] = dropped
    src = ev.source("trainer", host)
    src["ranks"] = sorted(per_rank)
    ts = min(e["ts"] for e in per_rank.values())
    layer = layers.pop() if len(layers) == 1 else None
    event = ev.metrics_event(run_id, step, summary, src=src, ts=ts, layer=layer, tags=tags or None)
    event["per_rank"] = values
    return event


def _mean(values: list[float]) -> float:
    """The mean of finite values, itself finite: each is divided before they are added (a sum of
    two 1e308 is inf, which the worker would judge as a non-finite value no rank logged)."""
    n = len(values)
    return math.fsum(v / n for v in values)


def _fitting(event: dict) -> bytes | None:
    """``event`` encoded if the worker would take it (the event schema's checks and byte cap), else None."""
    try:
        raw = ev.encode(ev.validate(event))
    except (ev.SchemaError, TypeError, ValueError):
        return None
    return raw if len(raw) <= ev.MAX_EVENT_BYTES else None


class NodeRelay:
    """A rank's publisher: events go to the node's folder over a local socket (``SOCK_SEQPACKET``:
    one message per event, queued in the connection's buffer), never waiting; when no folder takes
    one (none listens, its buffer is full, the event is too large), it goes to Kafka through a
    :class:`Publisher` opened on first need. A lost folder is looked for again once a second."""

    RETRY_S = 1.0

    def __init__(self, settings: KafkaSettings, path: str | None = None, clock=time.monotonic):
        self.settings = settings
        self.path = socket_path(path)
        self.relayed = 0
        self.direct = 0
        self.dropped = 0
        self.clock = clock
        self._kafka: Publisher | None = None
        self._sock: socket.socket | None = None
        self._retry_at = 0.0
        self._said = False
        self._said_foreign = False

    def _direct(self) -> Publisher:
        if self._kafka is None:
            self._kafka = Publisher(self.settings)
        return self._kafka

    def _connected(self) -> socket.socket | None:
        if self._sock is None and self.clock() >= self._retry_at:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.setblocking(False)
            try:
                sock.connect(self.path)
            except OSError as exc:
                sock.close()
                self._unreached(exc)
                return None
            uid = peer_uid(sock, self.path)
            if uid != os.getuid():  # another user listens there: it gets none of this run's steps
                sock.close()
                self._retry_at = self.clock() + self.RETRY_S
                if not self._said_foreign:
                    self._said_foreign = True
                    log.warning("trainguard: the rank socket %s is held by %s, not by this user (uid %d): "
                                "steps go straight to Kafka", self.path,
                                "an unknown user" if uid is None else f"uid {uid}", os.getuid())
                return None
            self._sock = sock
        return self._sock

    def _unreached(self, exc: OSError) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._retry_at = self.clock() + self.RETRY_S
        if not self._said:
            self._said = True
            log.info("trainguard: no rank folder at %s (%s): steps go straight to Kafka", self.path, exc)

    def publish(self, topic: str, key: str | None, value: bytes | None, partition: int | None = None,
                on_delivery=None) -> bool:
        if topic == self.settings.topics.events and value is not None and len(value) <= MAX_DATAGRAM:
            sock = self._connected()
            if sock is not None:
                try:
                    sock.send(value, socket.MSG_NOSIGNAL)
                    self.relayed += 1
                    return True
                except (BlockingIOError, InterruptedError):
                    pass  # the folder is behind: this one goes direct, the connection stays
                except OSError as exc:  # the folder went away
                    self._unreached(exc)
        self.direct += 1
        return self._direct().publish(topic, key, value, partition, on_delivery)

    # What TrainerLogger asks of its publisher (``dropped``: events it could not even build).
    def lost(self) -> int:
        return self.dropped + (self._kafka.lost() if self._kafka else 0)

    def pending(self) -> int:
        return self._kafka.pending() if self._kafka else 0

    def flush(self, timeout: float = 10.0) -> int:
        return self._kafka.flush(timeout) if self._kafka else 0

    def close(self, timeout: float = 10.0) -> int:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        return self._kafka.close(timeout) if self._kafka else 0

    def stats(self) -> dict:
        base: dict[str, Any] = self._kafka.stats() if self._kafka else {
            "sent": 0, "delivered": None, "dropped": 0, "delivery_failed": 0, "purged_at_close": 0,
            "lost_fatal": 0, "lost": 0, "pending": 0, "producer_rebuilds": 0}
        return {**base, "sent": base["sent"] + self.relayed, "dropped": base["dropped"] + self.dropped,
                "lost": self.lost(), "relayed": self.relayed, "direct": self.direct}


class RankLogger(TrainerLogger):
    """The logger of one rank (not the run's main logger): its steps go to the node's folder.

    It reports no lifecycle of the run (``started``, ``finished``: rank 0's logger says those)
    and, like every logger, never raises into the training loop and never waits."""

    def __init__(self, run_id: str, rank: int, settings: KafkaSettings | None = None, *,
                 host: str | None = None, path: str | None = None):
        settings = settings or KafkaSettings.from_env()
        relay = cast(Publisher, NodeRelay(settings, path))  # it answers what TrainerLogger asks of a Publisher
        super().__init__(run_id, settings, host=host, rank=int(rank), publisher=relay)
        self._announce = False

    def close(self, timeout: float = 10.0, *, quiet: bool = False, end: str | None = None,
              step: int | None = None) -> dict:
        return super().close(timeout, quiet=quiet, end=None, step=step)


class _Step:
    __slots__ = ("first", "ranks")

    def __init__(self, first: float):
        self.first = first
        self.ranks: dict[int, dict] = {}


class RankFolder:
    """Gathers the ranks' steps from the node's socket and publishes one event per run, host and
    step (see the module's text). ``ranks_per_node``: how many ranks to wait for at a run's first
    step (the node agent passes its GPU count); later steps wait for the ranks seen so far.
    ``publisher``: shared with the node agent, or one of its own."""

    def __init__(self, settings: KafkaSettings | None = None, *, path: str | None = None,
                 publisher: Publisher | None = None, max_wait_s: float = 0.5, ranks_per_node: int | None = None,
                 clock=time.monotonic):
        self.settings = settings or KafkaSettings.from_env()
        self.path = socket_path(path)
        self.publisher = publisher or Publisher(self.settings)
        self._own_publisher = publisher is None
        self.max_wait_s = float(max_wait_s)
        self.ranks_per_node = ranks_per_node
        self.clock = clock
        self.pending: OrderedDict[tuple, _Step] = OrderedDict()
        self.known: OrderedDict[tuple, set] = OrderedDict()    # (run, host) -> ranks seen
        self.done: dict[tuple, deque] = {}                     # (run, host) in known -> steps sent lately
        self.folded = 0        # events published, each for one or more ranks
        self.ranks_in = 0      # rank steps received
        self.late = 0          # rank steps that came after their step went out
        self.unfolded = 0      # rank steps sent as they came: folded, they would break the schema's limits
        self.split = 0         # steps sent in parts for the same reason
        self.passed = 0        # anything else, sent on as it came (the worker judges or dead-letters it)
        self._sock: socket.socket | None = None
        self._inode: int | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- the socket ----------------------------------------------------------------------

    def bind(self) -> "RankFolder":
        """Listen at the path. What is already there is replaced only when it is a socket of this
        user's that no one listens on (left by a folder that died); anything else (a file, another
        user's socket, a live folder) is left alone, and OSError says why."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            try:
                sock.bind(self.path)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                why = self._not_stale(self.path)
                if why:
                    raise OSError(errno.EADDRINUSE, f"{self.path} {why}; left alone") from None
                os.unlink(self.path)
                sock.bind(self.path)
            os.chmod(self.path, 0o600)  # this user's ranks only
            self._inode = os.lstat(self.path).st_ino
            sock.listen(1024)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        return self

    @classmethod
    def _not_stale(cls, path: str) -> str | None:
        """Why what is at ``path`` may not be replaced, or None when it is a dead socket of ours."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        if not stat.S_ISSOCK(st.st_mode):
            return "exists and is not a socket"
        if st.st_uid != os.getuid():
            return f"is a socket of another user (uid {st.st_uid})"
        if cls._alive(path):
            return "has a folder listening already"
        return None

    @staticmethod
    def _alive(path: str) -> bool:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.connect(path)
            return True
        except OSError:
            return False
        finally:
            probe.close()

    def start(self) -> "RankFolder":
        if self._sock is None:
            self.bind()
        self._thread = threading.Thread(target=self._serve, name="trainguard-rank-folder", daemon=True)
        self._thread.start()
        return self

    def _serve(self) -> None:
        assert self._sock is not None
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ)
        tick = min(0.05, self.max_wait_s / 4)
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(tick):
                    conn = cast(socket.socket, key.fileobj)
                    try:
                        if conn is self._sock:
                            rank_conn, _addr = self._sock.accept()
                            rank_conn.setblocking(False)
                            sel.register(rank_conn, selectors.EVENT_READ)
                            continue
                        for _ in range(256):  # what this rank queued, a bounded share at a time
                            raw = conn.recv(MAX_DATAGRAM + 1)
                            if not raw:  # the rank closed its logger, or exited
                                sel.unregister(conn)
                                conn.close()
                                break
                            self.take(raw)
                    except (BlockingIOError, InterruptedError):
                        pass
                    except OSError as exc:
                        if conn is self._sock:
                            raise
                        log.debug("trainguard: a rank's connection failed: %s", exc)
                        sel.unregister(conn)
                        conn.close()
                    except Exception:  # a monitoring daemon outlives what it monitors
                        log.exception("trainguard: the rank folder skipped a message")
                self.due()
        except OSError as exc:
            if not self._stop.is_set():
                log.error("trainguard: the rank folder stopped reading %s: %s (ranks now publish directly)",
                          self.path, exc)
        finally:
            for key in list(sel.get_map().values()):
                if key.fileobj is not self._sock:
                    cast(socket.socket, key.fileobj).close()
            sel.close()

    def close(self, timeout: float = 10.0) -> None:
        """Publish every step still held, then stop."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        for key in list(self.pending):
            self._send(key)
        if self._sock is not None:
            self._sock.close()
            try:
                if os.lstat(self.path).st_ino == self._inode:  # still ours, not a newer folder's
                    os.unlink(self.path)
            except OSError:
                pass
        if self._own_publisher:
            self.publisher.close(timeout)
        else:
            self.publisher.flush(timeout)

    # -- folding (no I/O but the publisher; the tests drive these) ------------------------

    def take(self, raw: bytes) -> None:
        """One datagram: a rank's step is held for folding; anything else goes on unchanged."""
        try:
            event = ev.decode(raw)
        except ev.SchemaError:
            event = None
        src = event.get("source") if event is not None else None
        if (event is None or event["schema"] != ev.METRICS or src is None or src.get("rank") is None
                or src.get("kind") != "trainer"):
            self.passed += 1
            key = event.get("run_id") if event is not None else None
            self.publisher.publish(self.settings.topics.events, key, raw)
            return
        self.ranks_in += 1
        run_id, step, rank = event["run_id"], event["step"], src["rank"]
        group = (run_id, src.get("host") or "")
        key = (*group, step)
        known = self.known.get(group)
        if known is None:
            known = self.known[group] = set()
            if len(self.known) > MAX_KNOWN:
                old = next(iter(self.known))
                self.known.pop(old)
                self.done.pop(old, None)
        else:
            self.known.move_to_end(group)
        held = self.pending.get(key)
        more = False
        if held is not None and rank not in held.ranks and len(held.ranks) >= ev.MAX_FOLDED_RANKS:
            self._send(key)  # as many ranks as one event carries: out they go, this one starts the next
            held, more = None, True
        if held is None:
            if not more and step in self.done.get(group, ()):
                self.late += 1  # its peers went out already: this rank's values go alone
                self._publish(run_id, step, group[1], {rank: event})
                return
            held = self.pending[key] = _Step(self.clock())
            if len(self.pending) > MAX_PENDING:
                self._send(next(iter(self.pending)))
        held.ranks[rank] = event
        if len(known) < 1024:
            known.add(rank)
        expect = len(known) if group in self.done else self.ranks_per_node
        if expect and len(held.ranks) >= expect:
            self._send(key)

    def due(self) -> None:
        """Publish every step whose wait is over."""
        if not self.pending:
            return
        limit = self.clock() - self.max_wait_s
        for key in [k for k, held in self.pending.items() if held.first <= limit]:
            self._send(key)

    def _send(self, key: tuple) -> None:
        held = self.pending.pop(key)
        run_id, host, step = key
        group = (run_id, host)
        if group in self.known:  # a group pushed out of known is forgotten whole, its steps sent too
            done = self.done.get(group)
            if done is None:
                done = self.done[group] = deque(maxlen=64)
            done.append(step)
        self._publish(run_id, step, host, held.ranks)

    def _publish(self, run_id: str, step: int, host: str, per_rank: dict[int, dict]) -> None:
        """One folded event, or, when it would break the event schema's limits (names, values,
        bytes) and be dead-lettered with every rank's values, the ranks in parts that pass, down
        to each rank's own event as it came."""
        if len(per_rank) == 1:
            rank, event = next(iter(per_rank.items()))
            raw = _fitting(fold(run_id, step, host, per_rank))
            if raw is None:  # its values alone break a limit once folded (a 256-character name)
                self.unfolded += 1
                raw = ev.encode(event)
            else:
                self.folded += 1
            self.publisher.publish(self.settings.topics.events, run_id, raw)
            return
        raw = _fitting(fold(run_id, step, host, per_rank))
        if raw is not None:
            self.folded += 1
            self.publisher.publish(self.settings.topics.events, run_id, raw)
            return
        self.split += 1
        ranks = sorted(per_rank)
        half = len(ranks) // 2
        for part in (ranks[:half], ranks[half:]):
            self._publish(run_id, step, host, {r: per_rank[r] for r in part})

    def stats(self) -> dict:
        return {"folded_events": self.folded, "rank_steps": self.ranks_in, "late_rank_steps": self.late,
                "passed_on": self.passed, "held_steps": len(self.pending), "unfolded_rank_steps": self.unfolded,
                "split_steps": self.split}

"""The detection engine: one event in, alerts and commands out. No Kafka inside.

The same object serves the Faust worker (``streams/app.py``), the offline replay and the
tests. State lives in a mapping the caller provides (a Faust table's store, or a dict):

- ``b"<run>"``            -> :class:`RunState`: breaker, checkpoints, latest node snapshot
- ``b"<run>|<source>"``   -> :class:`SourceState`: every metric's baseline and rule streaks

A step event with 50 metrics touches one source entry and one run entry. Entries changed
since the last flush are listed in :attr:`Engine.dirty` (key -> partition) so the worker
writes each changed entry to the changelog once per batch, not once per metric or event.
Each run entry remembers the offset of the last event applied from each partition, so events
replayed after a restart (at-least-once delivery) change nothing and emit nothing new. With the
topic's partition count given, an event read from a partition its run id does not hash to (Kafka's
murmur2 partitioner) is a dead letter: it could otherwise move the run's offsets past its real events.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any, MutableMapping, cast

from trainguard.core.kafka import partition_for
from trainguard.schemas import events as ev
from trainguard.schemas.signing import SigningKey
from trainguard.streams import keys, policy, trackers
from trainguard.streams.engine.book import STALE
from trainguard.streams.engine.breaker import STEERING_LIFECYCLE
from trainguard.streams.engine.judging import EventContext, Judging
from trainguard.streams.engine.operators import OperatorActions
from trainguard.streams.engine.outputs import DLQ_EXCERPT_BYTES, Output, OutputKind, dead_letter, fit
from trainguard.streams.engine.state import (
    MAX_BOOK,
    MAX_CHECKPOINTS,
    MAX_RECENT_ALERTS,
    MAX_SILENCES,
    MAX_SNAPSHOT_HOSTS,
    MAX_SNAPSHOT_METRICS,
    MAX_UNWATCHED,
    STATE_VERSION,
    Limits,
    RunState,
    SourceState,
    known_fields,
)
from trainguard.streams.minutes import MinuteWindows
from trainguard.streams.rules import RuleSet

__all__ = ["Engine", "EventContext", "Limits", "Output", "OutputKind", "RunState", "SourceState", "known_fields",
           "DLQ_EXCERPT_BYTES", "MAX_BOOK", "MAX_CHECKPOINTS", "MAX_RECENT_ALERTS", "MAX_SILENCES",
           "MAX_SNAPSHOT_HOSTS", "MAX_SNAPSHOT_METRICS", "MAX_UNWATCHED", "STATE_VERSION", "STATUS_REFRESH_S",
           "STEERING_LIFECYCLE"]

log = logging.getLogger("trainguard.engine")

STATUS_REFRESH_S = 30.0  # an idle run's status is published again this often (and after a takeover)


class Engine(Judging, OperatorActions):
    """The facade: events and acks in, outputs out; the timer's work; forgetting a run. What
    judging, the alert book, correlation, the breaker, operator actions and status do lives in
    the rooms beside this file, which this class joins."""

    dead_letter = staticmethod(dead_letter)

    def __init__(self, rules: RuleSet, store: MutableMapping[bytes, Any] | None = None, *,
                 windows: MutableMapping[Any, Any] | None = None, signing_key: SigningKey | None = None,
                 verify_keys: dict[str, SigningKey] | None = None, require_signed: bool | None = None,
                 finished_grace_s: float = 600.0, idle_ttl_s: float = 7 * 86400.0, limits: Limits | None = None,
                 summary_retention_s: float = 7 * 86400.0, partitions: int | None = None):
        self.rules = rules
        # The events topic's partition count: a run's events are read from the partition its id
        # hashes to, and from no other (None: not checked, for replays and evaluations).
        self.partitions = partitions
        self._partition_of: dict[str, int] = {}  # run id -> its partition (murmur2 costs a few µs)
        self.misplaced = 0  # events dead-lettered as read from a partition not their run's
        # A forgotten run's last status stays on the status topic this long (its outcome, alerts,
        # reports): the run page and `status` still show how it ended.
        self.summary_retention_s = float(summary_retention_s)
        self._status_at: dict[bytes, float] = {}   # run -> when its status was last published
        self._final: dict[bytes, dict] = {}        # forgotten run -> its summary, not yet published
        # Idle tiny runs, held as the bytes the checkpoint wrote to the changelog (``written``) ->
        # when they are forgotten. The clock looks no further into them.
        self._parked: dict[bytes, float] = {}
        self.limits = limits or Limits()
        # A run's state is forgotten (tombstoned) this long after it finished or was stopped, and
        # after this long without any event: without an end, state grew by every run ever seen.
        self.finished_grace_s = float(finished_grace_s)
        self.idle_ttl_s = float(idle_ttl_s)
        self.forgotten = 0
        self._forgotten_now: dict[str, list[str]] = {}  # why -> run ids forgotten in this tick, said at its end
        self.store: MutableMapping[bytes, Any] = {} if store is None else store
        # Per-interval aggregates of the resampled metrics (a windowed table in the worker).
        self.windows = MinuteWindows(rules.window_s, windows, keep_s=rules.window_keep_s)
        self.signing_key = signing_key
        # Trainer and operator events that steer the breaker are accepted only when signed under
        # one of these secrets (all configured ones: rotation); without keys (replay, evaluation,
        # local opt-in) they are taken as they come.
        self.verify_keys = verify_keys if verify_keys is not None else (
            {signing_key.key_id: signing_key} if signing_key is not None else {})
        self.require_signed = bool(self.verify_keys) if require_signed is None else require_signed
        self.forged = 0  # steering events and acks refused as unsigned or forged
        self.dirty: dict[bytes, int] = {}
        self.touched: set[bytes] = set()  # runs whose status changed since status_outputs()
        self.worker_name = f"{socket.gethostname()}:{os.getpid()}"
        self._severity = {r.name: r.severity for r in rules.rules} | {i.name: i.severity for i in rules.incidents}
        self.processed = 0
        self.samples = 0
        self.skipped_replays = 0
        self._params_cache: dict[str, tuple[int, float, bool]] = {}
        self.clock = time.time  # when an event was received; replays and evaluations set their own
        self._cross_rules = [r for r in rules.rules if r.kind == "cross_rank"]
        # A straggler needs peers: below this many ranks no cross-rank rule (a detector rule) can judge.
        self._cross_min_ranks = min((max(2, int(cast(dict, r.detector).get("min_peers", 4)))
                                     for r in self._cross_rules), default=0)
        self._fired = False  # an alert fired while handling the current event (incidents listen)
        self._cross_pairs: dict[tuple, list] = {}
        self._judged: dict[tuple[str, str], bool] = {}  # (source kind, name) -> whether a rule judges it
        self._kept: dict[bytes, tuple] = {}  # source key -> (event shape, the names of it that are rows)
        # Callables given every decoded event that is applied (not replays), before detection:
        # e.g. the worker's Prometheus exporter. Empty by default; keep them cheap.
        self.on_event: list = []

    def handle(self, raw: bytes, partition: int = 0, offset: int = -1, topic: str = "") -> list[Output]:
        """Apply one raw event; never raises on bad input (it becomes a DLQ record)."""
        try:
            event = ev.decode(raw, expect=(ev.METRICS, ev.CHECKPOINT, ev.LIFECYCLE, ev.OPERATOR))
        except ev.SchemaError as exc:
            return [self.dead_letter(raw, str(exc), topic, partition, offset)]
        except Exception as exc:  # a shape the decoder did not foresee: still a dead letter, never a crash
            return [self.dead_letter(raw, f"undecodable: {type(exc).__name__}: {exc}", topic, partition, offset)]
        try:
            return self._bounded(self.apply(event, partition, offset, raw=raw, topic=topic))
        except Exception as exc:  # a bug must not stop the pipeline; keep the evidence
            return [self.dead_letter(raw, f"internal error while processing: {type(exc).__name__}: {exc}",
                                     topic, partition, offset)]

    def handle_ack(self, raw: bytes, partition: int = 0, offset: int = -1, topic: str = "",
                   appended_at: float | None = None) -> list[Output]:
        """Apply one ack from the trainer (``control.acks``). A ``failed`` or ``rejected`` ack of
        the command the breaker waits for re-arms it (or stops the run, by policy) and raises a
        ``command_not_applied`` alert; anything else changes nothing. Never raises on bad input.
        ``appended_at``: the broker's append time of the ack (LogAppendTime), against which the
        alert says how far the trainer's clock is off."""
        try:
            ack = ev.decode(raw, expect=(ev.ACK,))
        except ev.SchemaError as exc:
            return [self.dead_letter(raw, str(exc), topic, partition, offset)]
        except Exception as exc:
            return [self.dead_letter(raw, f"undecodable: {type(exc).__name__}: {exc}", topic, partition, offset)]
        try:
            return self._bounded(self._ack(ack, raw, partition, offset, topic, appended_at))
        except Exception as exc:  # a bug must not stop the acks agent; keep the evidence
            return [self.dead_letter(raw, f"internal error while processing: {type(exc).__name__}: {exc}",
                                     topic, partition, offset)]

    def apply(self, event: dict, partition: int = 0, offset: int = -1, *, raw: bytes | None = None,
              topic: str = "") -> list[Output]:
        """Apply one decoded event (``raw``, ``topic``: where it came from, for a dead letter)."""
        refused = self._misplaced(event, raw, topic, partition, offset)
        if refused is None:
            refused = self._unauthentic(event, raw, topic, partition, offset)
            if refused is not None and event["schema"] == ev.CHECKPOINT:
                self._unsigned_checkpoint(event, refused.value["reason"] if refused.value else "")
        if refused is not None:
            return [refused]
        run_id = event["run_id"]
        run_key = run_id.encode()
        run = self._run(run_key)
        if offset >= 0:
            last = run.offsets.get(str(partition), -1)
            if offset <= last:
                self.skipped_replays += 1
                return []
            run.offsets[str(partition)] = offset
        run.partition = partition
        self._changed(run_key, partition)
        self.processed += 1
        if run.events is not None:
            run.events += 1
        if event["schema"] == ev.METRICS:
            self._vouch(event)
        else:
            self._authority = (None, None)
        admitted = "source" not in event or self._admit(run, run_id, event["source"])
        if not admitted and event["schema"] == ev.METRICS:
            return []  # over the run's source cap: counted in its status, its state stays bounded
        if self.on_event:
            for callback in self.on_event:
                try:
                    callback(event)
                except Exception:  # an observer's failure must not cost the event its detection
                    log.exception("trainguard: on_event callback failed")
        outputs: list[Output] = []
        self._fired = False
        if "source" in event and admitted:
            apart = self._apart()
            self._seen(run, run_id, {**event, "source": {**event["source"], "kind": apart + event["source"]["kind"]}}
                       if apart else event, outputs)
        kind = event["schema"]
        if kind == ev.METRICS:
            dropped = event["metrics"].get("trainguard/dropped_events")
            if dropped is not None:
                run.dropped_events = dropped
            self._metrics(event, run, run_id, partition, outputs)
        elif kind == ev.OPERATOR:
            self._operator(event, run, run_id, outputs)
        elif kind == ev.CHECKPOINT:
            run.checkpoints.append(self._certified(run, event))
            del run.checkpoints[:-MAX_CHECKPOINTS]
            policy.on_checkpoint(run.breaker, event["step"])
        elif event["event"] == "rolled_back":
            self._rolled_back(event, run, run_id, partition, outputs)
        elif event["event"] in ("finished", "stopped"):
            run.finished = True
            run.finished_at = self.clock()
            run.stopped = event["event"] == "stopped"
            # Nothing will judge its alerts again: they end with it (a stop's last step fired two).
            for alert_id in self._open_alerts(run, run_id):
                alert = self._open_alert(run, run_id, alert_id, close=True)
                if alert is not None:
                    self._add(outputs, self._resolve(run, alert, event, resolution=f"the run {event['event']}"))
        elif event["event"] == "started":
            run.announced = True
            if run.finished:  # a new run under an id that ended: the old one's checkpoints are not its own
                run.checkpoints.clear()
                run.breaker = policy.BreakerState()
                run.nonfinite, run.command, run.unsigned_checkpoints = None, None, []
            elif ((event.get("source") or {}).get("rank") in (None, 0)
                  and run.breaker.epoch not in (None, repr(event["ts"]))
                  and (run.checkpoints or run.breaker.attempt)):
                # Its trainer started again (a crash, a resume): the new process's listener applies
                # only checkpoints it reported itself, and the old process's ladder is not its own;
                # the hour's rollbacks still count against max_rollbacks_per_hour.
                run.checkpoints.clear()
                run.nonfinite = None  # it resumes from a checkpoint of its own; its signals say how that is
                old = run.breaker
                run.breaker = policy.BreakerState(rollback_ts=old.rollback_ts, attempt=old.attempt)
            run.finished, run.finished_at, run.stopped = False, None, False
            policy.on_started(run.breaker, event.get("detail"), event["ts"])
        return outputs

    def _misplaced(self, event: dict, raw: bytes | None, topic: str, partition: int, offset: int) -> Output | None:
        """The dead letter of an event read from a partition its run id does not hash to:
        written there by hand or by a client whose partitioner is not Kafka's murmur2 (kcat's and
        librdkafka's default is not). Taken, its offset would pass the run's real events as replays."""
        if not self.partitions or partition < 0:
            return None
        run_id = event["run_id"]
        own = self._partition_of.get(run_id)
        if own is None:
            if len(self._partition_of) > 100_000:
                self._partition_of.clear()
            own = self._partition_of[run_id] = partition_for(run_id, self.partitions)
        if own == partition:
            return None
        self.misplaced += 1
        reason = (f"read from partition {partition}, but run {run_id!r} belongs on partition {own} of "
                  f"{self.partitions} (Kafka's murmur2 partitioner of its key): refused, it changes nothing; "
                  f"produce keyed by run_id with the murmur2 partitioner (librdkafka/kcat: "
                  f"partitioner=murmur2_random)")
        log.warning("trainguard: %s", reason)
        return dead_letter(raw if raw is not None else ev.encode(event), reason, topic, partition, offset)

    def tick(self, now: float | None = None) -> list[Output]:
        """Timer work, every few seconds: sources gone silent (a hung trainer, a dead node), and
        runs whose state has served its time (finished longer than ``finished_grace_s`` ago,
        or without any event for ``idle_ttl_s``) forgotten."""
        now = self.clock() if now is None else now
        self._authority = (None, None)  # silence is the worker's own observation
        stale_rules = [r for r in self.rules.rules if r.kind == "stale"]
        outputs: list[Output] = []
        wall = time.time()
        for key in [k for k in list(self.store.keys()) if keys.is_run_key(k)]:
            if type(self.store[key]) is bytes and key not in self._parked:  # restored: parked if tiny
                until = self._park_until(self._decoded(key, self.store[key]))
                if until is not None:
                    self._parked[key] = until
            until = self._parked.get(key)
            if until is not None:  # an idle tiny run: nothing to judge (it is not judged for silence)
                if now > until:
                    self.forget(key, keep_summary=False)
                elif wall - self._status_at.get(key, 0.0) >= STATUS_REFRESH_S:
                    self.touched.add(key)
                continue
            run = self._run(key)
            last = max((seen[0] for seen in run.last_seen.values()), default=None)
            # Only a run its trainer vouched for (a checkpoint to roll back to, a start) is kept for the
            # usual idle time: an invented one costs nothing lasting, however many events it sent.
            tiny, vouched = self._tiny(run), self._authenticated(run)
            if (run.finished and now - (run.finished_at or last or now) > self.finished_grace_s) or \
                    (last is not None and now - last > (self.idle_ttl_s if vouched else self.limits.tiny_run_ttl_s)):
                self.forget(key, keep_summary=not tiny)
                continue
            if wall - self._status_at.get(key, 0.0) >= STATUS_REFRESH_S:
                self.touched.add(key)  # an idle run's status stays fresh, and names this worker after a takeover
            expired = [] if run.finished else self._expired_commands(run, key.decode(), now)
            if expired:
                outputs += expired
                self._changed(key, run.partition)
            # Invented run ids would each page as hung: with keys, only a run its trainer announced
            # (a signed "started", which TrainerLogger sends) or that reported a checkpoint is judged
            # for silence; without keys, a run of more than a few events.
            if run.finished or not (vouched or (not self.require_signed and not tiny)):
                continue
            run_id = key.decode()
            for rule in stale_rules:
                timeout = float(cast(dict, rule.detector).get("timeout_s", 300))  # kind "stale": it has one
                already = {k.rsplit("|", 1)[1] for k in [*self._in_room(run, STALE), *run.dismissed]
                           if k.startswith(rule.name + "|")}
                for kind, silent, step, src in trackers.silent_sources(run.last_seen, timeout, rule.sources,
                                                                       already, now):
                    event = {"step": step or 0, "ts": now, "source": src}
                    alert = self._alert(event, run, run_id, ev.source_id(src), rule, "heartbeat", silent,
                                        {"detector": "stale", "silent_s": silent, "timeout_s": timeout,
                                         "last_step": step}, run.breaker.attempt)
                    self._add(outputs, self._fire(run, alert, rule, STALE, f"{rule.name}|{kind}"))
                    self._changed(key, run.partition)
        self._say_forgotten()
        return self._bounded(outputs)

    def _say_forgotten(self, named: int = 5) -> None:
        """One line per reason for the runs a tick forgot: thousands of invented runs expire at
        once, and a line each was noise (and, through the repeat filter, memory)."""
        for why, run_ids in self._forgotten_now.items():
            if len(run_ids) == 1:
                log.info("trainguard: forgot run %s (%s)", run_ids[0], why)
            else:
                more = f" and {len(run_ids) - named} more" if len(run_ids) > named else ""
                log.info("trainguard: forgot %d runs (%s): %s%s", len(run_ids), why, ", ".join(run_ids[:named]), more)
        self._forgotten_now = {}

    def vouched(self, run_id: str) -> bool:
        """Whether this engine holds ``run_id`` as vouched for by its trainer (``_authenticated``);
        a parked run is a tiny unauthenticated one, read without waking it."""
        key = run_id.encode()
        if key not in self.store or key in self._parked:
            return False
        return self._authenticated(self._run(key))

    def _bounded(self, outputs: list[Output]) -> list[Output]:
        """Each alert and report as it fits one message (``outputs.fit``: context sections left
        out and named), so that no name or snapshot an event carried costs the run its page."""
        limit = self.limits.record_bytes
        for i, out in enumerate(outputs):
            if out.kind in (OutputKind.ALERT, OutputKind.REPORT) and out.value is not None:
                value = fit(out.value, limit)
                if value is not out.value:
                    log.warning("trainguard: run %s: a %s over the %d-byte message limit: left out %s", out.key,
                                out.kind.value, limit, ", ".join(value["cut"]))
                    outputs[i] = Output(out.kind, out.key, value)
        return outputs

    def forget(self, run_key: bytes, keep_summary: bool = True) -> None:
        """Delete a run's state, its sources' and their windows (tombstones in the changelogs);
        its status becomes its summary (``keep_summary``) or a tombstone."""
        run = self._run(run_key)
        run_id = run_key.decode()
        for sid in run.sources:
            key = keys.source_key(run_id, sid)
            state = self.store.get(key)
            if state is None:
                continue
            if type(state) is bytes:
                state = self._source(key, "")
            self._kept.pop(key, None)
            for start in [*state.windows, *([] if state.minute is None else [state.minute])]:
                self.windows.delete(key, start, run.partition)
            del self.store[key]
            self._changed(key, run.partition)
        summary = self.summary(run_key) if keep_summary else None
        if summary is not None:
            self._final[run_key] = summary
        self._status_at.pop(run_key, None)
        self._partition_of.pop(run_id, None)
        del self.store[run_key]
        self._changed(run_key, run.partition)  # its summary replaces its status
        self.forgotten += 1
        self._forgotten_now.setdefault("finished" if run.finished else "idle", []).append(run_id)

"""The trainer side: publish a run's metrics and checkpoints without ever slowing it down.

>>> logger = TrainerLogger("ppo-7b-0412")              # doctest: +SKIP
>>> logger.log({"actor/kl_loss": 0.012, "critic/score/mean": 0.41}, step=12)
>>> logger.checkpoint_saved(12, "/ckpt/global_step_12")
>>> logger.close()

``close()`` reports that the run finished (lifecycle ``finished``; nothing more when a
``stopped`` was reported when a stop command was applied), so the worker does not take the
silence after the last step for a hung trainer. A run that crashes reports nothing: leaving a
``with TrainerLogger(...)`` block by an exception closes without a report, and the worker's
staleness rule pages once.

``log()`` sends all metrics of one step and source as one event; the seed's
``log_metric(name, value, step=...)`` gathers single values and sends them together
when the step moves on. Nothing here raises into the training loop or waits on the
broker: values that cannot be read as numbers are skipped and counted; a step the worker
would refuse (a negative step, a metric name past 256 characters, more than 10,000 values:
the events schema's own checks) is rejected at once, ``log()`` returning False, counted and
said once per cause; events that cannot be queued are dropped and counted, and the count of
those lost travels in the run's own metrics (``trainguard/dropped_events``). ``close()``
prints every count by its cause.

A logger's own publisher sends from a thread of its own: ``log()`` checks a step, copies it and
hands it over (about 5 us); encoding it, its MAC and ``produce()`` happen on that thread, in the
order the events were made, while the loop waits on its GPU. ``close()`` and ``flush()`` wait
for what was handed over. A publisher passed in (shared with a node logger, say) is used as it is.
"""

from __future__ import annotations

import logging
import math
import socket
import sys
import time

import orjson

from trainguard.core.kafka import KafkaSettings
from trainguard.core.publisher import Publisher
from trainguard.producers.control import authored, trainer_key
from trainguard.producers.never_raise import never_raises
from trainguard.schemas import events as ev
from trainguard.schemas.signing import signed_bytes, signed_canonical

log = logging.getLogger("trainguard.trainer")
_FLOATS = frozenset({float})


def _as_float(v) -> float:
    t = type(v)
    if t is float:
        return v
    if t is int:
        return float(v)
    # numpy scalars, 0-d torch tensors, Decimal ...; .item() avoids keeping tensors alive
    item = getattr(v, "item", None)
    return float(item() if item is not None else v)


class TrainerLogger:
    def __init__(self, run_id: str, settings: KafkaSettings | None = None, *, host: str | None = None,
                 rank: int | None = 0, kind: str = "trainer", publisher: Publisher | None = None):
        self.source = ev.source(kind, host or socket.gethostname(), rank)
        self.run_id = run_id
        self.settings = settings or KafkaSettings.from_env()
        # Its own publisher sends from a thread of its own: log() pays a few checks and a queue put.
        self.publisher = publisher or Publisher(self.settings, background=True)
        self.skipped_values = 0
        self.rejected = 0                  # steps the worker would refuse, never sent
        self._rejections_said: set[str] = set()
        self._make_steady = self._steady_bytes  # one bound method, not one per step
        # A publisher that can encode on its own thread does; one that cannot (the rank relay, a
        # caller's own) is handed the bytes.
        self._publish_made = getattr(self.publisher, "publish_made", None) or self._publish_now
        self._pending_step: int | None = None
        self._pending: dict[str, float] = {}
        self._pending_tags: dict[str, str] = {}
        self._topic = self.settings.topics.events
        self._closed = False
        self._last_step: int | None = None
        self.ended: str | None = None      # "finished" / "stopped" once reported
        # A trainer says once that its run started (signed where keys are set: the worker tells it
        # from invented run ids), at its first step unless an integration said so before.
        self._announce = kind == "trainer"

    @property
    def run_id(self) -> str:
        return self._run_id

    @run_id.setter
    def run_id(self, run_id: str) -> None:
        """A logger may be pointed at another run between runs: what its events carry follows."""
        try:
            run_id = ev.check_run_id(run_id)
        except ev.SchemaError as exc:
            raise ValueError(str(exc)) from None
        self._run_id, self._key = run_id, run_id.encode()
        # What a steady step's bytes hold besides its step, time and metrics, taken at log() (the
        # sender encodes later): the run, the canonical form's part between the metrics and the step
        # (sorted keys), and ev.encode's up to the step.
        fixed = {"schema": ev.METRICS, "run_id": run_id, "source": self.source}
        self._wire = (run_id, orjson.dumps(fixed, option=orjson.OPT_SORT_KEYS)[1:-1].join((b",", b',"step":')),
                      orjson.dumps(fixed)[:-1] + b',"step":')
        # The metric names of the last accepted step; None until one whole event was checked (its
        # run id and source hold for every later one).
        self._names_checked: frozenset | None = None
        self._steady_fits = False

    def _failed(self, what: str, exc: BaseException) -> None:
        """An event that could not be made (never_raises reports here): counted as dropped."""
        self.publisher.dropped += 1
        log.debug("trainguard: %s: %s: %s", what, type(exc).__name__, exc)

    # -- metrics -------------------------------------------------------------------

    @never_raises("log() dropped a step", fallback=False)
    def log(self, metrics: dict, step: int, *, tags: dict[str, str] | None = None, ts: float | None = None) -> bool:
        """Publish one step's metrics as one event. Never raises; False if it was not queued."""
        if self._announce:
            self.lifecycle("started", step=step if type(step) is int else None)
        if (tags is None and ts is None and self._steady_fits and type(metrics) is dict and type(step) is int
                and 0 <= step < 2**63 and metrics.keys() == self._names_checked
                and _FLOATS.issuperset(map(type, metrics.values()))):
            # A loop's usual step: the names of the last step checked whole (known to fit one event),
            # every value a float, a plain step, this process's clock. Encoded by _steady_bytes on the
            # publisher's sender thread where it has one (floats are immutable, the dict is copied: a
            # loop may reuse it), in order with every other event.
            self._last_step = step
            return self._publish_made(self._topic, self._key, self._make_steady, self._wire, metrics.copy(), step,
                                      time.time())
        if type(metrics) is dict and _FLOATS.issuperset(map(type, metrics.values())):
            values = metrics  # the common case: nothing to convert, encoded (not kept) before returning
        else:
            values = {}
            for name, v in metrics.items():
                try:
                    values[name] = _as_float(v)
                except (TypeError, ValueError):
                    self.skipped_values += 1  # strings, lists, None ...: not metrics
        lost = self.publisher.lost()
        if lost:
            values = {**values, "trainguard/dropped_events": float(lost)}
        event = ev.metrics_event(self.run_id, int(step), values, src=self.source,
                                 ts=time.time() if ts is None else ts, tags=tags)
        payload = self._accepted(event, own_clock=ts is None)
        if payload is None:
            return False
        self._last_step = event["step"]
        return self.publisher.publish(self._topic, self._key, payload)

    def _steady_bytes(self, wire: tuple[str, bytes, bytes], metrics: dict, step: int, ts: float) -> bytes:
        """A steady step as it goes out, signed where there is a key: byte for byte what
        ``_accepted`` sends for the same event, and with the same count of events lost so far."""
        run_id, envelope, head = wire
        key = trainer_key(run_id)
        lost = self.publisher.lost()
        if lost or not math.isfinite(sum(metrics.values())):  # NaN/Inf go as strings: the general form
            if lost:
                metrics["trainguard/dropped_events"] = float(lost)  # a copy of the caller's dict
            return signed_bytes(ev.metrics_event(run_id, step, metrics, src=self.source, ts=ts), key)
        if key is None:  # as ev.encode writes it: the caller's order of names (the worker's cap keeps the first)
            return b"".join((head, str(step).encode(), b',"ts":', orjson.dumps(ts), b',"metrics":',
                             orjson.dumps(metrics), b"}"))
        # Sorted keys: metrics, run_id, schema, source, step, ts (canonical_bytes' order).
        return signed_canonical(b"".join((b'{"metrics":', orjson.dumps(metrics, option=orjson.OPT_SORT_KEYS),
                                          envelope, str(step).encode(), b',"ts":', orjson.dumps(ts), b"}")), key)

    def _publish_now(self, topic: str, key: bytes, make, *args) -> bool:
        value = make(*args)
        return value is not None and self.publisher.publish(topic, key, value)

    def _names_accepted(self, names) -> None:
        """Remember the names of a step just checked whole, and whether a steady step of them
        always fits one event (every value at its longest, 24 characters, the signature and a
        count of events lost)."""
        self._names_checked = frozenset(names)
        key = trainer_key(self.run_id)
        signature = 0 if key is None else sum(map(len, key.signature_parts)) + 64
        longest = (len(orjson.dumps(dict.fromkeys(names, 0))) + 24 * len(self._names_checked)
                   + len(self._wire[1]) + 64 + signature + len(b',"trainguard/dropped_events":') + 24)
        self._steady_fits = longest <= ev.MAX_EVENT_BYTES

    def _accepted(self, event: dict, *, own_clock: bool = False) -> bytes | None:
        """The event encoded when the worker would take it; else None, counted as rejected and its
        cause said once (the worker would only dead-letter it). ``own_clock``: its ``ts`` is this
        process's ``time.time()``, nothing to check."""
        try:
            # The whole event once; then what changes per step (run id and source are fixed), the
            # names only when they change: a loop logs the same ones every step, and checking 50
            # of them would double log()'s cost.
            names = event["metrics"].keys()
            if self._names_checked is None:
                ev.validate(event)
                self._names_accepted(names)
            elif names == self._names_checked:
                if not (own_clock and 0 <= event["step"] < 2**63 and "tags" not in event):
                    # the values and their names are known good; a millisecond clock is converted
                    event["ts"] = ev.check_step({**event, "metrics": {}})["ts"]
            else:
                ev.check_step(event)
                self._names_accepted(names)
            # Signed with the trainer's key where there is one: only such metrics make a worker with
            # keys act (a rollback, a stop); one HMAC over the bytes encoded anyway.
            payload = signed_bytes(event, trainer_key(self.run_id))
            if len(payload) > ev.MAX_EVENT_BYTES:
                raise ev.SchemaError(f"{len(payload)} bytes, past the {ev.MAX_EVENT_BYTES}-byte limit of an event")
        except ev.SchemaError as exc:
            self.rejected += 1
            cause = str(exc).split(":", 1)[0]
            if cause not in self._rejections_said and len(self._rejections_said) < 16:
                self._rejections_said.add(cause)
                log.warning("trainguard: run %s: log() rejected step %s, which the worker would refuse: %s "
                            "(further steps rejected for this cause are counted, not said)",
                            self.run_id, event.get("step"), exc)
            return None
        return payload

    def log_metric(self, name: str, value, tags: dict[str, str] | None = None, step: int | None = None) -> None:
        """The seed's per-value API: values of one step are sent together as one event."""
        try:
            if step is None:
                step = self._pending_step if self._pending_step is not None else 0
            if self._pending_step is not None and step != self._pending_step:
                self.flush_step()
            self._pending_step = step
            self._pending[name] = value
            if tags:
                self._pending_tags.update(tags)
        except Exception:
            self.skipped_values += 1

    def flush_step(self) -> None:
        """Send what ``log_metric`` gathered for the current step (done automatically)."""
        if self._pending_step is not None and self._pending:
            self.log(self._pending, self._pending_step, tags=self._pending_tags or None)
        self._pending, self._pending_tags, self._pending_step = {}, {}, None

    # -- checkpoints and lifecycle ------------------------------------------------------

    @never_raises("checkpoint_saved() dropped a checkpoint", fallback=False)
    def checkpoint_saved(self, step: int, path: str, *, healthy: bool | None = None, why: str | None = None) -> bool:
        """Report a checkpoint the trainer can roll back to; ``healthy``/``why``: the trainer's own
        verdict on it (None: not checked). Never raises."""
        self.flush_step()
        event = ev.checkpoint_event(self.run_id, int(step), str(path), src=self.source, healthy=healthy, why=why)
        # Signed, and recorded as a rollback target for this process's listeners.
        return self.publisher.publish(self._topic, self.run_id, authored(event))

    @never_raises("lifecycle() dropped an event", fallback=False)
    def lifecycle(self, what: str, step: int | None = None, detail: dict | None = None) -> bool:
        """started / finished / heartbeat / rolled_back / paused / resumed / stopped. Never raises."""
        if what == "started":
            if not self._announce:
                return True  # said once already
            self._announce = False
        event = ev.lifecycle_event(self.run_id, what, step=step, src=self.source, detail=detail)
        queued = self.publisher.publish(self._topic, self.run_id, authored(event))
        if queued and what in ("finished", "stopped"):
            self.ended = what
        return queued

    # -- shutdown -----------------------------------------------------------------------

    def stats(self) -> dict:
        return {**self.publisher.stats(), "skipped_values": self.skipped_values, "rejected": self.rejected}

    def close(self, timeout: float = 10.0, *, quiet: bool = False, end: str | None = "finished",
              step: int | None = None) -> dict:
        """Report the run's ``end`` (``finished``, ``stopped``; None: nothing, as for a crash)
        unless a ``stopped`` or ``finished`` was reported already, deliver what can be delivered
        within ``timeout`` (never longer: a training job must exit), give up the rest, and
        return what happened to every event: ``sent``, ``lost`` and its causes (``dropped``,
        ``delivery_failed``, ``purged_at_close``, ``lost_fatal``). ``step``: the step the run
        ended at (default: the last one logged)."""
        if self._closed:
            return self.stats()
        self._closed = True
        self.flush_step()
        if end is not None and self.ended is None and self.source["kind"] == "trainer":  # a node's is no run's end
            self.lifecycle(end, step=self._last_step if step is None else step)
        given_up = self.publisher.close(timeout)
        stats = self.stats()
        stats["undelivered_at_close"] = given_up
        if not quiet and (stats["lost"] or self.skipped_values or self.rejected):
            print(f"trainguard: run {self.run_id}: {stats['sent']} events sent, {stats['lost']} lost "
                  f"({stats['dropped']} not queued (queue full or unencodable), {stats['delivery_failed']} not "
                  f"delivered in time, {stats['purged_at_close']} given up at close, {stats['lost_fatal']} in a failed "
                  f"producer); {self.rejected} steps rejected by log() as the worker would refuse them (negative "
                  f"step, over-long name ...: said in the log when first seen); "
                  f"{self.skipped_values} non-numeric values skipped.", file=sys.stderr)
        return stats

    def __enter__(self) -> "TrainerLogger":
        return self

    def __exit__(self, exc_type, *_exc) -> None:
        # An exception out of the block is a crash: no report, so the worker pages it as silent.
        # Ctrl-C is someone ending the run on purpose.
        if exc_type is None:
            self.close()
        else:
            self.close(end="stopped" if issubclass(exc_type, KeyboardInterrupt) else None)


"""A producer that never blocks, never raises into its caller, and accounts for every event.

librdkafka's own queue is the bounded buffer: ``produce()`` copies the bytes and returns at
once; when the queue is full (the broker is down for long, or slow) the event is dropped and
counted instead of waiting. Everything a training process or a node daemon publishes goes
through here.

Every event queued is either delivered or counted lost, by cause (``stats()``):
``dropped`` (refused locally: queue full, or the event could not be encoded),
``delivery_failed`` (the broker did not take it before ``message.timeout.ms``),
``purged_at_close`` (still queued when ``close()``'s time ran out) and ``lost_fatal`` (queued
in a producer that hit a fatal error). ``lost()`` is their sum.

Delivery mode, chosen for fire-and-forget telemetry: no idempotence, one request in flight
per connection (so a retry cannot reorder a run's steps), retries until the message times
out. An idempotent producer keeps a producer id that a restarted broker may not know
(Kafka expires them; the embedded broker forgets them on restart): librdkafka then raises a
*fatal* error or holds every later event back, and a training job would lose its telemetry
for good. A duplicate after a lost acknowledgement costs the worker one repeated sample.
Any fatal error that still comes (a broken configuration, a revoked credential) makes the next
``publish()`` build a fresh producer, after counting what the dead one held.

With ``background=True`` (the trainer's logger) ``publish()`` hands each message to a sender
thread and returns: the queue it waits in counts towards ``queue_max``, messages go out in the
order they were handed over, and ``publish_made`` hands over the work of encoding a message too.
``flush()`` and ``close()`` wait for the sender first; what it still holds when ``close()`` gives
up is counted in ``purged_at_close``.

Broker outages are said once: one line naming the address and the way out when the broker
cannot be reached, one line when events flow again; librdkafka's own log lines stay quiet.
No Python lock is taken inside a librdkafka callback: callbacks run on the thread that polls
or flushes, and counters are only touched by that thread or under the GIL.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

from trainguard.core.kafka import KafkaSettings

log = logging.getLogger("trainguard.producer")

# librdkafka error names that mean "the cluster is out of reach" (not a problem with an event).
_UNREACHABLE = ("_ALL_BROKERS_DOWN", "_TRANSPORT", "_RESOLVE", "_TIMED_OUT", "_MSG_TIMED_OUT")


class Publisher:
    def __init__(self, settings: KafkaSettings | None = None, *, queue_max: int = 100_000,
                 linger_ms: int = 5, producer_config: dict | None = None, report_success: bool = False,
                 background: bool = False):
        self.settings = settings or KafkaSettings.from_env()
        self.queued = 0            # accepted by produce() (delivered later, or counted lost)
        self.delivered = 0         # acknowledged by the broker (counted with report_success only)
        self.dropped = 0           # refused locally: queue full or encoding failed
        self.delivery_failed = 0   # accepted locally, then not delivered (broker unreachable ...)
        self.purged_at_close = 0   # still queued when close() gave up
        self.lost_fatal = 0        # queued in a producer that hit a fatal error
        self.rebuilds = 0
        self._queue_max = queue_max
        self._report_success = report_success
        # With ``background``, publish() hands each message to a sender thread (in order) and
        # returns: the caller pays a queue put, and encoding handed over (publish_made) happens
        # there too. The trainer's log() uses it; the queue counts towards ``queue_max``.
        self._background = background
        self._outbox: queue.SimpleQueue | None = None
        self._sender: threading.Thread | None = None
        self._abandoned = False
        self._last_error: str | None = None
        self._fatal: str | None = None
        self._unreachable_since: float | None = None
        self._unreachable_why = ""
        self._at_outage = (0, 0, 0)   # queue length, queued and lost when the outage began
        self._announced = False
        self._closing = False
        self._config = self.settings.confluent(**{
            "queue.buffering.max.messages": queue_max,
            "linger.ms": linger_ms,
            # Same partitioner as Faust/aiokafka/Java, so a run's key maps to one partition everywhere.
            "partitioner": "murmur2_random",
            "enable.idempotence": False,
            "max.in.flight.requests.per.connection": 1,
            "acks": "all",
            "message.timeout.ms": 60_000,
            "reconnect.backoff.ms": 100,
            "reconnect.backoff.max.ms": 2_000,
            # Only failures call back unless asked: serving a callback per delivered message
            # inside poll(0) would put its cost on every 16th log().
            "delivery.report.only.error": not report_success,
            # Outages reach the user through error_cb, once; not as librdkafka's raw lines.
            "log_level": 0,
        })
        self._config.update(producer_config or {})
        self._config.setdefault("error_cb", self._on_error)
        # The counting callback for every message, set once: passed per message it costs
        # produce() a third more (a callback object held per message).
        self._config.setdefault("on_delivery", self._on_delivery)
        self._producer = self._new_producer()

    @property
    def sent(self) -> int:
        """Events accepted for delivery (kept for callers of the earlier name)."""
        return self.queued

    def _new_producer(self):
        from confluent_kafka import Producer

        return Producer(self._config)

    # -- callbacks (run on the thread that polls or flushes; no locks) ---------------------

    def _on_error(self, err) -> None:
        try:
            name, fatal = err.name(), err.fatal()
        except AttributeError:  # not a KafkaError (an exception passed on by publish())
            name, fatal = type(err).__name__, False
        if fatal:
            self._fatal = str(err)
            log.warning("trainguard: the Kafka producer hit a fatal error (training continues; a new producer "
                        "takes over with the next event): %s", err)
            return
        if name in _UNREACHABLE:
            if self._unreachable_since is None:  # said in _serve() if it lasts (reconnects flap)
                self._unreachable_since = time.monotonic()
                self._unreachable_why = name
                self._at_outage = (len(self._producer), self.queued, self.lost())
            return
        text = str(err)
        if text != self._last_error:  # each distinct problem once, not every retry
            self._last_error = text
            log.warning("trainguard: Kafka client problem (training continues): %s", text)

    def _on_delivery(self, err, _msg) -> None:
        if err is None:
            self.delivered += 1
        elif self._closing and err.name().startswith("_PURGE"):
            self.purged_at_close += 1
        else:
            self.delivery_failed += 1

    # -- the caller's side ----------------------------------------------------------------

    def publish(self, topic: str, key: str | bytes | None, value: bytes | None, partition: int | None = None,
                on_delivery: Callable[[Any], None] | None = None) -> bool:
        """Queue one message; False (and counted) when it could not be queued. ``on_delivery``
        is called with the error if delivery fails (and with None once delivered, where
        ``report_success`` asks for those reports)."""
        if self._background:
            return self._hand_over((topic, key, value, partition, on_delivery))
        return self._produce(topic, key, value, partition, on_delivery)

    def publish_made(self, topic: str, key: str | bytes | None, make: Callable[..., bytes | None],
                     *args: Any) -> bool:
        """Queue the message ``make(*args)`` encodes, in order with every other: made on the sender
        thread where the publisher has one, else now. ``make`` returns None for a message that is
        not to be sent (it counts that itself)."""
        if self._background:
            return self._hand_over((topic, key, make) + args)  # one tuple held per message
        value = make(*args)
        return value is not None and self.publish(topic, key, value)

    # -- background sending ---------------------------------------------------------------

    def _hand_over(self, item: tuple) -> bool:
        outbox = self._outbox
        if outbox is None:
            outbox = self._start_sender()
        if len(self._producer) + outbox.qsize() >= self._queue_max:
            self.dropped += 1
            return False
        outbox.put(item)
        return True

    def _start_sender(self) -> "queue.SimpleQueue":
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox = outbox
        self._sender = threading.Thread(target=self._send, args=(outbox,), name="trainguard-publisher", daemon=True)
        self._sender.start()
        return outbox

    def _send(self, outbox: "queue.SimpleQueue") -> None:
        """The sender thread: encodes what was handed over encoded-later, then produces, in order.
        A flush's marker is set once everything before it was produced; None stops the thread."""
        get, produce = outbox.get, self._produce
        while True:
            item = get()
            if type(item) is tuple:
                if self._abandoned:  # close() gave up on what is still here
                    self.purged_at_close += 1
                elif len(item) == 5:  # topic, key, value, partition, on_delivery
                    produce(*item)
                else:  # topic, key, make, its arguments
                    try:
                        value = item[2](*item[3:])
                    except Exception as exc:
                        self.dropped += 1
                        log.debug("trainguard: an event could not be encoded: %s: %s", type(exc).__name__, exc)
                        continue
                    if value is not None:
                        produce(item[0], item[1], value, None, None)
            elif item is None:
                return
            else:
                item.set()

    def _drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the sender to produce everything handed over so far."""
        outbox, sender = self._outbox, self._sender
        if outbox is None or sender is None or not sender.is_alive():
            return True
        marker = threading.Event()
        outbox.put(marker)
        return marker.wait(max(0.0, timeout))

    def _produce(self, topic: str, key: str | bytes | None, value: bytes | None, partition: int | None,
                 on_delivery: Callable[[Any], None] | None) -> bool:
        if self._fatal is not None:
            self._replace_dead_producer()
        producer = self._producer
        if len(producer) >= self._queue_max:  # full: drop without paying for an exception
            self.dropped += 1
            return False
        try:
            if on_delivery is None and partition is None:
                producer.produce(topic, value, key)  # the common case: counted by the producer's callback
            else:
                report = self._config["on_delivery"]
                if on_delivery is not None:
                    def report(err, msg, counted=report):
                        counted(err, msg)
                        on_delivery(err)
                if partition is None:
                    producer.produce(topic, value, key, on_delivery=report)
                else:
                    producer.produce(topic, value, key, partition=partition, on_delivery=report)
            self.queued += 1
            return True
        except BufferError:
            self.dropped += 1
        except Exception as exc:  # never into the caller's loop
            self.dropped += 1
            self._on_error(exc)
        finally:
            if self.queued % 16 == 0:  # serve delivery callbacks now and then, never waiting
                self._serve()
        return False

    def _serve(self) -> None:
        try:
            self._producer.poll(0)
        except Exception:
            pass
        if self._unreachable_since is not None:
            self._outage_news()

    def _outage_news(self) -> None:
        """An outage is said once it has lasted 2 s, and its end once events flow again: while
        the broker is gone nothing leaves the queue but counted losses, so a queue shorter than
        that means deliveries."""
        since = self._unreachable_since
        if since is None:
            return
        pending, queued, lost = self._at_outage
        expected = pending + (self.queued - queued) - (self.lost() - lost)
        down = time.monotonic() - since
        if len(self._producer) < expected:
            if self._announced:
                log.warning("trainguard: Kafka at %s is reachable again after %.0f s; the queued events are "
                            "being delivered (lost so far: %d).", self.settings.bootstrap, down, self.lost())
            self._unreachable_since, self._announced = None, False
        elif not self._announced and down >= 2.0:
            self._announced = True
            log.warning("trainguard: cannot reach Kafka at %s (%s). Is `trainguard broker` running, or "
                        "TRAINGUARD_BOOTSTRAP set to your cluster? Training continues: up to %d events wait in "
                        "memory, then new ones are dropped and counted.",
                        self.settings.bootstrap, self._unreachable_why, self._queue_max)

    def _replace_dead_producer(self) -> None:
        """After a fatal error: count what the dead producer holds as lost, start a new one."""
        dead, reason, self._fatal = self._producer, self._fatal, None
        before = self.delivery_failed
        try:
            dead.purge()
            dead.poll(0)  # purged messages report failure: counted in delivery_failed
        except Exception:
            pass
        self.lost_fatal += self.delivery_failed - before + len(dead)
        self.delivery_failed = before
        self.rebuilds += 1
        try:
            self._producer = self._new_producer()
        except Exception as exc:  # cannot even build one: keep the dead one, try again next time
            self._producer, self._fatal = dead, reason
            log.warning("trainguard: could not start a new Kafka producer (retrying with the next event): %s", exc)

    def pending(self) -> int:
        return len(self._producer) + (self._outbox.qsize() if self._outbox is not None else 0)

    def flush(self, timeout: float = 10.0) -> int:
        """Wait up to ``timeout`` for queued messages; return how many are still pending."""
        deadline = time.monotonic() + max(0.0, timeout)
        if not self._drain(timeout):
            return self.pending()
        try:
            return self._producer.flush(max(0.0, deadline - time.monotonic()))
        except Exception as exc:
            self._on_error(exc)
            return self.pending()

    def close(self, timeout: float = 10.0) -> int:
        """Deliver what can be delivered within ``timeout``, then give the rest up, counted in
        ``purged_at_close``; how many were given up. Always returns within about ``timeout``."""
        deadline = time.monotonic() + max(0.0, timeout)
        left = self.flush(timeout)
        outbox, sender = self._outbox, self._sender
        if outbox is not None and sender is not None:
            # What the sender still holds is given up, counted; then it stops.
            self._abandoned = True
            outbox.put(None)
            sender.join(max(0.5, deadline - time.monotonic()))
            if sender.is_alive():  # cannot happen short of a wedged interpreter: count, move on
                self.purged_at_close += outbox.qsize()
            self._outbox, self._background = None, False
        if left:
            self._closing = True
            try:
                self._producer.purge()
                self._producer.flush(max(0.0, min(1.0, deadline - time.monotonic())))  # serve the reports
            except Exception:
                pass
            # Whatever the purge did not report (a dead producer) is counted all the same.
            still = len(self._producer)
            self.purged_at_close += still
        return left

    def lost(self) -> int:
        return self.dropped + self.delivery_failed + self.purged_at_close + self.lost_fatal

    def stats(self) -> dict:
        return {"sent": self.queued, "delivered": self.delivered if self._report_success else None,
                "dropped": self.dropped, "delivery_failed": self.delivery_failed,
                "purged_at_close": self.purged_at_close, "lost_fatal": self.lost_fatal, "lost": self.lost(),
                "pending": self.pending(), "producer_rebuilds": self.rebuilds}

"""A producer that never blocks or raises into its caller.

librdkafka's own queue is the bounded buffer: ``produce()`` copies the bytes and returns
at once; when the queue is full (the broker is down for long, or slow) the event is
dropped and counted instead of waiting. Delivery failures are counted too. Everything a
training process or a node daemon publishes goes through here.
"""

from __future__ import annotations

import logging
import threading

from trainguard.kafka import KafkaSettings

log = logging.getLogger("trainguard.producer")


class Publisher:
    def __init__(self, settings: KafkaSettings | None = None, *, queue_max: int = 100_000,
                 linger_ms: int = 5, producer_config: dict | None = None):
        from confluent_kafka import Producer

        self.settings = settings or KafkaSettings.from_env()
        self.sent = 0
        self.dropped = 0           # refused locally: queue full or encoding failed
        self.delivery_failed = 0   # accepted locally, then not delivered (broker unreachable ...)
        self._last_error: str | None = None
        self._lock = threading.Lock()
        self._queue_max = queue_max
        config = self.settings.confluent(**{
            "queue.buffering.max.messages": queue_max,
            "linger.ms": linger_ms,
            # Same partitioner as Faust/aiokafka/Java, so a run's key maps to one partition everywhere.
            "partitioner": "murmur2_random",
            "enable.idempotence": True,
            "acks": "all",
            "message.timeout.ms": 60_000,
            # Only failures are counted, so only failures call back: serving a callback per
            # delivered message inside poll(0) would put its cost on every 16th log().
            "delivery.report.only.error": True,
            "log_level": 2,
        })
        config.update(producer_config or {})
        config.setdefault("error_cb", self._on_error)
        self._producer = Producer(config)

    def _on_error(self, err) -> None:
        text = str(err)
        if text != self._last_error:  # say each distinct problem once, not every retry
            self._last_error = text
            log.warning("trainguard: Kafka client problem (training continues): %s", text)

    def _on_delivery(self, err, _msg) -> None:
        if err is not None:
            with self._lock:
                self.delivery_failed += 1

    def publish(self, topic: str, key: str, value: bytes, partition: int | None = None) -> bool:
        """Queue one message; False (and counted) when it could not be queued."""
        if len(self._producer) >= self._queue_max:  # full: drop without paying for an exception
            self.dropped += 1
            return False
        try:
            if partition is None:
                self._producer.produce(topic, value, key, on_delivery=self._on_delivery)
            else:
                self._producer.produce(topic, value, key, partition=partition, on_delivery=self._on_delivery)
            self.sent += 1
            return True
        except BufferError:
            self.dropped += 1
        except Exception as exc:  # never into the caller's loop
            self.dropped += 1
            self._on_error(exc)
        finally:
            if self.sent % 16 == 0:  # serve delivery callbacks now and then, never waiting
                try:
                    self._producer.poll(0)
                except Exception:
                    pass
        return False

    def pending(self) -> int:
        return len(self._producer)

    def flush(self, timeout: float = 10.0) -> int:
        """Wait up to ``timeout`` for queued messages; return how many are still pending."""
        try:
            return self._producer.flush(timeout)
        except Exception as exc:
            self._on_error(exc)
            return self.pending()

    def stats(self) -> dict:
        return {"sent": self.sent, "dropped": self.dropped, "delivery_failed": self.delivery_failed,
                "pending": self.pending()}

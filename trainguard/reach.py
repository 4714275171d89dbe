"""Is the Kafka broker there? One quick check before a command talks to it.

Without it a wrong ``TRAINGUARD_BOOTSTRAP`` shows as a librdkafka or Faust traceback after
10-15 s of retries. :func:`check` answers within a few seconds with the cause (no such host,
connection refused, no answer, answers but not as Kafka) and the way out.
"""

from __future__ import annotations

import socket

CONNECT_TIMEOUT_S = 3.0
METADATA_TIMEOUT_S = 5.0


class Unreachable(Exception):
    """The broker cannot be reached; the message is the one line to show."""


def _addresses(bootstrap: str) -> list[tuple[str, int]]:
    """``host:port`` pairs of a bootstrap list (``SASL_SSL://h:9093``, ``[::1]:9092`` too)."""
    out = []
    for item in bootstrap.split(","):
        item = item.strip().rpartition("://")[2]
        host, _, port = item.rpartition(":")
        host = host.strip("[]")
        try:
            out.append((host or item, int(port)))
        except ValueError:
            raise Unreachable(_line(bootstrap, f"{item!r} is not HOST:PORT")) from None
    return out


def _line(bootstrap: str, cause: str) -> str:
    return (f"cannot reach the Kafka broker at {bootstrap} ({cause}); start one with `trainguard broker` "
            f"or set TRAINGUARD_BOOTSTRAP (or --bootstrap)")


def _connect_cause(host: str, port: int) -> str | None:
    """None when a TCP connection opens, else why not, in a few words."""
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
        return None
    except socket.gaierror:
        return f"no host named {host}"
    except ConnectionRefusedError:
        return f"connection refused on port {port}"
    except (socket.timeout, TimeoutError):
        return f"no answer from {host}:{port} within {CONNECT_TIMEOUT_S:.0f} s"
    except OSError as exc:
        return exc.strerror or str(exc)


def check(settings) -> None:
    """Raise :class:`Unreachable` unless one bootstrap address opens and answers a metadata
    request as a Kafka broker (with the configured security settings)."""
    bootstrap = settings.bootstrap
    causes = [c for c in (_connect_cause(h, p) for h, p in _addresses(bootstrap))]
    if all(causes):
        raise Unreachable(_line(bootstrap, "; ".join(dict.fromkeys(c for c in causes if c))))
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    try:
        AdminClient(settings.confluent(log_level=0)).list_topics(timeout=METADATA_TIMEOUT_S)
    except KafkaException as exc:
        err = exc.args[0] if exc.args else exc
        detail = err.str() if hasattr(err, "str") else str(err)
        raise Unreachable(_line(bootstrap, f"it accepts connections but does not answer as Kafka within "
                                           f"{METADATA_TIMEOUT_S:.0f} s: {detail}")) from None

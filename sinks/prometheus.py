"""The sinks process's ``/metrics``: the exporter of ``streams/exporter.py`` (the worker's),
fed with what the sinks see."""

from __future__ import annotations

from trainguard.core.settings import value
from trainguard.sinks.base import Sink
from trainguard.streams.exporter import Exporter


class PrometheusSink(Sink):
    """A sinks process's ``/metrics``: its notification counters, and with ``count_alerts``
    the alerts it reads (only where the worker exports nothing: the worker counts them)."""

    name = "prometheus"
    settings = ("TRAINGUARD_PROMETHEUS_PORT", "TRAINGUARD_PROMETHEUS_ADDR", "TRAINGUARD_PROMETHEUS_ALERTS")

    @classmethod
    def from_env(cls, env) -> "PrometheusSink | None":
        """A sink serving ``/metrics`` on ``TRAINGUARD_PROMETHEUS_PORT``; None where it is not set."""
        port = value("TRAINGUARD_PROMETHEUS_PORT", env)
        if not port:
            return None
        # Alerts are the worker's to count; counting them here too doubled every summed panel.
        sink = cls(count_alerts=value("TRAINGUARD_PROMETHEUS_ALERTS", env) == "1")
        sink.exporter.start_http(int(port), value("TRAINGUARD_PROMETHEUS_ADDR", env) or "")
        return sink

    def __init__(self, exporter: Exporter | None = None, *, count_alerts: bool = False):
        super().__init__()
        self.exporter = exporter or Exporter()
        self.count_alerts = count_alerts

    def write(self, batch: list[dict]) -> None:
        if not self.count_alerts:
            return
        for event in batch:
            if str(event.get("schema", "")).startswith("alert/"):
                self.exporter.observe_alert(event)

    def close(self, timeout: float = 5.0) -> None:
        self.exporter.stop_http()

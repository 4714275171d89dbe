"""The sinks process's ``/metrics``: the exporter of ``streams/exporter.py`` (the worker's),
fed with what the sinks see."""

from __future__ import annotations

from trainguard.sinks.base import Sink
from trainguard.streams.exporter import Exporter


class PrometheusSink(Sink):
    """A sinks process's ``/metrics``: its notification counters, and with ``count_alerts``
    the alerts it reads (only where the worker exports nothing: the worker counts them)."""

    name = "prometheus"

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

    def close(self) -> None:
        self.exporter.stop_http()

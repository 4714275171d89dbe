"""One readable, coloured line per alert, command and ack; full detail on demand."""

from __future__ import annotations

import sys
import time
from typing import TextIO

import orjson

from trainguard.sinks.base import Sink
from trainguard.sinks.reports import forecast_text, format_time, format_value
from trainguard.terminal import safe, safe_event

_SEVERITY_COLOUR = {"P0": "\033[1;97;41m", "P1": "\033[1;31m", "P2": "\033[33m", "P3": "\033[36m"}
_RESET = "\033[0m"
_DIM = "\033[2m"
_BOLD = "\033[1m"
_GREEN = "\033[32m"
_MAGENTA = "\033[1;35m"


def _clock(ts: float | None) -> str:
    return format_time(ts if type(ts) in (int, float) and ts else time.time(), "%H:%M:%S")


class ConsoleSink(Sink):
    name = "console"

    def __init__(self, stream: TextIO | None = None, colour: bool | None = None, detail: bool = False):
        super().__init__()
        self.stream = stream or sys.stdout
        self.colour = self.stream.isatty() if colour is None else colour
        self.detail = detail

    def _c(self, code: str, text: str) -> str:
        return f"{code}{text}{_RESET}" if self.colour else text

    def format(self, event: dict) -> str:
        event = safe_event(event)  # a terminal runs escape sequences: none from a topic reach it
        kind = event.get("schema", "")
        if kind.startswith("alert/"):
            return self.format_alert(event)
        if kind.startswith("command/"):
            target = event.get("target") or {}
            where = f" -> step {target['step']} ({target['path']})" if target else ""
            n = len(event.get("reason") or [])
            why = f"because {n} alert{'s' if n != 1 else ''}: " if n else ""  # by hand: its detail says who
            return (f"{_clock(event.get('issued'))} {self._c(_MAGENTA, 'COMMAND ' + event['action'].upper())}"
                    f"{where} run={event['run_id']} {why}{event.get('detail', '')}")
        if kind.startswith("report/"):
            return (f"{_clock(event.get('ts'))} {self._c(_MAGENTA, 'REPORT')} {event['id']} run={event['run_id']} "
                    f"decision={event['action']}: {event['checkpoint'].get('why', '')}")
        if kind.startswith("ack/"):
            colour = _GREEN if event["status"] == "applied" else _SEVERITY_COLOUR["P1"]
            return (f"{_clock(event.get('ts'))} {self._c(colour, 'ACK ' + event['status'])} "
                    f"command={event['command_id']} run={event['run_id']} {event.get('detail', '')}")
        return orjson.dumps(event).decode()

    def format_alert(self, alert: dict) -> str:
        sev = alert["severity"]
        status = "RESOLVED" if alert["status"] == "resolved" else "FIRING"
        head = self._c(_SEVERITY_COLOUR.get(sev, ""), f"{sev} {status}")
        ev = alert.get("evidence", {})
        bounds = ""
        if "lower" in ev and "upper" in ev:
            bounds = f" window [{format_value(ev['lower'])}, {format_value(ev['upper'])}]"
        # what the alert has, never "step=None ack=None"
        where = f" step={alert['step']}" if alert.get("step") is not None else ""
        metric, value = alert.get("metric") or "", alert.get("value")
        reading = f" {metric}={format_value(value)}" if metric and value is not None else f" {metric}" if metric else ""
        forecast = forecast_text(ev) if alert["status"] == "firing" else None
        if forecast:
            bounds += f" {forecast}"
        flapping = " (flapping)" if alert.get("flapping") else ""
        said = alert.get("diagnosis", "")
        if alert["status"] == "resolved":
            # the value and the diagnosis are the firing's: beside the resolving step they read as
            # that step's ("step=30 actor/pg_loss=NaN" when the NaN was step 31's)
            reading, bounds = (f" {metric}" if metric else ""), ""
            said = alert.get("resolution") or "the condition no longer holds"
        line = (f"{_clock(alert.get('ts'))} {head} {self._c(_BOLD, alert['rule'])}{flapping} run={alert['run_id']}"
                f"{where}{reading}{bounds} {self._c(_DIM, said)}")
        silence = alert.get("silenced")
        if silence:
            line += self._c(_DIM, f" [silenced until {_clock(silence.get('until'))} by {silence.get('by') or '?'}]")
        if self.detail:
            line += "\n    " + orjson.dumps(alert, option=orjson.OPT_INDENT_2).decode().replace("\n", "\n    ")
        return line

    def line(self, event: dict) -> str:
        """:meth:`format`, or for an event it cannot format (a field of a shape no event has) a
        plain line that says so: one bad event never costs the rest of its batch."""
        try:
            return self.format(event)
        except Exception as exc:
            self.failed += 1
            shown = {k: event.get(k) for k in ("schema", "id", "run_id", "rule", "severity", "status")
                     if isinstance(event.get(k), str)}
            return safe(f"{shown} (not shown whole: {type(exc).__name__}: {exc})"[:1000])

    def write(self, batch: list[dict]) -> None:
        self.stream.write("".join(self.line(e) + "\n" for e in batch))
        self.stream.flush()

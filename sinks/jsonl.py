"""Append events as JSON lines; an event id seen before is not written twice."""

from __future__ import annotations

from pathlib import Path

import orjson

from trainguard.core.settings import value
from trainguard.sinks.base import Sink


def _event_id(event: dict) -> str | None:
    if event.get("id"):
        return f"{event['id']}:{event.get('status', '')}"  # an alert fires once and resolves once
    if event.get("command_id"):
        return f"ack:{event['command_id']}:{event.get('status')}"
    return None


class JsonlSink(Sink):
    name = "jsonl"
    settings = ("TRAINGUARD_ALERTS_JSONL",)

    @classmethod
    def from_env(cls, env, path: str | Path | None = None) -> "JsonlSink | None":
        """A sink appending to ``path``, else to ``TRAINGUARD_ALERTS_JSONL``; None without either."""
        path = path or value("TRAINGUARD_ALERTS_JSONL", env)
        return cls(path) if path else None

    def __init__(self, path: str | Path):
        super().__init__()
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._seen: set[str] = set()
        if self.path.exists():  # survive restarts without duplicating what is there
            for line in self.path.read_bytes().splitlines():
                try:
                    eid = _event_id(orjson.loads(line))
                except orjson.JSONDecodeError:
                    continue
                if eid:
                    self._seen.add(eid)
        self._fh = open(self.path, "ab")

    def write(self, batch: list[dict]) -> None:
        out = []
        for event in batch:
            eid = _event_id(event)
            if eid is not None:
                if eid in self._seen:
                    continue
                self._seen.add(eid)
            out.append(orjson.dumps(event) + b"\n")
        self._fh.write(b"".join(out))
        self._fh.flush()

    def close(self, timeout: float = 5.0) -> None:
        self._fh.close()

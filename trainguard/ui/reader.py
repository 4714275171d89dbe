"""The topic reader and what it keeps: :class:`Board` (every record decoded for its topic,
everything bounded) and :class:`Follower`, the thread that reads the topics into it."""

from __future__ import annotations

import logging
import math
import threading
import time

from trainguard.core.kafka import KafkaSettings, Topics
from trainguard.core.reader import LiveReader, TopicDecoder
from trainguard.schemas import events as ev
from trainguard.streams.rules import RuleSet
from trainguard.ui.series import Series
from trainguard.ui.views import ack_view, alert_view, command_view, report_view, short_text, status_view

log = logging.getLogger("trainguard.ui")


class _Run:
    """What the board keeps of one run: small views of its records, not the records (a record
    is up to 1 MiB and carries fields the page does not show, such as a command's signature)."""

    __slots__ = ("status", "alerts", "commands", "acks", "reports", "series", "heard", "attempts", "trainer_hosts")

    def __init__(self):
        self.status: dict | None = None
        self.alerts: dict[tuple, dict] = {}              # (alert id, status) -> view
        self.commands: dict[str, dict] = {}              # command id -> view
        self.acks: dict[str, dict] = {}                  # command id -> the latest ack's view
        self.reports: dict[str, dict] = {}               # report id -> the report (for its page)
        self.series: dict[str, Series] = {}
        self.heard = 0.0
        self.attempts: list[dict] = []                   # each trainer process's start: ts, step, source
        self.trainer_hosts: dict[str, None] = {}         # hosts whose trainer logged the run's metrics


MAX_ATTEMPTS = 20  # trainer processes remembered per run (the newest)
MAX_TRAINER_HOSTS = 16


def _bounded_put(table: dict, key, value, limit: int) -> None:
    table.pop(key, None)  # re-inserted at the end: the oldest entry goes first
    table[key] = value
    while len(table) > limit:
        table.pop(next(iter(table)))


class Board:
    """What the pages show, built from the topics' records in the order they are read.

    Every record is decoded for its topic (:class:`TopicDecoder`); a bad one is skipped and
    counted, and one that fails in handling is counted too: nothing read ends the reader.
    Bounded, so that whoever writes to a topic cannot grow it without end: ``max_runs`` runs
    (the least recently heard of go first, with everything kept of them), per run
    ``max_series`` series of ``max_points`` points over the whole run (:class:`Series`),
    ``max_alerts`` alerts, commands and acks, ``max_reports`` reports, and ``max_report_bytes``
    of reports over all runs; the watched-name cache holds ``max_names`` names."""

    def __init__(self, rules: RuleSet, topics: Topics | None = None, *, max_points: int = 10_000, max_series: int = 64,
                 max_runs: int = 200, max_alerts: int = 500, max_reports: int = 20,
                 max_report_bytes: int = 32 << 20, max_names: int = 10_000):
        self.rules = rules
        self.max_points, self.max_series, self.max_runs, self.max_alerts = max_points, max_series, max_runs, max_alerts
        self.max_reports, self.max_report_bytes, self.max_names = max_reports, max_report_bytes, max_names
        self.decoder = TopicDecoder(topics or Topics(), who="trainguard ui")
        self.lock = threading.Lock()  # held only to change or copy the runs, never to render
        self.runs_by_id: dict[str, _Run] = {}  # the least recently heard of first
        self.report_bytes: dict[tuple[str, str], int] = {}  # (run, report id) -> size, the oldest first
        self.records = 0
        self._watched: dict[tuple[str, str], bool] = {}  # the reader's alone: no lock

    # ------------------------------------------------------------------ reading

    def take(self, topic: str, key: bytes | None, raw: bytes | None) -> None:
        """One record as read from ``topic``: decoded for that topic, then shown. Never raises."""
        self.records += 1
        try:
            decoded = self.decoder.decode(topic, raw)
            if decoded is not None:
                self.feed(decoded[0], (key or b"").decode("utf-8", "replace"), decoded[1], size=len(raw or b""))
        except Exception as exc:  # a record the decoder let through and the board cannot take
            self.decoder.skip(f"handling: {type(exc).__name__}", f"{exc!r}")
            log.debug("trainguard ui: record not taken", exc_info=True)

    def feed(self, role: str, key: str, event: dict | None, size: int | None = None) -> None:
        """One decoded record of the ``role`` topic (events, alerts, control, acks, status);
        ``size``: its length on the wire (counted against ``max_report_bytes`` for reports)."""
        if role == "status":
            if event is not None and event["run_id"] != key:  # compaction and tombstones go by the key
                self.decoder.skip("status: keyed by another run", f"key {key[:80]!r}, run_id {event['run_id'][:80]!r}")
                return
            run_id = key
            view = None if event is None else status_view(event)
            with self.lock:
                if view is None:
                    run = self.runs_by_id.get(run_id)
                    if run is not None:
                        run.status = None
                    return
                self._touch(run_id).status = view
            return
        if event is None:
            return
        run_id, schema = event["run_id"], event["schema"]
        if schema == ev.METRICS:
            points = self._watched_points(event)
            src = event["source"]
            with self.lock:
                run = self._touch(run_id)
                self._metrics(run, points, event["ts"])
                host = short_text(src.get("host"), 64) if src["kind"] == "trainer" and src.get("rank") in (None, 0) \
                    else None
                if host is not None and host not in run.trainer_hosts and len(run.trainer_hosts) < MAX_TRAINER_HOSTS:
                    run.trainer_hosts[host] = None
        elif schema == ev.ALERT:
            view = alert_view(event)
            with self.lock:
                _bounded_put(self._touch(run_id).alerts, (view["id"], view["status"]), view, self.max_alerts)
        elif schema == ev.REPORT:
            size = size or len(str(event))
            with self.lock:
                self._report(self._touch(run_id), run_id, event, size)
        elif schema == ev.COMMAND:
            view = command_view(event)
            with self.lock:
                _bounded_put(self._touch(run_id).commands, view["id"], view, self.max_alerts)
        elif schema == ev.ACK:
            view = ack_view(event)
            with self.lock:
                _bounded_put(self._touch(run_id).acks, view["command_id"], view, self.max_alerts)
        else:  # checkpoint, lifecycle, operator: the run is alive
            started = _trainer_start(event)
            with self.lock:
                run = self._touch(run_id)
                if started is not None:
                    run.attempts = [*run.attempts[-(MAX_ATTEMPTS - 1):], started]

    def _touch(self, run_id: str) -> _Run:
        run = self.runs_by_id.pop(run_id, None)
        if run is None:
            run = _Run()
            while len(self.runs_by_id) >= self.max_runs:
                self._forget(next(iter(self.runs_by_id)))
        self.runs_by_id[run_id] = run
        run.heard = time.time()
        return run

    def _forget(self, run_id: str) -> None:
        run = self.runs_by_id.pop(run_id)
        for report_id in run.reports:
            self.report_bytes.pop((run_id, report_id), None)

    def _watched_points(self, event: dict) -> list[tuple[str, int, float]]:
        src = event["source"]
        kind = src["kind"]
        suffix = "" if kind == "trainer" else f" @{src.get('host') or kind}"
        step = event["step"]
        points = []
        for name, value in event["metrics"].items():
            watched = self._watched.get((name, kind))
            if watched is None:
                watched = not self.rules.unwatched([name], kind)
                _bounded_put(self._watched, (name, kind), watched, self.max_names)
            if watched:
                points.append((name + suffix, step, float(value)))
        return points

    def _metrics(self, run: _Run, points, ts: float) -> None:
        for name, step, value in points:
            entry = run.series.get(name)
            if entry is None:
                if len(run.series) >= self.max_series:
                    continue
                entry = run.series[name] = Series(self.max_points)
            entry.add(step, value, ts)

    def _report(self, run: _Run, run_id: str, report: dict, size: int) -> None:
        if size > self.max_report_bytes:
            return
        old = run.reports.pop(report["id"], None)
        if old is not None:
            self.report_bytes.pop((run_id, report["id"]), None)
        run.reports[report["id"]] = report
        self.report_bytes[(run_id, report["id"])] = size
        while len(run.reports) > self.max_reports:
            oldest = next(iter(run.reports))
            run.reports.pop(oldest)
            self.report_bytes.pop((run_id, oldest), None)
        total = sum(self.report_bytes.values())
        while total > self.max_report_bytes:
            (owner, oldest), dropped = next(iter(self.report_bytes.items()))
            self.report_bytes.pop((owner, oldest))
            self.runs_by_id[owner].reports.pop(oldest, None)
            total -= dropped

    # ------------------------------------------------------------------ what pages read

    def skipped(self) -> tuple[int, dict[str, int]]:
        return self.decoder.counts()

    def runs(self) -> list[dict]:
        """Each run's line on the index, the most recently active first (a copy): every run id
        heard of; ``status`` None for one no worker has reported on (its records refused, or no
        worker running), ``attempts`` its trainer processes."""
        with self.lock:
            rows = [{"run_id": run_id, "status": run.status, "heard": run.heard, "attempts": len(run.attempts)}
                    for run_id, run in self.runs_by_id.items()]
        return sorted(rows, key=lambda r: -max(r["heard"], (r["status"] or {}).get("last_event_ts") or 0.0))

    def snapshot(self, run_id: str) -> dict | None:
        """The run as ``/api/run/<run>`` returns it, copied under the lock (pages are rendered
        from the copy, without it); None for a run the board does not know."""
        with self.lock:
            run = self.runs_by_id.get(run_id)
            if run is None:
                return None
            alerts = list(run.alerts.values())
            commands = list(run.commands.values())
            acks = dict(run.acks)
            reports = [report_view(r) for r in run.reports.values()]
            series = {name: (*s.copy(), list(s.restarts), list(s.restarted_at), s.stride)
                      for name, s in run.series.items()}
            status = run.status
            attempts = list(run.attempts)
            trainer_hosts = list(run.trainer_hosts)
        decisions = {r["command_id"]: r["step"] for r in reports}
        commands = [{**c, "ack": acks.get(c["id"]),
                     "step": decisions.get(c["id"], (acks.get(c["id"]) or {}).get("step"))} for c in commands]
        alerts.sort(key=lambda a: a["ts"])
        reports.sort(key=lambda r: r["ts"])
        return {"run_id": run_id, "status": status, "alerts": alerts, "commands": commands, "reports": reports,
                "attempts": attempts, "trainer_hosts": trainer_hosts,
                "series": {name: {"steps": steps, "values": values, "restarts": restarts, "restarted_at": at,
                                  "stride": stride}
                           for name, (steps, values, restarts, at, stride) in series.items()}}

    def run(self, run_id: str) -> dict:
        """The run as ``/api/run/<run>`` returns it (empty for a run the board does not know):
        the snapshot with each series as lists, a non-finite value as its name."""
        view = self.snapshot(run_id)
        if view is None:
            return {"run_id": run_id, "status": None, "alerts": [], "commands": [], "reports": [], "series": {}}
        view["series"] = {name: {"steps": s["steps"].tolist(), "restarts": s["restarts"], "stride": s["stride"],
                                 "restarted_at": s["restarted_at"],
                                 "values": [v if math.isfinite(v) else str(v) for v in s["values"].tolist()]}
                          for name, s in view["series"].items()}
        return view

    def report(self, run_id: str, report_id: str) -> dict | None:
        with self.lock:
            run = self.runs_by_id.get(run_id)
            return None if run is None else run.reports.get(report_id)


def _trainer_start(event: dict) -> dict | None:
    """A trainer process's ``started`` (rank 0, or a trainer without ranks) as the run page
    shows it, else None: each one begins an attempt of the run."""
    if event["schema"] != ev.LIFECYCLE or event["event"] != "started":
        return None
    src = event.get("source") or {}
    if src.get("kind", "trainer") != "trainer" or src.get("rank") not in (None, 0):
        return None
    step = event.get("step")
    return {"ts": event["ts"], "step": step if type(step) is int else None,
            "source": short_text(ev.source_id({"kind": "trainer", **src}), 128),
            "host": short_text(src.get("host"), 64)}


class Follower(threading.Thread):
    """Reads the topics into the board until stopped. Nothing read ends it: the board skips and
    counts what it cannot take, and a consumer error is logged and waited out. A broker outage is
    said once and its end once; topics that come back empty (a broker restarted on memory storage)
    are read again from their new beginning (:class:`LiveReader`)."""

    def __init__(self, settings: KafkaSettings, board: Board):
        super().__init__(name="trainguard-ui-reader", daemon=True)
        topics = settings.topics
        names = [topics.events, topics.alerts, topics.control, topics.acks, topics.status]
        self.reader = LiveReader(settings, names, who="trainguard ui")
        self.consumer, self.missing = self.reader.consumer, self.reader.missing
        self.board = board
        self.stopped = threading.Event()
        self.errors = 0
        self._said: set[str] = set()

    def run(self) -> None:
        try:
            while not self.stopped.is_set():
                try:
                    messages = self.reader.consume(num_messages=1000, timeout=0.5)
                except Exception as exc:  # the client's own trouble: say it (once per kind), wait, go on
                    self.errors += 1
                    if str(exc)[:200] not in self._said:
                        self._said.add(str(exc)[:200])
                        log.warning("trainguard ui: reading the topics failed (%s); retrying every second", exc)
                    self.stopped.wait(1.0)
                    continue
                for msg in messages:
                    if msg.error():
                        continue
                    self.board.take(msg.topic(), msg.key(), msg.value())
        finally:
            self.reader.close()

    def stop(self) -> None:
        self.stopped.set()
        self.join(5)

"""The paging stage: which alerts become chat messages, and when. :class:`Pager` decides (pure
code, no I/O); :class:`PagingSink` is the stage in the sinks process: one for every chat and
generic-webhook sink, which only render and send what it passes them, and keeps the pager's
state on disk.

Alertmanager's model, shared by every chat and generic-webhook sink:

- **mute**: a firing alert that is silenced, inhibited by an open incident, acknowledged, or
  kept for incidents only pages nobody;
- **dedup**: an alert (id, status and time: :func:`delivery_key`) is considered once (the worker
  replays a few after a restart);
- **page** (``page`` severities, P0/P1 by default): at once, as one **thread per run**: the
  run's first page opens it; a further firing of no higher severity within ``group_interval_s``
  of the thread's last message is folded into it (not sent); a more severe one, one that says
  the breaker's command failed, or one after the interval, is sent as an update of the thread;
  when the last of its alerts resolves, one message says so and what resolved it (the rollback:
  where to, the batches skipped, at which step) and how many alerts it held. A self-healed
  incident costs two messages per channel;
- **digest** (``digest`` severities, P2 by default): one message per run per
  ``digest_interval_s``, listing what warned (rule, count, first and last step, how many still
  fire); their resolutions are not sent, and an interval whose warnings all resolved before it
  ended sends nothing (Alertmanager does not notify a group that only holds resolved alerts;
  the run page and ``trainguard status`` keep them). Other severities are not sent at all;
- **flapping**: an alert with ``"flapping": true`` (a rule changing state too often) is shown
  as flapping; while its rule keeps flapping on the same run and metric, its further changes
  are folded into the first message, until an alert without the flag says it settled.

Time moves with the alerts' ``ts`` (or the arrival time given to ``feed``) and with
``flush(now)``, so replaying a recorded alert log through ``Pager`` gives the messages a live
sinks process would have sent::

    pager = Pager(PagingSettings(digest_interval_s=7200))
    messages = [m for alert in alerts for m in pager.feed(alert)] + pager.flush()
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from trainguard.core.settings import default, number, value
from trainguard.sinks.base import Sink, csv_values, log, read_state, write_state

PAGE = "page"
DIGEST = "digest"
DIGEST_SCHEMA = "digest/1"
_RANK = {"P0": 0, "P1": 1, "P2": 2, "P3": 3}
MAX_OPEN_PER_DIGEST = 1000  # warnings a digest follows to their resolution
# Alerts that say the loop itself failed: never folded into a run's thread.
ALWAYS_SENT = frozenset({"command_not_applied", "command_failed", "rerun_verdict"})


@dataclass(frozen=True)
class PagingSettings:
    # the table's defaults: P0 and P1 sent at once, each; P2 gathered per run, one message per
    # interval of 2 h (a channel reads a run's warnings a few times a day)
    page: tuple[str, ...] = field(default_factory=lambda: csv_values(default("TRAINGUARD_NOTIFY_SEVERITIES")))
    digest: tuple[str, ...] = field(default_factory=lambda: csv_values(default("TRAINGUARD_DIGEST_SEVERITIES")))
    digest_interval_s: float = field(default_factory=lambda: float(default("TRAINGUARD_DIGEST_INTERVAL_S")))
    group_interval_s: float = field(default_factory=lambda: float(default("TRAINGUARD_GROUP_INTERVAL_S")))
    max_keys: int = 10_000                   # alerts remembered for dedup (replays are a few)
    max_threads: int = 10_000                # runs with pages still open

    settings = ("TRAINGUARD_NOTIFY_SEVERITIES", "TRAINGUARD_DIGEST_SEVERITIES", "TRAINGUARD_DIGEST_INTERVAL_S",
                "TRAINGUARD_GROUP_INTERVAL_S")

    @classmethod
    def from_env(cls, env=None) -> "PagingSettings":
        page = csv_values(value("TRAINGUARD_NOTIFY_SEVERITIES", env))
        digest = tuple(s for s in csv_values(value("TRAINGUARD_DIGEST_SEVERITIES", env)) if s not in page)
        interval = number("TRAINGUARD_DIGEST_INTERVAL_S", env)
        if interval <= 0:
            raise ValueError(f"TRAINGUARD_DIGEST_INTERVAL_S must be above 0, not {interval}")
        group = number("TRAINGUARD_GROUP_INTERVAL_S", env)
        if group < 0:
            raise ValueError(f"TRAINGUARD_GROUP_INTERVAL_S must be 0 (every page its own message) or more, not {group}")
        return cls(page=page, digest=digest, digest_interval_s=interval, group_interval_s=group)


@dataclass(frozen=True)
class Message:
    """One notification: ``kind`` "page" (``event`` is the alert) or "digest" (``event`` is a
    ``digest/1`` document: run_id, severity, since, until, count, entries)."""

    kind: str
    run_id: str
    ts: float       # when it is due: the alert's time, or the end of the digest's interval
    event: dict = field(compare=False)


def delivery_key(event: dict) -> str:
    """What makes an alert (or digest) the same one again: its id, its status and its time. The
    worker's replays after a restart carry all three unchanged; a run started again under the
    same id has its alerts' ids again, but not their times, so it pages again."""
    return f"{event.get('id')}:{event.get('status', 'firing')}:{event.get('ts')}"


def muted(alert: dict) -> bool:
    """True when a firing alert must page nobody (the engine's silences, inhibitions, acks)."""
    return bool(alert.get("silenced") or alert.get("inhibited_by") or alert.get("acknowledged")
                or alert.get("incident_only"))


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v else None


def _opened(digest: dict) -> float:
    """When a digest's interval began (its first warning's arrival)."""
    return digest.get("opened", digest["since"])


def _flap_key(alert: dict) -> str:
    src = alert.get("source") or {}
    return "|".join(str(x) for x in (alert.get("run_id"), alert.get("rule"), alert.get("metric"),
                                     src.get("host"), src.get("rank")))


class Pager:
    """``feed(alert) -> list[Message]``, ``flush(now=None) -> list[Message]``; ``state()`` is
    JSON and ``Pager(settings, state)`` resumes from it."""

    def __init__(self, settings: PagingSettings | None = None, state: dict | None = None):
        self.settings = settings or PagingSettings()
        self.changed = False  # state changed since the owner last saved it
        try:
            self._restore(state or {})
        except (TypeError, ValueError, AttributeError) as exc:  # a file edited or damaged
            log.error("trainguard: paging state of an unknown shape, starting empty: %s: %s", type(exc).__name__, exc)
            self._restore({})

    def _restore(self, state: dict) -> None:
        """The saved state, checked: a digest of another shape is dropped (said), never a crash
        of every later batch."""
        self._seen: OrderedDict[str, None] = OrderedDict.fromkeys(str(k) for k in state.get("seen", ()))
        self._paged: OrderedDict[str, None] = OrderedDict.fromkeys(str(k) for k in state.get("paged", ()))
        self._flapping: dict[str, str] = {str(k): str(v) for k, v in dict(state.get("flapping", {})).items()}
        self._threads: dict[str, dict] = {}
        for run_id, t in dict(state.get("threads", {})).items():
            if (isinstance(t, dict) and isinstance(t.get("id"), str) and t.get("severity") in _RANK
                    and _num(t.get("last_sent")) is not None and isinstance(t.get("open"), dict)
                    and isinstance(t.get("rules"), dict) and all(type(n) is int for n in t["rules"].values())):
                self._threads[str(run_id)] = t
            else:
                log.error("trainguard: paging state: the thread of run %r has an unknown shape; dropped", run_id)
        self._digests: dict[str, dict] = {}
        for run_id, d in dict(state.get("digests", {})).items():
            if (isinstance(d, dict) and all(_num(d.get(k)) is not None for k in ("since", "until"))
                    and _num(d.get("opened", d["since"])) is not None
                    and isinstance(d.get("entries"), dict) and isinstance(d.get("open", {}), dict)
                    and all(isinstance(e, dict) and type(e.get("count")) is int for e in d["entries"].values())):
                self._digests[str(run_id)] = d
            else:
                log.error("trainguard: paging state: the digest of run %r has an unknown shape; dropped", run_id)

    def state(self) -> dict:
        return {"seen": list(self._seen), "paged": list(self._paged), "flapping": self._flapping,
                "digests": self._digests, "threads": self._threads}

    def feed(self, alert: dict, now: float | None = None) -> list[Message]:
        """The messages due once ``alert`` arrived at ``now`` (default: its ``ts``; the sinks
        process passes the wall clock, so that alerts stamped by a trainer's clock, or long ago,
        still gather for an interval): digests whose interval ended by then, then its page, if
        it pages."""
        if not str(alert.get("schema", "")).startswith("alert/"):
            return []
        key = delivery_key(alert)
        if key in self._seen:
            return []
        self._remember(self._seen, key)
        self.changed = True
        ts = _num(alert.get("ts"))
        now = ts if now is None else now
        out = self.flush(now) if now is not None else []
        severity = alert.get("severity")
        if severity in self.settings.page:
            page = self._page(alert, now)
            if page is not None:
                out.append(page)
        elif severity in self.settings.digest:
            if alert.get("status") == "resolved":
                self._cleared(alert)
            elif not muted(alert):
                self._gather(alert, ts, now)
        return out

    def flush(self, now: float | None = None) -> list[Message]:
        """The digests whose interval has ended by ``now``; with ``None``, every open one."""
        out = []
        for run_id in list(self._digests):
            digest = self._digests[run_id]
            due = _opened(digest) + self.settings.digest_interval_s
            if now is None or now >= due:
                del self._digests[run_id]
                self.changed = True
                if digest.get("open", True):  # a digest of an older state (no "open") is sent
                    out.append(Message(DIGEST, run_id, due, self._digest_event(run_id, digest, due)))
        return out

    # -- pages

    def _page(self, alert: dict, now: float | None = None) -> Message | None:
        aid, fkey = str(alert.get("id")), _flap_key(alert)
        flapping = bool(alert.get("flapping"))
        message = Message(PAGE, str(alert.get("run_id")), _num(alert.get("ts")) or 0.0, alert)
        if alert.get("status") == "resolved":
            if fkey in self._flapping:
                if flapping:  # still flapping: folded into the episode's first message
                    return None
                del self._flapping[fkey]  # settled: the episode's resolution
                self._paged.pop(aid, None)
                return message
            if aid not in self._paged:  # its firing paged nobody here (muted, or before our start)
                return None
            del self._paged[aid]
            return self._thread_resolved(alert, message)
        if muted(alert):
            return None
        if flapping:
            if fkey in self._flapping:
                return None
            self._flapping[fkey] = aid
            while len(self._flapping) > self.settings.max_keys:
                del self._flapping[next(iter(self._flapping))]
            self._remember(self._paged, aid)
            return message
        self._flapping.pop(fkey, None)
        self._remember(self._paged, aid)
        return self._thread_fired(alert, message, now)

    # -- threads: one per run, from its first page until its last alert resolves

    def _thread_fired(self, alert: dict, message: Message, now: float | None) -> Message | None:
        run_id, aid = message.run_id, str(alert.get("id"))
        severity = str(alert.get("severity"))
        severity = severity if severity in _RANK else "P1"
        now = message.ts if now is None else now
        thread = self._threads.get(run_id)
        if thread is None:
            self._threads[run_id] = {"id": aid, "severity": severity, "last_sent": now,
                                     "open": {aid: alert.get("rule")}, "rules": {str(alert.get("rule")): 1},
                                     "folded": 0}
            while len(self._threads) > self.settings.max_threads:
                del self._threads[next(iter(self._threads))]
            return message
        thread["open"][aid] = alert.get("rule")
        rules = thread["rules"]
        rules[str(alert.get("rule"))] = rules.get(str(alert.get("rule")), 0) + 1
        if (_RANK[severity] < _RANK[thread["severity"]] or alert.get("rule") in ALWAYS_SENT
                or now - thread["last_sent"] >= self.settings.group_interval_s):
            thread["severity"] = min(severity, thread["severity"], key=_RANK.__getitem__)
            thread["last_sent"] = now
            return Message(PAGE, run_id, message.ts, {**alert, "thread": self._said(thread, update=True)})
        thread["folded"] += 1
        return None

    def _thread_resolved(self, alert: dict, message: Message) -> Message | None:
        """None while another alert of the run's thread is open; then the thread's one resolution,
        saying what resolved it (a rollback's words win over "the condition no longer holds")."""
        thread = self._threads.get(message.run_id)
        aid = str(alert.get("id"))
        if thread is None or aid not in thread["open"]:
            return message  # paged before threads were kept, or its thread was forgotten
        del thread["open"][aid]
        if alert.get("resolved_by") or "resolution" not in thread:
            thread["resolution"] = {k: alert[k] for k in ("resolution", "resolved_by") if alert.get(k)}
        if thread["open"]:
            return None
        del self._threads[message.run_id]
        said = {**alert, **thread.get("resolution", {}), "thread": self._said(thread)}
        return Message(PAGE, message.run_id, message.ts, said)

    @staticmethod
    def _said(thread: dict, update: bool = False) -> dict:
        """What a thread's update or resolution tells about it: its first alert, how many alerts
        it held, which rules, how many were folded without a message."""
        return {"id": thread["id"], "update": update, "alerts": sum(thread["rules"].values()),
                "rules": dict(thread["rules"]), "folded": thread["folded"], "open": len(thread["open"])}

    def _remember(self, keys: OrderedDict, key: str) -> None:
        keys[key] = None
        while len(keys) > self.settings.max_keys:
            keys.popitem(last=False)

    # -- digests

    def _gather(self, alert: dict, ts: float | None, now: float | None) -> None:
        run_id = str(alert.get("run_id"))
        ts = ts if ts is not None else (now or 0.0)
        digest = self._digests.setdefault(run_id, {"opened": now if now is not None else ts, "since": ts,
                                                   "until": ts, "entries": {}, "open": {}})
        digest["since"], digest["until"] = min(digest["since"], ts), max(digest["until"], ts)
        rule = str(alert.get("rule", ""))
        step = alert.get("step") if isinstance(alert.get("step"), int) else None
        entry = digest["entries"].setdefault(rule, {
            "rule": rule, "summary": alert.get("summary"), "severity": alert.get("severity"), "count": 0,
            "first_step": step, "last_step": step, "metric": alert.get("metric"), "flapping": False})
        entry["count"] += 1
        entry["open"] = entry.get("open", 0) + 1
        still = digest.setdefault("open", {})
        still[str(alert.get("id"))] = rule
        if len(still) > MAX_OPEN_PER_DIGEST:  # forgotten ones count as still firing: sent, never lost
            del still[next(iter(still))]
            digest["overflow"] = True
        if step is not None:
            entry["first_step"] = step if entry["first_step"] is None else min(entry["first_step"], step)
            entry["last_step"] = step if entry["last_step"] is None else max(entry["last_step"], step)
        entry["flapping"] = entry["flapping"] or bool(alert.get("flapping"))

    def _cleared(self, alert: dict) -> None:
        """A warning gathered in a digest resolved: counted as no longer firing."""
        digest = self._digests.get(str(alert.get("run_id")))
        if digest is None or digest.get("overflow"):
            return
        rule = digest.get("open", {}).pop(str(alert.get("id")), None)
        if rule is not None:
            entry = digest["entries"].get(rule)
            if entry is not None:
                entry["open"] = max(0, entry.get("open", 1) - 1)

    @staticmethod
    def _digest_event(run_id: str, digest: dict, due: float) -> dict:
        entries = list(digest["entries"].values())
        worst = min((e.get("severity") for e in entries), key=lambda s: _RANK.get(s, 9), default="P2")
        return {"schema": DIGEST_SCHEMA, "id": f"digest-{run_id}-{int(_opened(digest) * 1000)}",
                "status": DIGEST, "run_id": run_id, "severity": worst, "since": digest["since"],
                "until": digest["until"], "ts": due, "count": sum(e["count"] for e in entries),
                "open": sum(e.get("open", e["count"]) for e in entries), "entries": entries}


# --------------------------------------------------------------------------- the stage


class PagingSink(Sink):
    """The chat and generic-webhook sinks behind one :class:`Pager`:
    it decides what pages (mute, dedup, digest), they render and send. With ``state_path`` the
    pager's state (digests being gathered, alerts paged) survives a restart, saved before the
    runner commits the batch."""

    name = "paging"

    def __init__(self, sinks: list[Sink], settings: PagingSettings | None = None,
                 state_path: str | Path | None = None):
        super().__init__()
        self.sinks = list(sinks)
        self.state_path = Path(state_path) if state_path else None
        self.pager = Pager(settings, read_state(self.state_path, "paging state"))

    @classmethod
    def from_env(cls, env, sinks: list[Sink], state_dir: Path | None) -> "PagingSink | None":
        """The stage in front of ``sinks`` (None without any), its settings from ``env``
        (:attr:`PagingSettings.settings`), its state in ``state_dir/pager.json``."""
        if not sinks:
            return None
        return cls(sinks, PagingSettings.from_env(env), state_path=state_dir / "pager.json" if state_dir else None)

    def save(self) -> None:
        if not self.state_path or not self.pager.changed:
            return
        write_state(self.state_path, self.pager.state())
        self.pager.changed = False

    def write(self, batch: list[dict]) -> None:
        now = time.time()  # a digest's interval runs from the arrival of its first warning
        self._send([m for event in batch for m in self.pager.feed(event, now)])

    def advance(self, now: float) -> None:
        self._send(self.pager.flush(now))

    def _send(self, messages: list[Message]) -> None:
        if messages:
            events = [m.event for m in messages]
            for sink in self.sinks:
                sink.deliver(events)
        self.save()

    def close(self, timeout: float = 5.0) -> None:
        for sink in self.sinks:
            sink.close(timeout=timeout)
        self.save()

"""HTTP delivery, shared by every webhook sink (and Alertmanager's): the :class:`Outbox` of
alerts to deliver and the keys delivered (on disk, so both survive a restart), and
:class:`WebhookSink`, whose one sender thread per sink delivers them in order, retrying with
exponential backoff (and jitter) while the receiver is down."""

from __future__ import annotations

import http.client
import json
import logging
import math
import os
import random
import socket
import ssl
import threading
import time
import urllib.parse
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

from trainguard.core.settings import value
from trainguard.sinks.base import Sink, read_state, write_state
from trainguard.sinks.paging import DIGEST_SCHEMA, delivery_key
from trainguard.sinks.webhooks.messages import Templates, plain_form
from trainguard.streams.exporter import NOTIFICATIONS

log = logging.getLogger("trainguard.sinks.webhooks")


class PermanentError(Exception):
    """The receiver refused the message for good (bad request, wrong token ...)."""


class Unrenderable(PermanentError):
    """Neither an alert's message nor its plain form could be made: it is given up with this
    reason at once, never retried (retrying cannot render it, and it would hold every alert
    behind it)."""


class Refused(OSError):
    """The receiver answered and did not take the message (HTTP 5xx, 408, 429, an errcode): a
    fault of the receiver, or of this one message; :meth:`WebhookSink._choose` tells which."""


@dataclass
class Item:
    key: str  # delivery_key(alert): "<alert id>:<status>:<ts>"
    alert: dict
    queued: float = field(default_factory=time.time)
    attempts: int = 0
    last_error: str = ""
    refused_since: float = 0.0  # wall clock of the first of its refusals in a row (0: none)
    held_until: float = 0.0  # wall clock: set apart, retried alone, while others are delivered

    @property
    def alert_id(self) -> str:
        return self.key.split(":", 1)[0]


class Outbox:
    """Bounded FIFO of alerts to deliver, with the keys already delivered (optionally on disk).
    The file is rewritten at every change and the outbox is on by default, so the delivered keys
    kept are few enough to write often: the worker replays only a few alerts after a restart."""

    def __init__(self, max_items: int = 1000, max_age_s: float = 86_400.0, path: str | Path | None = None,
                 max_delivered_keys: int = 20_000, max_undelivered: int = 1000):
        self.max_items = max_items
        self.max_age_s = max_age_s
        self.path = Path(path) if path else None
        self.pending: deque[Item] = deque()
        self.delivered: OrderedDict[str, None] = OrderedDict()
        self.max_delivered_keys = max_delivered_keys
        self.undelivered: deque[dict] = deque(maxlen=max_undelivered)
        self.undelivered_count = 0
        self._keys: set[str] = set()
        self._load(read_state(self.path, "outbox") or {})

    def _load(self, state: dict) -> None:
        for key in state.get("delivered", []):
            self.delivered[key] = None
        for raw in state.get("pending", []):
            item = Item(raw["key"], raw["alert"], raw.get("queued", time.time()), raw.get("attempts", 0),
                        refused_since=raw.get("refused_since", 0.0), held_until=raw.get("held_until", 0.0))
            self.pending.append(item)
            self._keys.add(item.key)

    def save(self) -> None:
        if not self.path:
            return
        write_state(self.path, {"pending": [{"key": i.key, "alert": i.alert, "queued": i.queued,
                                             "attempts": i.attempts, "refused_since": i.refused_since,
                                             "held_until": i.held_until} for i in self.pending],
                                "delivered": list(self.delivered)})

    def add(self, alert: dict) -> bool:
        """Queue ``alert`` unless it (:func:`~trainguard.sinks.paging.delivery_key`) was delivered or
        is pending; False when skipped."""
        key = delivery_key(alert)
        if key in self.delivered or key in self._keys:
            return False
        self.pending.append(Item(key, alert))
        self._keys.add(key)
        while len(self.pending) > self.max_items:
            self.give_up(self.pending[0], f"outbox full ({self.max_items} alerts)")
        return True

    def expire(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        while self.pending and now - self.pending[0].queued > self.max_age_s:
            self.give_up(self.pending[0], f"not delivered within {self.max_age_s:.0f} s")

    def done(self, item: Item) -> None:
        self._remove(item)
        self.delivered[item.key] = None
        while len(self.delivered) > self.max_delivered_keys:
            self.delivered.popitem(last=False)

    def give_up(self, item: Item, why: str) -> None:
        self._remove(item)
        self.undelivered_count += 1
        self.undelivered.append({"key": item.key, "alert": item.alert, "reason": why,
                                 "attempts": item.attempts, "last_error": item.last_error})

    def _remove(self, item: Item) -> None:
        try:
            self.pending.remove(item)
        except ValueError:
            pass
        self._keys.discard(item.key)


class WebhookSink(Sink):
    """Base of the HTTP sinks: subclasses say where to POST (:meth:`url`) and what (:meth:`payload`)."""

    name = "webhook"
    retry_statuses = frozenset({408, 429})
    url_setting: str | None = None  # the variable that gives its URL: the sink is on where it is set

    @classmethod
    def from_env(cls, env, setup: "WebhookSetup") -> "WebhookSink | None":
        """The sink ``env`` configures (its ``settings``), None where its URL is not set."""
        url = value(cls.url_setting, env) if cls.url_setting else None
        return cls(url, **cls.options(env), **setup.kwargs(cls.name)) if url else None

    @classmethod
    def options(cls, env) -> dict:
        """The keyword arguments the sink's other settings give."""
        return {}

    def __init__(self, url: str, *, timeout_s: float = 10.0, backoff_s: float = 0.5, max_backoff_s: float = 60.0,
                 max_items: int = 1000, max_age_s: float = 86_400.0, outbox_path: str | Path | None = None,
                 templates: Templates | str | Path | None = None, headers: dict | None = None,
                 isolate_after_s: float = 5.0):
        super().__init__()
        self.isolate_after_s = isolate_after_s
        if not url:
            raise ValueError(f"{self.name}: a webhook URL is required")
        self.webhook = url
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.headers = {"Content-Type": "application/json", "User-Agent": "trainguard", **(headers or {})}
        self.templates = templates if isinstance(templates, Templates) else Templates(templates)
        self.outbox = Outbox(max_items=max_items, max_age_s=max_age_s, path=outbox_path)
        self.sent = 0
        self.retries = 0
        self._cond = threading.Condition()
        self._stop = False
        self._busy = False
        self._probed_for: Item | None = None  # the head whose refusals the item being tried tests
        self._thread = threading.Thread(target=self._loop, name=f"trainguard-{self.name}", daemon=True)
        self._thread.start()

    # -- what subclasses define

    def url(self) -> str:
        return self.webhook

    def payload(self, alert: dict) -> dict:
        raise NotImplementedError

    def check_response(self, status: int, body: bytes) -> None:
        """Raise when a 2xx answer still says the message was not taken (DingTalk/WeCom errcode)."""

    def tick_due(self) -> bool:
        """True when :meth:`tick` has periodic work to do (called with the lock held)."""
        return False

    def tick(self) -> None:
        """Periodic work in the sender thread (Alertmanager re-sends firing alerts)."""

    def delivered(self, alert: dict) -> None:
        """Called in the sender thread after ``alert`` was delivered."""

    # -- Sink

    def accepts(self, event: dict) -> bool:
        """Which events this sink sends: alerts and digests (which ones page is the
        :class:`~trainguard.sinks.paging.Pager`'s decision, made before)."""
        return str(event.get("schema", "")).startswith("alert/") or event.get("schema") == DIGEST_SCHEMA

    def write(self, batch: list[dict]) -> None:
        added = False
        with self._cond:
            for event in batch:
                if self.accepts(event):
                    added |= self.outbox.add(event)
            if added:
                self.outbox.save()
                self._cond.notify_all()

    def undelivered(self) -> list[dict]:
        """Alerts given up on (oldest first), each with the reason, attempts and last error."""
        with self._cond:
            return list(self.outbox.undelivered)

    @property
    def undelivered_count(self) -> int:
        return self.outbox.undelivered_count

    def pending(self) -> int:
        with self._cond:
            return len(self.outbox.pending)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until the outbox is empty; True when it is."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.outbox.pending or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
            return True

    def close(self, timeout: float = 5.0) -> None:
        self.flush(timeout)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=self.timeout_s + 1)
        with self._cond:
            left = len(self.outbox.pending)
            self.outbox.save()
        if left:
            where = f"kept in {self.outbox.path}" if self.outbox.path else "lost (no outbox_path)"
            log.error("trainguard: %s closed with %d alert(s) not delivered, %s", self.name, left, where)

    # -- delivery

    def render(self, alert: dict) -> bytes:
        """The request body for ``alert``: its :meth:`payload`, else (a field no template could
        show, a value JSON cannot hold) the payload of its :func:`plain_form`, said in the log;
        :class:`Unrenderable` when neither can be made."""
        try:
            return _json_body(self.payload(alert))
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"[:300]
        log.error("trainguard: %s could not render alert %s (%s); sending its plain form", self.name,
                  str(alert.get("id"))[:80], problem)
        try:
            return _json_body(self.payload(plain_form(alert, problem)))
        except Exception as exc:
            raise Unrenderable(f"could not be rendered ({problem}), nor its plain form "
                               f"({type(exc).__name__}: {exc})"[:600]) from None

    def _post(self, alert: dict) -> None:
        self._post_body(self.render(alert))

    def _post_json(self, payload) -> None:
        self._post_body(_json_body(payload))

    def _post_body(self, data: bytes) -> None:
        status, body = post(self.url(), data, self.headers, self.timeout_s)
        if 300 <= status < 400:  # followed, a POST can become a GET that delivers nothing
            raise PermanentError(f"HTTP {status}: the receiver redirects; configure the URL it redirects to")
        if status >= 400:
            detail = f"HTTP {status}: {body[:200]!r}"
            if status < 500 and status not in self.retry_statuses:
                raise PermanentError(detail)
            raise Refused(detail)
        try:
            self.check_response(status, body)
        except PermanentError:
            raise
        except OSError as exc:  # an errcode: the receiver answered
            raise Refused(str(exc)) from None

    def _count(self, outcome: str, n: int = 1) -> None:
        NOTIFICATIONS.labels(self.name, outcome).inc(n)

    def _ready_in(self) -> float | None:
        """Seconds until a pending item may be tried (0: now), None when none is pending."""
        if not self.outbox.pending:
            return None
        return max(0.0, min(i.held_until for i in self.outbox.pending) - time.time())

    def _choose(self) -> Item | None:
        """The item to try now: the oldest not set apart, in order. Once the receiver has refused
        that one for ``isolate_after_s``, every other attempt tries the oldest item of another
        alert instead: if the receiver takes it, the refusals were the head's own (a message it
        cannot take), so the head is set apart and retried alone with its own backoff while the
        rest flow (:meth:`_set_apart`); if not, the receiver is down for all, and order is kept."""
        now = time.time()
        ready = [i for i in self.outbox.pending if i.held_until <= now]
        if not ready:
            return None
        head, tested = ready[0], self._probed_for
        self._probed_for = None
        if tested is None and head.refused_since and now - head.refused_since >= self.isolate_after_s:
            probe = next((i for i in ready[1:] if i.alert_id != head.alert_id), None)
            if probe is not None:
                self._probed_for = head
                return probe
        return head

    def _set_apart(self, head: Item) -> None:
        """``head`` (and what is pending of the same alert, which must follow it) retried alone."""
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** min(head.attempts, 30))
        until = time.time() + max(delay, self.isolate_after_s)
        first = not head.held_until
        for item in self.outbox.pending:
            if item.alert_id == head.alert_id:
                item.held_until = until
        (log.error if first else log.debug)(
            "trainguard: %s receiver refuses alert %s (for %.0f s, %d attempt(s): %s) and takes others: it is "
            "retried apart, the others go on", self.name, head.key, time.time() - head.refused_since, head.attempts,
            head.last_error)

    def _loop(self) -> None:
        next_try = 0.0  # monotonic time of the next attempt (backoff after a failure)
        while True:
            with self._cond:
                while not self._stop:
                    wait = next_try - time.monotonic()
                    ready_in = self._ready_in()
                    if ready_in is not None and wait <= 0 and ready_in <= 0:
                        break
                    wait = max(wait, ready_in or 0.0)
                    self._cond.wait(min(wait, 1.0) if wait > 0 else 1.0)
                    if self.tick_due():
                        break
                if self._stop:
                    return
            self.tick()
            with self._cond:
                if not self.outbox.pending or time.monotonic() < next_try:
                    continue
                before = self.outbox.undelivered_count
                self.outbox.expire()
                self._report_given_up(before)
                item = self._choose()
                if item is None:
                    continue
                tested = self._probed_for
                self._busy = True
            try:
                self._post(item.alert)
                error = None
            except Unrenderable as exc:
                error, permanent, why = str(exc), True, str(exc)
            except PermanentError as exc:
                error, permanent, why = str(exc), True, "refused by the receiver"
            except Exception as exc:  # connection refused, timeout, 5xx, errcode != 0
                error, permanent = f"{type(exc).__name__}: {exc}", False
                refused = isinstance(exc, Refused)
                if refused:  # answered: the receiver is up, this message was not taken
                    item.refused_since = item.refused_since or time.time()
                else:  # no answer: the receiver's fault, not the message's
                    item.refused_since = 0.0
            with self._cond:
                self._busy = False
                item.attempts += 1
                if tested is not None and error is None and tested in self.outbox.pending:
                    self._set_apart(tested)
                if error is None:
                    self.delivered(item.alert)
                    self.outbox.done(item)
                    self.sent += 1
                    self._count("delivered")
                    next_try = 0.0
                elif permanent:
                    item.last_error = error
                    before = self.outbox.undelivered_count
                    self.outbox.give_up(item, why)
                    self._report_given_up(before)
                    next_try = 0.0
                elif item.held_until and refused:  # set apart before, refused again: apart again, the
                    item.last_error = error          # others not made to wait for it
                    self.retries += 1
                    self._count("retried")
                    self._set_apart(item)
                    next_try = 0.0
                else:
                    item.last_error = error
                    self.retries += 1
                    self._count("retried")
                    delay = min(self.max_backoff_s, self.backoff_s * 2 ** min(item.attempts - 1, 30))
                    delay *= random.uniform(0.8, 1.2)
                    next_try = time.monotonic() + delay
                    if item.attempts == 1 or item.attempts % 10 == 0:
                        log.warning("trainguard: %s delivery of %s failed (attempt %d, retry in %.1f s): %s",
                                    self.name, item.key, item.attempts, delay, error)
                self.outbox.save()
                self._cond.notify_all()

    def _report_given_up(self, before: int) -> None:
        n = self.outbox.undelivered_count - before
        if n <= 0:
            return
        self._count("undelivered", n)
        for entry in list(self.outbox.undelivered)[-n:]:
            log.error("trainguard: %s gave up on alert %s after %d attempt(s): %s (last error: %s)",
                      self.name, entry["key"], entry["attempts"], entry["reason"], entry["last_error"])


def _finite(value):
    """``value`` with every non-finite float as the schema writes it (``"NaN"``, ``"Infinity"``):
    receivers parse strict JSON, which has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json_body(payload) -> bytes:
    """``payload`` as strict JSON (UTF-8); a NaN or an infinity in it as a string."""
    try:
        text = json.dumps(payload, ensure_ascii=False, allow_nan=False, default=str)
    except ValueError:
        text = json.dumps(_finite(payload), ensure_ascii=False, allow_nan=False, default=str)
    return text.encode()


def outbox_dir(env=None, group: str = "trainguard-sinks") -> tuple[Path, bool]:
    """Where the sinks keep their outboxes (and the pager its state), and whether the folder is
    the default one: ``TRAINGUARD_OUTBOX_DIR`` as given, else ``<TRAINGUARD_DATA_DIR>/sinks-outbox``
    or ``~/.local/state/trainguard/sinks-outbox`` (``$XDG_STATE_HOME``), one folder per topic
    prefix and group there."""
    env = os.environ if env is None else env
    if given := value("TRAINGUARD_OUTBOX_DIR", env):
        return Path(given), False
    if data := value("TRAINGUARD_DATA_DIR", env):
        base = Path(data) / "sinks-outbox"
    else:
        state = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
        base = Path(state) / "trainguard" / "sinks-outbox"
    return base / f"{value('TRAINGUARD_TOPIC_PREFIX', env)}.{group}", True


_LOCKS: dict[Path, object] = {}  # the outbox folders this process holds, and their lock files


def lock_outbox_dir(path: Path) -> Path:
    """``path``, held by this process; when another live process holds it (a second sinks
    process of the same group on this host), a folder of this process's own, said in the log."""
    import fcntl

    for candidate in (path, path.with_name(f"{path.name}.{os.getpid()}")):
        if candidate in _LOCKS:
            return candidate
        candidate.mkdir(parents=True, exist_ok=True)
        handle = open(candidate / "lock", "w")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            log.warning("trainguard: outbox folder %s is held by another sinks process; this one keeps its "
                        "own (set TRAINGUARD_OUTBOX_DIR per process)", candidate)
            continue
        _LOCKS[candidate] = handle
        return candidate
    raise RuntimeError(f"no outbox folder to hold near {path}")


class WebhookSetup:
    """What the HTTP sinks of one sinks process share: their templates (``TRAINGUARD_TEMPLATES_DIR``,
    ``TRAINGUARD_UI_URL``) and the folder of their outboxes (:func:`outbox_dir`, per ``group``),
    found and held when the first sink asks for its own."""

    settings = ("TRAINGUARD_OUTBOX_DIR", "TRAINGUARD_DATA_DIR", "TRAINGUARD_TOPIC_PREFIX", *Templates.settings)

    def __init__(self, env, group: str):
        self.env, self.group = env, group
        self.templates = Templates(env=env)
        self.folder: Path | None = None  # once a sink asked

    def kwargs(self, name: str) -> dict:
        """The arguments of the sink ``name``: the templates and its outbox file."""
        if self.folder is None:
            folder, default = outbox_dir(self.env, self.group)
            if default:  # shared by every process of the group on this host: one holds it
                folder = lock_outbox_dir(folder)
            log.info("trainguard: sinks keep their outboxes in %s", folder)
            self.folder = folder
        return {"templates": self.templates, "outbox_path": self.folder / f"{name}.json"}


MAX_RESPONSE_BYTES = 64 << 10  # a receiver's answer is a status and a line of JSON: the rest is not read


def post(url: str, data: bytes, headers: dict, timeout_s: float) -> tuple[int, bytes]:
    """POST ``data`` to ``url``; (status, the first MAX_RESPONSE_BYTES of the body). The whole
    exchange ends within ``timeout_s``: a receiver that answers a byte at a time cannot hold
    the sender (a socket timeout alone applies to each read), redirects are not followed, and
    a huge answer is not read. Raises OSError (timeouts included) when there is no answer."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise PermanentError(f"not an http(s) URL: {url[:80]!r}")
    if parts.scheme == "https":
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            parts.hostname, parts.port, timeout=timeout_s, context=ssl.create_default_context())
    else:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    expired = threading.Event()
    opened: list[socket.socket] = []  # the connection's socket (the response keeps it once the
    # connection object lets go of it, as it does for an HTTP/1.0 answer)

    def cut() -> None:  # the deadline: shut the socket so that a blocked read returns
        expired.set()
        for sock in opened:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(timeout_s, cut)
    timer.daemon = True
    timer.start()
    try:
        conn.connect()
        if conn.sock is not None:
            opened.append(conn.sock)
        conn.request("POST", path, body=data, headers=headers)
        resp = conn.getresponse()
        body = resp.read(MAX_RESPONSE_BYTES)
        return resp.status, body
    except (OSError, http.client.HTTPException) as exc:
        if expired.is_set():
            raise TimeoutError(f"no complete answer within {timeout_s:g} s") from None
        raise OSError(f"{type(exc).__name__}: {exc}") from None
    finally:
        timer.cancel()
        conn.close()


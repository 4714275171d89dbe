"""Chat and HTTP notifications: DingTalk, WeCom, Slack and a generic JSON webhook.

Every sink here is a :class:`WebhookSink`: ``write(batch)`` only puts alerts into an
:class:`Outbox` and returns at once; one sender thread per sink delivers them in order,
retrying with exponential backoff (and jitter) while the receiver is down. What a chat sink
gets to send (pages, digests) is decided before, once for all of them, by the paging stage
(:class:`PagingSink`, :mod:`trainguard.sinks.paging`); a sink only renders and sends.

Guarantees:

- **Once per alert.** An alert (its id, status and time) that was delivered or is pending is
  not queued again (the worker replays a few alerts after a restart). With ``outbox_path``
  (the runner sets one by default) the pending queue and the delivered keys survive a restart
  of the sink.
  (At the HTTP level a receiver that takes a message and then fails to answer is sent it
  again: no webhook API offers a deduplication key.)
- **Never lost silently.** An alert stays in the outbox until it is delivered, until it is
  older than ``max_age_s`` (default one day), until ``max_items`` newer alerts push it out
  (default 1000), or until the receiver refuses it for good (HTTP 4xx other than 408/429).
  Whatever could not be delivered is logged, counted (``undelivered_count`` and
  ``trainguard_notifications_total{outcome="undelivered"}``) and listed by
  :meth:`WebhookSink.undelivered`.

Message text comes from the editable templates in ``sinks/templates/`` (see its README).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import json
import logging
import os
import random
import string
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

from trainguard.core.settings import value
from trainguard.sinks.base import Sink
from trainguard.sinks.paging import DIGEST_SCHEMA, Message, Pager, PagingSettings, delivery_key
from trainguard.sinks.reports import format_value
from trainguard.terminal import safe

log = logging.getLogger("trainguard.sinks.webhooks")

TEMPLATES_DIR = Path(__file__).parent / "templates"

# --------------------------------------------------------------------------- templates
#
# Every field that comes from an event is escaped for the markup it lands in: anyone who can
# write to the events topic chooses run ids, hosts and metric names, and must not be able to
# plant a link, a mention or a forged line in a chat message.

# Markdown (DingTalk, WeCom; the generic webhook's text and Alertmanager's annotations, which
# end up in receivers we do not know): the characters that open links, images, HTML, autolinks,
# emphasis and code become look-alikes, inert in every renderer (DingTalk and WeCom honour no
# backslash escapes). Underscores stay: metric names are full of them and CommonMark leaves
# intraword ones alone.
_MARKDOWN = str.maketrans({"[": "\uff3b", "]": "\uff3d", "<": "\uff1c", ">": "\uff1e", "*": "\u2217",
                           "`": "\u02cb", "~": "\uff5e", "|": "\uff5c", "#": "\uff03"})
# Slack mrkdwn: &, < and > as entities (Slack's own rule: no <!channel>, no <url|text>), and the
# look-alikes for the characters that would close our code spans, add emphasis, or make a
# markdown link of what a client or a bridge might render as one.
_SLACK = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;", "`": "\u02cb", "*": "\u2217", "~": "\uff5e",
                        "[": "\uff3b", "]": "\uff3d"})


def escape_plain(text) -> str:
    """One line of plain text: control characters and escape sequences out, newlines as spaces."""
    return safe("" if text is None else str(text))


def escape_markdown(text) -> str:
    """One line for DingTalk/WeCom markdown (see ``_MARKDOWN``)."""
    return escape_plain(text).translate(_MARKDOWN)


def escape_slack(text) -> str:
    """One line for Slack mrkdwn (see ``_SLACK``)."""
    return escape_plain(text).translate(_SLACK)


def _clock(ts) -> str:
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(ts))


def _fmt(v) -> str:
    """A field as people read it: numbers with 4 significant digits, nothing for None."""
    if v is None:
        return ""
    return format_value(v)


# Words a rule name spells in lower case that people write otherwise.
_WORDS = {"kl": "KL", "gpu": "GPU", "cpu": "CPU", "nan": "NaN", "oom": "OOM", "pcie": "PCIe", "ecc": "ECC",
          "nvlink": "NVLink", "ppo": "PPO", "grpo": "GRPO", "rm": "RM"}


@functools.lru_cache(maxsize=1)
def _default_summaries() -> dict[str, str]:
    """Rule name -> summary in the packaged rules file, for alerts that carry none."""
    try:
        import yaml

        doc = yaml.safe_load((Path(__file__).resolve().parents[1] / "rules" / "default.yaml").read_text())
        return {str(r["name"]): str(r["summary"]) for key in ("rules", "incidents") for r in doc.get(key) or ()
                if isinstance(r, dict) and r.get("name") and r.get("summary")}
    except Exception as exc:  # a title in words is still a title
        log.debug("trainguard: no rule summaries from the default rules: %s", exc)
        return {}


def title_of(event: dict) -> str:
    """What a person reads as the alert's name: its title, else its rule's summary ("KL spike",
    from the alert or the default rules file), else the rule name in words."""
    rule = str(event.get("rule", ""))
    for text in (event.get("title"), event.get("summary"), _default_summaries().get(rule)):
        if isinstance(text, str) and text.strip() and text != rule:
            return text
    words = rule.replace("-", "_").split("_")
    words = [_WORDS.get(w.lower(), w) for w in words if w]
    if words and words[0] == words[0].lower():
        words[0] = words[0][:1].upper() + words[0][1:]
    return " ".join(words)


def alert_fields(alert: dict, ui_url: str | None = None, escape=escape_markdown) -> dict[str, str]:
    """The placeholders a template can use, all strings (empty when the alert has no such field),
    each escaped with ``escape`` for the template's markup. With ``ui_url`` (where `trainguard
    ui` is served) the run's page and the report's are links."""
    onset = alert.get("onset") or {}
    src = alert.get("source") or {}
    source = " ".join(f"{k}={_fmt(src[k])}" for k in ("kind", "host", "rank", "gpu") if src.get(k) not in (None, ""))
    status = str(alert.get("status", "firing"))
    metric, value = _fmt(alert.get("metric")), _fmt(alert.get("value"))
    fields = {
        "id": _fmt(alert.get("id")),
        "severity": _fmt(alert.get("severity")),
        "rule": _fmt(alert.get("rule")),
        "title": title_of(alert),
        "status": status,
        "resolved": " (resolved)" if status == "resolved" else "",
        "flapping": " (flapping)" if alert.get("flapping") else "",
        "run": _fmt(alert.get("run_id")),
        "time": _clock(alert.get("ts")),
        "step": _fmt(alert.get("step")),
        "onset_step": _fmt(onset.get("step")),
        # " (onset 128)" where the episode began before this step; nothing otherwise
        "onset": f" (onset {_fmt(onset['step'])})" if onset.get("step") not in (None, alert.get("step")) else "",
        "onset_time": _clock(onset.get("ts")),
        "metric": metric,
        "value": value,
        "metric_value": f"{metric} = {value}" if metric and value else metric,
        "root_cause": _fmt(alert.get("diagnosis")),
        "suggestion": _fmt(alert.get("suggestion")),
        "incident": _fmt(alert.get("incident")),
        "report": _fmt(alert.get("report")),
        "source": source,
        "host": _fmt(src.get("host")),
        "layer": _fmt(alert.get("layer")),
        "run_page": _page_url(ui_url, alert.get("run_id")),
        "report_page": _page_url(ui_url, alert.get("run_id"), alert.get("report")) if alert.get("report") else "",
    }
    return {k: escape(v) for k, v in fields.items()}


def _steps(first, last) -> str:
    if first is None:
        return ""
    return f"step {first}" if last in (None, first) else f"steps {first}-{last}"


def digest_fields(digest: dict, ui_url: str | None, escape, line: string.Template) -> dict[str, str]:
    """The placeholders of the digest templates; ``entries`` is ``line`` rendered once per rule
    that warned (placeholders ``title``, ``rule``, ``severity``, ``count``, ``steps``, ``metric``,
    ``flapping``)."""
    entries = []
    for e in digest.get("entries", []):
        values = {"title": title_of(e), "rule": _fmt(e.get("rule")), "severity": _fmt(e.get("severity")),
                  "count": _fmt(e.get("count")), "steps": _steps(e.get("first_step"), e.get("last_step")),
                  "metric": _fmt(e.get("metric")), "flapping": " (flapping)" if e.get("flapping") else ""}
        entries.append(render(line, {k: escape(v) for k, v in values.items()}))
    fields = {"severity": _fmt(digest.get("severity")), "run": _fmt(digest.get("run_id")),
              "count": _fmt(digest.get("count")), "rules": _fmt(len(entries)),
              "since": _clock(digest.get("since")), "until": _clock(digest.get("until")),
              "run_page": _page_url(ui_url, digest.get("run_id"))}
    return {**{k: escape(v) for k, v in fields.items()}, "entries": "\n".join(entries)}


def _page_url(ui_url: str | None, run_id, report_id=None) -> str:
    """The run's page (or, with ``report_id``, the report's) under ``ui_url``; "" without one."""
    if not ui_url or not run_id:
        return ""
    url = f"{ui_url.rstrip('/')}/run/{urllib.parse.quote(str(run_id), safe='')}"
    return f"{url}/report/{urllib.parse.quote(str(report_id), safe='')}" if report_id else url


# The template a digest is rendered with instead of an alert's, and its per-rule line.
DIGEST_TEMPLATES = {"title.txt": ("digest_title.txt", "digest_line.md"),
                    "markdown.md": ("digest.md", "digest_line.md"),
                    "slack.md": ("digest_slack.md", "digest_line_slack.md")}


class Templates:
    """Loads ``name`` from ``directory`` (else the packaged one) and renders alerts with it."""

    def __init__(self, directory: str | Path | None = None, ui_url: str | None = None):
        directory = directory or value("TRAINGUARD_TEMPLATES_DIR")
        self.directory = Path(directory) if directory else TEMPLATES_DIR
        self.ui_url = ui_url if ui_url is not None else value("TRAINGUARD_UI_URL")
        self._cache: dict[str, string.Template] = {}

    def get(self, name: str) -> string.Template:
        if name not in self._cache:
            path = self.directory / name
            if not path.exists():
                path = TEMPLATES_DIR / name
            self._cache[name] = string.Template(path.read_text(encoding="utf-8"))
        return self._cache[name]

    def render(self, name: str, event: dict, escape=escape_markdown) -> str:
        """``event`` (an alert, or a digest: then ``name``'s digest form) rendered with ``name``,
        every field escaped with ``escape``."""
        if event.get("schema") == DIGEST_SCHEMA:
            name, line = DIGEST_TEMPLATES[name]
            return render(self.get(name), digest_fields(event, self.ui_url, escape, self.get(line)))
        return render(self.get(name), alert_fields(event, self.ui_url, escape))


def render(template: string.Template, values: dict[str, str]) -> str:
    """``safe_substitute`` line by line, dropping lines whose placeholders are all empty."""
    out = []
    for line in template.template.splitlines():
        names = [m.group("named") or m.group("braced") for m in template.pattern.finditer(line)
                 if m.group("named") or m.group("braced")]
        known = [n for n in names if n in values]
        if known and not any(values[n] for n in known):
            continue
        out.append(string.Template(line).safe_substitute(values))
    return "\n".join(out).strip("\n")


# --------------------------------------------------------------------------- outbox


class PermanentError(Exception):
    """The receiver refused the message for good (bad request, wrong token ...)."""


@dataclass
class Item:
    key: str  # delivery_key(alert): "<alert id>:<status>:<ts>"
    alert: dict
    queued: float = field(default_factory=time.time)
    attempts: int = 0
    last_error: str = ""


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
        if self.path and self.path.exists():
            self._load()

    def _load(self) -> None:
        try:
            state = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            log.error("trainguard: outbox %s unreadable, starting empty: %s", self.path, exc)
            return
        for key in state.get("delivered", []):
            self.delivered[key] = None
        for raw in state.get("pending", []):
            item = Item(raw["key"], raw["alert"], raw.get("queued", time.time()), raw.get("attempts", 0))
            self.pending.append(item)
            self._keys.add(item.key)

    def save(self) -> None:
        if not self.path:
            return
        state = {"pending": [{"key": i.key, "alert": i.alert, "queued": i.queued, "attempts": i.attempts}
                             for i in self.pending],
                 "delivered": list(self.delivered)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(state, default=str))
        os.replace(tmp, self.path)

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


# --------------------------------------------------------------------------- sinks


def _counter():
    try:
        from trainguard.streams.exporter import NOTIFICATIONS
        return NOTIFICATIONS
    except ImportError:  # prometheus-client not installed: the sink still works
        return None


class WebhookSink(Sink):
    """Base of the HTTP sinks: subclasses say where to POST (:meth:`url`) and what (:meth:`payload`)."""

    name = "webhook"
    retry_statuses = frozenset({408, 429})

    def __init__(self, url: str, *, timeout_s: float = 10.0, backoff_s: float = 0.5, max_backoff_s: float = 60.0,
                 max_items: int = 1000, max_age_s: float = 86_400.0, outbox_path: str | Path | None = None,
                 templates: Templates | str | Path | None = None, headers: dict | None = None):
        super().__init__()
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
        self._metric = _counter()
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

    def _post(self, alert: dict) -> None:
        self._post_json(self.payload(alert))

    def _post_json(self, payload) -> None:
        data = json.dumps(payload, ensure_ascii=False, default=str).encode()
        req = urllib.request.Request(self.url(), data=data, headers=self.headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                body = resp.read()
                self.check_response(resp.status, body)
        except urllib.error.HTTPError as exc:
            detail = f"HTTP {exc.code}: {exc.read()[:200]!r}"
            if 400 <= exc.code < 500 and exc.code not in self.retry_statuses:
                raise PermanentError(detail) from None
            raise OSError(detail) from None

    def _count(self, outcome: str, n: int = 1) -> None:
        if self._metric is not None:
            self._metric.labels(self.name, outcome).inc(n)

    def _loop(self) -> None:
        next_try = 0.0  # monotonic time of the next attempt (backoff after a failure)
        while True:
            with self._cond:
                while not self._stop:
                    wait = next_try - time.monotonic()
                    if self.outbox.pending and wait <= 0:
                        break
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
                if not self.outbox.pending:
                    continue
                item = self.outbox.pending[0]
                self._busy = True
            try:
                self._post(item.alert)
                error = None
            except PermanentError as exc:
                error, permanent = str(exc), True
            except Exception as exc:  # connection refused, timeout, 5xx, errcode != 0
                error, permanent = f"{type(exc).__name__}: {exc}", False
            with self._cond:
                self._busy = False
                item.attempts += 1
                if error is None:
                    self.delivered(item.alert)
                    self.outbox.done(item)
                    self.sent += 1
                    self._count("delivered")
                    next_try = 0.0
                elif permanent:
                    item.last_error = error
                    before = self.outbox.undelivered_count
                    self.outbox.give_up(item, "refused by the receiver")
                    self._report_given_up(before)
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


def _errcode_check(status: int, body: bytes) -> None:
    try:
        answer = json.loads(body or b"{}")
    except ValueError:
        return
    if isinstance(answer, dict) and answer.get("errcode", 0) != 0:
        raise OSError(f"errcode {answer.get('errcode')}: {answer.get('errmsg')}")


def dingtalk_sign(secret: str, timestamp_ms: int) -> str:
    """DingTalk robot signature: base64(HMAC-SHA256(key=secret, msg=f"{timestamp}\\n{secret}")), url-encoded."""
    digest = hmac.new(secret.encode(), f"{timestamp_ms}\n{secret}".encode(), hashlib.sha256).digest()
    return urllib.parse.quote_plus(base64.b64encode(digest))


class DingTalkSink(WebhookSink):
    """DingTalk group robot (``https://oapi.dingtalk.com/robot/send?access_token=...``), markdown."""

    name = "dingtalk"

    def __init__(self, url: str, secret: str | None = None, *, at_mobiles: tuple[str, ...] = (),
                 at_all_severities: tuple[str, ...] = (), **kwargs):
        self.secret = secret or None
        self.at_mobiles = list(at_mobiles)
        self.at_all_severities = tuple(at_all_severities)
        super().__init__(url, **kwargs)

    def url(self) -> str:
        if not self.secret:
            return self.webhook
        ts = int(time.time() * 1000)
        sep = "&" if "?" in self.webhook else "?"
        return f"{self.webhook}{sep}timestamp={ts}&sign={dingtalk_sign(self.secret, ts)}"

    def payload(self, alert: dict) -> dict:
        text = self.templates.render("markdown.md", alert)
        if self.at_mobiles:
            text += "\n\n" + " ".join(f"@{m}" for m in self.at_mobiles)
        digest = alert.get("schema") == DIGEST_SCHEMA  # warnings gathered: nobody is woken for them
        return {"msgtype": "markdown",
                "markdown": {"title": self.templates.render("title.txt", alert), "text": text},
                "at": {"atMobiles": self.at_mobiles,
                       "isAtAll": not digest and alert.get("severity") in self.at_all_severities}}

    def check_response(self, status: int, body: bytes) -> None:
        _errcode_check(status, body)


class WeComSink(WebhookSink):
    """WeCom (企业微信) group robot (``https://qyapi.weixin.qq.com/cgi-bin/webhook/send?key=...``), markdown."""

    name = "wecom"
    max_bytes = 4096  # WeCom's limit on markdown content

    def payload(self, alert: dict) -> dict:
        content = self.templates.render("markdown.md", alert)
        raw = content.encode()
        if len(raw) > self.max_bytes:
            content = raw[: self.max_bytes - 3].decode(errors="ignore") + "..."
        return {"msgtype": "markdown", "markdown": {"content": content}}

    def check_response(self, status: int, body: bytes) -> None:
        _errcode_check(status, body)


class SlackSink(WebhookSink):
    """Slack incoming webhook: a header block, a mrkdwn section, and plain ``text`` as fallback."""

    name = "slack"

    def payload(self, alert: dict) -> dict:
        # the header is plain_text, shown as is: look-alikes there too, so that nothing in it reads
        # as a link or a mention; the fallback text and the section are mrkdwn
        header = self.templates.render("title.txt", alert, escape_markdown)
        body = self.templates.render("slack.md", alert, escape_slack)
        return {"text": self.templates.render("title.txt", alert, escape_slack),
                "blocks": [{"type": "header", "text": {"type": "plain_text", "text": header[:150]}},
                           {"type": "section", "text": {"type": "mrkdwn", "text": body[:3000]}}]}


class GenericWebhookSink(WebhookSink):
    """POST the alert (or digest) itself as JSON, plus ``text`` (the rendered title, escaped as
    markdown) for chat-like receivers."""

    name = "webhook"

    def payload(self, alert: dict) -> dict:
        return {**alert, "text": self.templates.render("title.txt", alert)}



# --------------------------------------------------------------------------- the paging stage


class PagingSink(Sink):
    """The chat and generic-webhook sinks behind one :class:`~trainguard.sinks.paging.Pager`:
    it decides what pages (mute, dedup, digest), they render and send. With ``state_path`` the
    pager's state (digests being gathered, alerts paged) survives a restart, saved before the
    runner commits the batch."""

    name = "paging"

    def __init__(self, sinks: list[Sink], settings: PagingSettings | None = None,
                 state_path: str | Path | None = None):
        super().__init__()
        self.sinks = list(sinks)
        self.state_path = Path(state_path) if state_path else None
        self.pager = Pager(settings, self._load())

    def _load(self) -> dict | None:
        if not self.state_path or not self.state_path.exists():
            return None
        try:
            return json.loads(self.state_path.read_text())
        except (OSError, ValueError) as exc:
            log.error("trainguard: paging state %s unreadable, starting empty: %s", self.state_path, exc)
            return None

    def save(self) -> None:
        if not self.state_path or not self.pager.changed:
            return
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(self.state_path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.pager.state(), default=str))
        os.replace(tmp, self.state_path)
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


def outbox_dir(env=None, group: str = "trainguard-sinks") -> tuple[Path, bool]:
    """Where the sinks keep their outboxes (and the pager its state), and whether the folder is
    the default one: ``TRAINGUARD_OUTBOX_DIR`` as given, else ``<TRAINGUARD_DATA_DIR>/sinks-outbox``
    or ``~/.local/state/trainguard/sinks-outbox`` (``$XDG_STATE_HOME``), one folder per topic
    prefix and group there."""
    env = os.environ if env is None else env
    if chosen := value("TRAINGUARD_OUTBOX_DIR", env):
        return Path(chosen), False
    if data_dir := value("TRAINGUARD_DATA_DIR", env):
        base = Path(data_dir) / "sinks-outbox"
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

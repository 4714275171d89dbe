"""What a notification says: the editable templates in ``sinks/templates/`` (see its README)
rendered with an alert's or a digest's fields, each field escaped for the markup it lands in."""

from __future__ import annotations

import functools
import logging
import re
import string
from importlib import resources
from pathlib import Path

from trainguard.core.settings import value
from trainguard.sinks.paging import DIGEST_SCHEMA
from trainguard.sinks.reports import format_time, format_value, page_url
from trainguard.terminal import safe

log = logging.getLogger("trainguard.sinks.webhooks")

TEMPLATES_DIR = Path(__file__).parent.parent / "templates"

# Every field that comes from an event is escaped for the markup it lands in: anyone who can
# write to the events topic chooses run ids, hosts and metric names, and must not be able to
# plant a link, a mention or a forged line in a chat message.

# Markdown (DingTalk, WeCom; the generic webhook's text and Alertmanager's annotations, which
# end up in receivers we do not know): the characters that open links, images, HTML, autolinks,
# emphasis and code become look-alikes, inert in every renderer (DingTalk and WeCom honour no
# backslash escapes). Underscores stay: metric names are full of them and CommonMark leaves
# intraword ones alone. "@" too: a field names nobody (DingTalk's own @ come from its settings).
_MARKDOWN = str.maketrans({"[": "\uff3b", "]": "\uff3d", "<": "\uff1c", ">": "\uff1e", "*": "\u2217",
                           "`": "\u02cb", "~": "\uff5e", "|": "\uff5c", "#": "\uff03", "@": "\uff20"})
# Slack mrkdwn: &, < and > as entities (Slack's own rule: no <!channel>, no <url|text>), and the
# look-alikes for the characters that would close our code spans, add emphasis, make a markdown
# link of what a client or a bridge might render as one, or name a channel or a person
# (#general, @here: Slack links them in text outside ``verbatim``).
_SLACK = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;", "`": "\u02cb", "*": "\u2217", "~": "\uff5e",
                        "[": "\uff3b", "]": "\uff3d", "#": "\uff03", "@": "\uff20"})
# A bare URL is a link in every chat client (Slack's text, DingTalk's and WeCom's markdown): its
# "://" and "www." as look-alikes keep it readable and make it none.
_BARE_URL = re.compile(r"://|(?i:www)\.")


def _unlinked(text: str) -> str:
    return _BARE_URL.sub(lambda m: ":\u2215\u2215" if m.group() == "://" else m.group()[:-1] + "\u2024", text)


def escape_plain(text) -> str:
    """One line of plain text: control characters and escape sequences out, newlines as spaces."""
    return safe("" if text is None else str(text))


def escape_annotation(text) -> str:
    """One line for Alertmanager's labels and annotations, which its own templates put into
    messages we do not see: control characters out, the markdown look-alikes of ``_MARKDOWN``."""
    return escape_plain(text).translate(_MARKDOWN)


def escape_markdown(text) -> str:
    """One line for DingTalk/WeCom markdown (see ``_MARKDOWN``), bare URLs unlinked."""
    return _unlinked(escape_annotation(text))


def escape_slack(text) -> str:
    """One line for Slack mrkdwn (see ``_SLACK``), bare URLs unlinked."""
    return _unlinked(escape_plain(text).translate(_SLACK))


def _links(escape):
    """How our own page links are written in ``escape``'s markup: Slack's ``<url>`` (a section is
    ``verbatim``: no bare URL in it is a link), as they are elsewhere."""
    return (lambda url: f"<{url}>" if url else "") if escape is escape_slack else escape_annotation


def _clock(ts) -> str:
    return format_time(ts, "%Y-%m-%d %H:%M:%S %Z")


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

        doc = yaml.safe_load(resources.files("trainguard.rules").joinpath("default.yaml").read_text(encoding="utf-8"))
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


def _action(alert: dict, status: str) -> str:
    """What was or will be done about it: the resolution, or who acts (the breaker, or a person)."""
    if status == "resolved":
        return _fmt(alert.get("resolution"))
    remedy = alert.get("remedy")
    if not isinstance(remedy, dict):
        return ""
    if remedy.get("by") == "human":
        return f"needs a human: {_fmt(remedy.get('why'))}" if remedy.get("why") else "needs a human"
    newest, after = remedy.get("newest_healthy_step"), remedy.get("after_steps")
    said = "the breaker rolls back to a healthy checkpoint" + (f" (newest: step {_fmt(newest)})" if newest is not None
                                                              else "")
    return said + (f" if this holds for {_fmt(after)} steps" if type(after) is int and after > 1 else "")


def _remedy_by(alert: dict) -> str | None:
    remedy = alert.get("remedy")
    return remedy.get("by") if isinstance(remedy, dict) else None


def _thread(alert: dict) -> str:
    """Where a message stands in its run's thread: an update, or the alerts a resolution closes."""
    thread = alert.get("thread")
    if not isinstance(thread, dict) or not isinstance(thread.get("rules"), dict):
        return ""
    rules = ", ".join(f"{title_of({'rule': r})}" + (f" x{n}" if type(n) is int and n > 1 else "")
                      for r, n in list(thread["rules"].items())[:8])
    count = thread.get("alerts")
    if thread.get("update"):
        return f"update of this run's thread ({_fmt(count)} alerts so far: {rules})"
    return f"{_fmt(count)} alerts of this run, all resolved: {rules}" if type(count) is int and count > 1 else ""


def _resolved(alert: dict, status: str) -> str:
    if status != "resolved":
        return ""
    said = alert.get("resolution")
    if not isinstance(said, str) or not said:
        return " (resolved)"
    return f" ({said})" if said.startswith("resolved by") else f" (resolved: {said})"


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
        "resolved": _resolved(alert, status),
        # the first line says it when the breaker can do nothing: a page nobody else acts on
        "needs_human": " - needs a human" if status != "resolved" and _remedy_by(alert) == "human" else "",
        "action": _action(alert, status),
        "thread": _thread(alert),
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
    }
    link = _links(escape)
    pages = {"run_page": page_url(ui_url, alert.get("run_id")),
             "report_page": page_url(ui_url, alert.get("run_id"), alert.get("report")) if alert.get("report") else ""}
    return {**{k: escape(v) for k, v in fields.items()}, **{k: link(v) for k, v in pages.items()}}


def _steps(first, last) -> str:
    if first is None:
        return ""
    return f"step {first}" if last in (None, first) else f"steps {first}-{last}"


def _still_firing(n) -> str:
    return f", {n} still firing" if type(n) is int and n > 0 else ""


def digest_fields(digest: dict, ui_url: str | None, escape, line: string.Template) -> dict[str, str]:
    """The placeholders of the digest templates; ``entries`` is ``line`` rendered once per rule
    that warned (placeholders ``title``, ``rule``, ``severity``, ``count``, ``steps``, ``metric``,
    ``flapping``, ``open``: ", 1 still firing", or "" when none or unknown)."""
    entries = []
    for e in digest.get("entries", []):
        values = {"title": title_of(e), "rule": _fmt(e.get("rule")), "severity": _fmt(e.get("severity")),
                  "count": _fmt(e.get("count")), "steps": _steps(e.get("first_step"), e.get("last_step")),
                  "metric": _fmt(e.get("metric")), "flapping": " (flapping)" if e.get("flapping") else "",
                  "open": _still_firing(e.get("open"))}
        entries.append(render(line, {k: escape(v) for k, v in values.items()}))
    fields = {"severity": _fmt(digest.get("severity")), "run": _fmt(digest.get("run_id")),
              "count": _fmt(digest.get("count")), "rules": _fmt(len(entries)),
              "since": _clock(digest.get("since")), "until": _clock(digest.get("until"))}
    run_page = _links(escape)(page_url(ui_url, digest.get("run_id")))
    return {**{k: escape(v) for k, v in fields.items()}, "run_page": run_page, "entries": "\n".join(entries)}


def plain_form(event: dict, problem: str) -> dict:
    """What a sink sends for an alert (or digest) that could not be rendered whole (``problem``
    says why): an alert of the fields that identify it, each a short string, with a diagnosis
    that says what happened. Nothing in it can fail to render."""
    def text(key: str) -> str:
        v = event.get(key)
        return v[:256] if isinstance(v, str) else ""

    digest = event.get("schema") == DIGEST_SCHEMA
    what = "digest" if digest else "alert"
    return {"schema": "alert/1", "id": text("id") or "?", "run_id": text("run_id") or "?",
            "rule": "digest" if digest else text("rule") or "?", "summary": "" if digest else text("summary"),
            "severity": text("severity"), "status": "resolved" if event.get("status") == "resolved" else "firing",
            "diagnosis": f"this {what} could not be rendered whole ({problem[:300]}); see {what} "
                         f"{text('id') or '?'} in trainguard", "unrendered": True}


# The template a digest is rendered with instead of an alert's, and its per-rule line.
DIGEST_TEMPLATES = {"title.txt": ("digest_title.txt", "digest_line.md"),
                    "markdown.md": ("digest.md", "digest_line.md"),
                    "slack.md": ("digest_slack.md", "digest_line_slack.md")}


class Templates:
    """Loads ``name`` from ``directory`` (else the packaged one) and renders alerts with it."""

    settings = ("TRAINGUARD_TEMPLATES_DIR", "TRAINGUARD_UI_URL")

    def __init__(self, directory: str | Path | None = None, ui_url: str | None = None, env=None):
        directory = directory or value("TRAINGUARD_TEMPLATES_DIR", env)
        self.directory = Path(directory) if directory else TEMPLATES_DIR
        self.ui_url = ui_url if ui_url is not None else value("TRAINGUARD_UI_URL", env)
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

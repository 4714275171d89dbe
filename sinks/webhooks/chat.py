"""The chat robots: DingTalk and WeCom (markdown) and Slack (blocks). Each renders and sends
what the paging stage gave it (:class:`~trainguard.sinks.paging.PagingSink`)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
import urllib.parse

from trainguard.core.settings import value
from trainguard.sinks.base import csv_values
from trainguard.sinks.paging import DIGEST_SCHEMA
from trainguard.sinks.webhooks.delivery import WebhookSink
from trainguard.sinks.webhooks.messages import escape_markdown, escape_slack


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
    url_setting = "TRAINGUARD_DINGTALK_WEBHOOK"
    settings = (url_setting, "TRAINGUARD_DINGTALK_SECRET", "TRAINGUARD_DINGTALK_AT_MOBILES",
                "TRAINGUARD_DINGTALK_AT_ALL_SEVERITIES")

    @classmethod
    def options(cls, env) -> dict:
        return {"secret": value("TRAINGUARD_DINGTALK_SECRET", env),
                "at_mobiles": csv_values(value("TRAINGUARD_DINGTALK_AT_MOBILES", env)),
                "at_all_severities": csv_values(value("TRAINGUARD_DINGTALK_AT_ALL_SEVERITIES", env))}

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
    url_setting = "TRAINGUARD_WECOM_WEBHOOK"
    settings = (url_setting,)
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
    url_setting = "TRAINGUARD_SLACK_WEBHOOK"
    settings = (url_setting,)

    def payload(self, alert: dict) -> dict:
        # the header is plain_text, shown as is: look-alikes there too, so that nothing in it reads
        # as a link or a mention; the fallback text and the section are mrkdwn
        header = self.templates.render("title.txt", alert, escape_markdown)
        body = self.templates.render("slack.md", alert, escape_slack)
        return {"text": self.templates.render("title.txt", alert, escape_slack),
                "blocks": [{"type": "header", "text": {"type": "plain_text", "text": header[:150]}},
                           # verbatim: Slack links no URL, channel or mention in it; ours are <url>
                           {"type": "section", "text": {"type": "mrkdwn", "text": body[:3000], "verbatim": True}}]}

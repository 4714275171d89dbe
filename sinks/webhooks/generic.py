"""The generic JSON webhook: any HTTP endpoint gets the alert (or digest) itself."""

from __future__ import annotations

import json

from trainguard.core.settings import value
from trainguard.sinks.webhooks.delivery import WebhookSink


class GenericWebhookSink(WebhookSink):
    """POST the alert (or digest) itself as JSON, plus ``text`` (the rendered title, escaped as
    markdown) for chat-like receivers."""

    name = "webhook"
    url_setting = "TRAINGUARD_WEBHOOK_URL"
    settings = (url_setting, "TRAINGUARD_WEBHOOK_HEADERS")

    @classmethod
    def options(cls, env) -> dict:
        headers = value("TRAINGUARD_WEBHOOK_HEADERS", env)
        return {"headers": json.loads(headers) if headers else None}

    def payload(self, alert: dict) -> dict:
        return {**alert, "text": self.templates.render("title.txt", alert)}

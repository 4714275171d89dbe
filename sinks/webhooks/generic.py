"""The generic JSON webhook: any HTTP endpoint gets the alert (or digest) itself."""

from __future__ import annotations

from trainguard.sinks.webhooks.delivery import WebhookSink


class GenericWebhookSink(WebhookSink):
    """POST the alert (or digest) itself as JSON, plus ``text`` (the rendered title, escaped as
    markdown) for chat-like receivers."""

    name = "webhook"

    def payload(self, alert: dict) -> dict:
        return {**alert, "text": self.templates.render("title.txt", alert)}

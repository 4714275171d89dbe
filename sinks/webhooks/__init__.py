"""Chat and HTTP notifications: DingTalk, WeCom, Slack and a generic JSON webhook.

Every sink here is a :class:`WebhookSink`: ``write(batch)`` only puts alerts into an
:class:`Outbox` and returns at once; one sender thread per sink delivers them in order,
retrying with exponential backoff (and jitter) while the receiver is down. What a chat sink
gets to send (pages, digests) is decided before, once for all of them, by the paging stage
(:class:`~trainguard.sinks.paging.PagingSink`); a sink only renders and sends.

Where each part lives: ``delivery.py`` (:class:`WebhookSink`, the :class:`Outbox`, retries,
the outbox folder), ``messages.py`` (templates, escaping), ``chat.py`` (DingTalk, WeCom,
Slack), ``generic.py`` (the generic JSON webhook). Each sink reads its own settings
(``from_env``; the names in its ``settings``).

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
- **One alert never holds another.** Every renderer takes any time and value; an alert no
  template renders is sent in a plain form, or given up at once with the reason when even that
  fails; a message the receiver keeps refusing while it takes others is set apart and retried
  alone (``isolate_after_s``), across restarts too.

Message text comes from the editable templates in ``sinks/templates/`` (see its README)."""

from trainguard.sinks.paging import PagingSink
from trainguard.sinks.webhooks.chat import DingTalkSink, SlackSink, WeComSink, dingtalk_sign
from trainguard.sinks.webhooks.delivery import (
    Item,
    Outbox,
    PermanentError,
    WebhookSetup,
    WebhookSink,
    lock_outbox_dir,
    outbox_dir,
)
from trainguard.sinks.webhooks.generic import GenericWebhookSink
from trainguard.sinks.webhooks.messages import (
    DIGEST_TEMPLATES,
    TEMPLATES_DIR,
    Templates,
    alert_fields,
    digest_fields,
    escape_markdown,
    escape_plain,
    escape_slack,
    render,
    title_of,
)

__all__ = ["DIGEST_TEMPLATES", "TEMPLATES_DIR", "DingTalkSink", "GenericWebhookSink", "Item", "Outbox", "PagingSink",
           "PermanentError", "SlackSink", "Templates", "WeComSink", "WebhookSetup", "WebhookSink", "alert_fields",
           "digest_fields", "dingtalk_sign", "escape_markdown", "escape_plain", "escape_slack", "lock_outbox_dir",
           "outbox_dir", "render", "title_of"]

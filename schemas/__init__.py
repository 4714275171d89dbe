"""Wire contracts: event kinds, strict decoding, JSON Schema documents, command signing."""

from trainguard.schemas.events import (  # noqa: F401
    ACK, ALERT, CHECKPOINT, COMMAND, KINDS, LIFECYCLE, METRICS, REPORT, SchemaError,
    ack_event, checkpoint_event, decode, encode, lifecycle_event, metrics_event, source, source_id,
)

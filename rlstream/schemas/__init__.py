"""Records that cross the broker, their MessagePack codec and validation."""

from rlstream.schemas.codec import DEFAULT_LIMITS, Array, Limits, RecordError, encode_keeping
from rlstream.schemas.records import (
    RECORDS,
    DeadLetter,
    MetricEvent,
    PreferencePair,
    Prompt,
    Record,
    RolloutGroup,
    Sample,
    ScoredGroup,
    SFTExample,
    WeightsAnnouncement,
    decode_any,
    new_id,
)

__all__ = [
    "DEFAULT_LIMITS", "Array", "Limits", "RecordError", "RECORDS", "DeadLetter", "MetricEvent",
    "PreferencePair", "Prompt", "Record", "RolloutGroup", "Sample", "ScoredGroup",
    "SFTExample", "WeightsAnnouncement", "decode_any", "encode_keeping", "new_id",
]

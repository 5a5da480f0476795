"""Former path of `replay_service.specs.packed`, kept for existing imports."""

from replay_service.specs.packed import (  # noqa: F401
    CHUNK_BYTES,
    LAYOUTS,
    MAX_CHUNK_LENGTH,
    NESTED,
    PACKED,
    SEND_AFTER_S,
    PackedLayout,
    PackedWindowWriter,
    SentWriter,
    check_layout,
    chunk_length,
    item_signature,
    layout_of,
    plain_client,
    step_layout,
    unpack,
)

"""Stand-ins the storage unit tests share: a checkpoint format known by a file suffix, and store
metadata of one small table."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from replay_service.storage.metadata import StoreMetadata

FIELD = {"path": "observation", "shape": [3], "dtype": "float32"}


class SuffixFormat:
    """A checkpoint format owning the checkpoints that hold a file ending in `suffix`; it reads
    back as `verified`."""

    def __init__(
        self, backend: str, suffix: str, verified: Any = (0, {}), settle_s: float = 0.0
    ) -> None:
        self.backend = backend
        self.suffix = suffix
        self.verified = verified
        self.settle_s = settle_s

    def owns(self, names: Collection[str]) -> bool:
        return any(name.endswith(self.suffix) for name in names)

    def verify(self, path: str) -> Any:
        return self.verified


def metadata(**changes: Any) -> StoreMetadata:
    """The metadata of table "t" (sequence length 2, capacity 100) storing `FIELD`, changed."""
    fields: dict[str, Any] = {
        "table_name": "t",
        "sequence_length": 2,
        "capacity": 100,
        "data_spec": [FIELD],
    }
    return StoreMetadata(**{**fields, **changes})

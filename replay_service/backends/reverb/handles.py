"""`TableHandle`: what helpers need to know about one table of a running buffer.

Sampling pipelines (tf and torch), export and sharding take a handle, never the manager: it is
small, picklable (DataLoader workers and Ray actors receive it) and holds no connection.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from replay_service.config.options import TableConfig, Timeouts
from replay_service.specs.layouts import Layout
from replay_service.specs.nests import table_signature

# Samplers whose order matters; one sampling worker keeps it.
ORDERED_SAMPLERS = ("fifo", "lifo", "max_heap", "min_heap")


@dataclasses.dataclass(frozen=True)
class TableHandle:
    """One table of a running Reverb server.

    Attributes:
      server_address: "host:port" of the server.
      table: The table's configuration (name, capacity, sequence length, sampling).
      stored_spec: Per-step spec of what the table stores (`data_spec`, or
        `sequences.Masked(data_spec, mask)` for padded tables).
      timeouts: Bounds on blocking calls.
      layout: How the table stores `stored_spec` steps (resolved from `table.layout`).
    """

    server_address: str
    table: TableConfig
    stored_spec: Any
    timeouts: Timeouts
    layout: Layout

    @property
    def name(self) -> str:
        """The table name."""
        return self.table.name

    @property
    def sequence_length(self) -> int:
        """Steps per item."""
        return self.table.sequence_length

    @property
    def signature(self) -> Any:
        """Nest of `tf.TensorSpec` of one item (leading dimension `sequence_length`)."""
        return table_signature(self.stored_spec, self.table.sequence_length)

    @property
    def stored_signature(self) -> Any:
        """What Reverb stores per item: `signature` for a nested table, `uint8[sequence_length,
        step_bytes]` for a packed one (`Layout.item_signature`)."""
        return self.layout.item_signature(self.table.sequence_length)

    @property
    def ordered(self) -> bool:
        """Whether the sampler returns items in an order that one sampling worker keeps."""
        return self.table.sampling.sampler in ORDERED_SAMPLERS

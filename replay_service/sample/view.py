"""What a buffer's samplers are built from: `SampleView`.

`ReplayBufferManager` gives each of its PyTorch sampling factories (`torch_streams.torch_batches`
and `torch_dataset`, `mixing.mixed_torch_batches`, `epochs.epoch_batches`,
`recent.recent_batches`) a `SampleView` of its buffer: the backend, the tables and what each
step stores, and the manager's own checks and counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from replay_service.config.batch_limits import require_batch_size
from replay_service.config.devices import require_device
from replay_service.config.options import TableConfig
from replay_service.config.tables import find_table

if TYPE_CHECKING:
    from replay_service.backends.base import Backend
    from replay_service.sample.torch_streams import TorchSampleSource


@dataclasses.dataclass(frozen=True)
class SampleView:
    """The parts of one buffer its samplers are built from.

    Attributes:
      backend: Where the tables live.
      require_buffer: Returns the replay buffer the backend's sampling calls take back;
        raises `BufferStateError` before the buffer is created or loaded and
        `ManagerClosedError` after `close()`.
      stored_spec: What each step stores (`data_spec`, or `Masked` for padded tables).
      flush_writers: Blocks until the buffer's collectors' items reached the tables.
      count: The number of items in a table, by name (`ReplayBufferManager.num_frames`).
    """

    backend: Backend
    require_buffer: Callable[[], Any]
    stored_spec: Any
    flush_writers: Callable[[], None]
    count: Callable[[str], int]

    @property
    def tables(self) -> tuple[TableConfig, ...]:
        """The buffer's tables, the primary one first (`Backend.tables`)."""
        return self.backend.tables

    def table(self, name: str | None) -> TableConfig:
        """The table called `name`; None: the primary one.

        Raises:
          ConfigError: If there is no such table (`config.tables.find_table`).
        """
        return find_table(self.tables, name)

    def item_bytes(self, steps: int | None = None) -> int:
        """Bytes of one item of `steps` steps (None: the longest sequence length of the
        tables) as a batch holds it: every field of the stored spec, every step."""
        from replay_service.specs.packed import layout_of

        if steps is None:
            steps = max(t.sequence_length for t in self.tables)
        return layout_of(self.stored_spec).step_bytes * steps

    def check_batches(
        self, table: TableConfig, batch_size: int, device: Any, held: int | None = None
    ) -> None:
        """Refuses a batch size above its ceiling for `table`'s items and an unusable device.

        Args:
          table: The table sampled.
          batch_size: Items per batch.
          device: The torch device of the batches.
          held: At most this many items are held (a snapshot of the table); None: any.

        Raises:
          ConfigError: From `config.batch_limits.require_batch_size` or
            `config.devices.require_device`.
        """
        what = f"table {table.name!r}"
        item_bytes = self.item_bytes(table.sequence_length)
        require_batch_size("batch_size", batch_size, item_bytes, what=what, held=held)
        require_device(device)

    def source(self, table: str | None) -> TorchSampleSource:
        """The sample source of table `table` (None: the primary one) torch streams draw from.

        Raises:
          BufferStateError, ManagerClosedError: From `require_buffer`, first.
          ConfigError: If there is no such table.
        """
        replay_buffer = self.require_buffer()
        return self.backend.torch_source(replay_buffer, self.table(table))

"""What a buffer's samplers are built from: `SampleView`.

`ReplayBufferManager` gives each of its PyTorch sampling factories (`torch_streams.torch_batches`
and `torch_dataset`, `mixing.mixed_torch_batches`, `epochs.epoch_batches`,
`recent.recent_batches`) a `SampleView` of its buffer: the backend, the tables and what each
step stores, and the manager's own checks and counts. The manager's tf.data datasets, counts,
train schedules and priority updates are the view's methods.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from replay_service.collect.view import Writers
from replay_service.config.batch_limits import require_batch_size
from replay_service.config.devices import require_device
from replay_service.config.options import TableConfig, Timeouts, require_positive_int
from replay_service.config.tables import find_table
from replay_service.sample import priorities as priorities_lib
from replay_service.sample import rate_limit

if TYPE_CHECKING:
    import tensorflow as tf

    from replay_service.backends.base import Backend
    from replay_service.sample.torch_streams import TorchSampleSource


@dataclasses.dataclass(frozen=True)
class DatasetRequest:
    """What a `get_dataset` call asks of `Backend.dataset`, checked by `SampleView`.

    Attributes:
      table: The table sampled.
      batch_size: Items per batch.
      num_steps: Steps per sampled sequence: None or the table's sequence length for whole
        items; a shorter one splits them (`Capability.SPLIT_SEQUENCES`).
      num_parallel_calls: Parallel calls that split items into shorter sequences.
      prefetch: Batches prefetched ahead.
    """

    table: TableConfig
    batch_size: int
    num_steps: int | None
    num_parallel_calls: int
    prefetch: int


@dataclasses.dataclass(frozen=True)
class MixRequest:
    """What a `mixed_dataset` call asks of `Backend.mixed_dataset`, checked by `SampleView`.

    Attributes:
      weights: Table name -> weight of its items in the batches.
      batch_size: Items per batch.
      seed: Seed of the choice of tables; None: fresh entropy.
      prefetch: Batches prefetched ahead.
    """

    weights: Mapping[str, float]
    batch_size: int
    seed: int | None
    prefetch: int


@dataclasses.dataclass(frozen=True)
class SampleView:
    """The parts of one buffer its samplers are built from.

    Attributes:
      backend: Where the tables live.
      require_client: Returns the client of the tables; raises `BufferStateError` before the
        buffer is created or loaded and `ManagerClosedError` after `close()`.
      require_buffer: Returns the replay buffer the backend's sampling calls take back;
        raises as `require_client`.
      stored_spec: What each step stores (`data_spec`, or `Masked` for padded tables).
      writers: The buffer's open collectors, flushed before a count or a snapshot.
      timeouts: `timeouts.write` bounds a count's wait for the collectors, `timeouts.connect`
        a priority update.
      limiter_state: A table's `rate_limit.LimiterState` by name; None where the backend has
        no rate limiters (`Capability.TRAIN_SCHEDULE`).
      split_sequences: Refuses, with the `ConfigError` of `Backend.refusal`, the
        `get_dataset` it is given (described, e.g. "get_dataset(num_steps=1) of items of 2
        steps") where the backend cannot split items (`Capability.SPLIT_SEQUENCES`).
    """

    backend: Backend
    require_client: Callable[[], Any]
    require_buffer: Callable[[], Any]
    stored_spec: Any
    writers: Writers
    timeouts: Timeouts
    limiter_state: Callable[[str], rate_limit.LimiterState] | None
    split_sequences: Callable[[str], None]

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

    def dataset(
        self,
        batch_size: int,
        num_steps: int | None,
        num_parallel_calls: int,
        prefetch: int,
        table: str | None,
    ) -> tf.data.Dataset:
        """`ReplayBufferManager.get_dataset`: checks its arguments in order, then returns
        `Backend.dataset`.

        Raises:
          BufferStateError, ManagerClosedError: From `require_buffer`, first.
          ConfigError: If `table` is unknown, `prefetch` or `batch_size` is invalid
            (`config.batch_limits.require_batch_size`), or `num_steps` splits items where the
            backend cannot (`split_sequences`) or is not a positive integer.
        """
        replay_buffer = self.require_buffer()
        config = self.table(table)
        require_positive_int("prefetch", prefetch)
        steps = num_steps if isinstance(num_steps, int) else None
        what = f"table {config.name!r}"
        require_batch_size("batch_size", batch_size, self.item_bytes(steps), what=what)
        if num_steps not in (None, config.sequence_length):
            length = config.sequence_length
            self.split_sequences(f"get_dataset(num_steps={num_steps!r}) of items of {length} steps")
            require_positive_int("num_steps", num_steps)
        request = DatasetRequest(config, batch_size, num_steps, num_parallel_calls, prefetch)
        return self.backend.dataset(replay_buffer, request)

    def mixed_dataset(
        self, batch_size: int, weights: Mapping[str, float], seed: int | None, prefetch: int
    ) -> tf.data.Dataset:
        """`ReplayBufferManager.mixed_dataset` once the backend has it: checks `prefetch` and
        `batch_size`, then returns `Backend.mixed_dataset`.

        Raises:
          BufferStateError, ManagerClosedError: From `require_buffer`, first.
          ConfigError: If `prefetch` or `batch_size` is invalid, or (from the backend) a
            weight, a name or the sequence lengths.
        """
        replay_buffer = self.require_buffer()
        require_positive_int("prefetch", prefetch)
        what = "the mixed tables"
        require_batch_size("batch_size", batch_size, self.item_bytes(), what=what)
        request = MixRequest(weights, batch_size, seed, prefetch)
        return self.backend.mixed_dataset(replay_buffer, request)

    def count(self, table: str | None) -> int:
        """The number of items in `table` (None: the primary one), after flushing the
        collectors without waiting on a rate limiter (`rate_limit.flush_for_count`).

        Raises:
          ConfigError: If there is no such table (before the buffer is asked for).
          BufferStateError, ManagerClosedError: From `require_client`.
          WriteTimeoutError: If the collectors' items are not confirmed within
            `timeouts.write`.
        """
        name = self.table(table).name
        client = self.require_client()
        names = [t.name for t in self.tables]
        rate_limit.flush_for_count(self.writers, self.limiter_state, names, self.timeouts.write)
        return self.backend.num_items(client, name)

    def train_schedule(self, batch_size: int, table: str | None) -> rate_limit.TrainSchedule:
        """The `rate_limit.TrainSchedule` of `table` (None: the primary one); the backend has
        rate limiters (`limiter_state` is not None).

        Raises:
          ConfigError: If `table` is unknown, or the limiter's band is too narrow for
            `batch_size` (`rate_limit.check_single_process_loop`).
        """
        name = self.table(table).name
        state = self.limiter_state
        assert state is not None
        return rate_limit.TrainSchedule(
            lambda: state(name), self.writers.flush, batch_size, table_name=name
        )

    def update_priorities(
        self,
        keys: Any,
        priorities: Any,
        tracker: priorities_lib.MaxPriorityTracker | None,
        table: str | None,
    ) -> dict[int, float]:
        """`priorities.update_priorities` of `table` (None: the primary one), bounded by
        `timeouts.connect`.

        Raises:
          ConfigError: If `table` is unknown (first) or a priority is invalid.
          BufferStateError, ManagerClosedError: From `require_client`.
          SpecMismatchError: If the shapes differ or a key is not an integer >= 0.
        """
        name = self.table(table).name
        client, timeout = self.require_client(), self.timeouts.connect
        return priorities_lib.update_priorities(
            client, name, keys, priorities, timeout=timeout, tracker=tracker
        )

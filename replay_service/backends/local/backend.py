"""The in-process backend: the buffer's tables live in this process, no Reverb server.

`LocalBackend` is what `ReplayBufferManager(backend="local")` holds instead of a Reverb
backend. It owns the checkpoint directory through the same `CheckpointStore` protocol (lock,
verified checkpoints, retention, quarantine and fallback on restore), writing each checkpoint in
the portable export format (`replay_service.backends.local.checkpoint`). Its `LocalClient` gives the
collectors (`TrajectoryObserver`, `TransitionWriter`) the few calls they make on a Reverb client,
and `LocalWindowWriter` cuts the same windows as Reverb's structured writer configs do.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import types
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import tree

from replay_service.backends.base import Backend, BackendOptions, Capability, Lifeline
from replay_service.backends.local import checkpoint as local_checkpoint
from replay_service.backends.local import sampling as local_sampling
from replay_service.backends.local.ring import check_tables_fit
from replay_service.backends.local.scratch import check_scratch_dir
from replay_service.backends.local.table import LocalTable, check_device, check_local_table
from replay_service.collect.writing import TableWindows
from replay_service.config.options import TableConfig, Timeouts
from replay_service.errors import CheckpointError, ConfigError, SpecMismatchError
from replay_service.sample.priorities import check_updates
from replay_service.specs.layouts import Layout, NestedLayout
from replay_service.specs.nests import describe_spec
from replay_service.storage import export as export_lib
from replay_service.storage.checkpoint_format import Verified
from replay_service.storage.directory import MEMMAP_DIR
from replay_service.storage.files import check_recorded_files, remove_path
from replay_service.storage.metadata import Checkpoint, StoreMetadata
from replay_service.storage.schedule import CheckpointSchedule
from replay_service.storage.store import CheckpointStore

if TYPE_CHECKING:
    import torch

_log = logging.getLogger(__name__)

LOCAL_ADDRESS = "local"


class Window:
    """One table's windows: the last `sequence_length` steps of an episode, every
    `stride_length` steps (padded tables: windows starting at multiples of the stride).

    Attributes:
      table: The table the windows go into.
      sequence_length: Steps per item.
      stride_length: Steps between the ends of consecutive items.
      priority: Priority of every item.
      padded: The table stores `Masked` steps and windows start at multiples of the stride.
    """

    __slots__ = ("padded", "priority", "sequence_length", "stream", "stride_length", "table")

    def __init__(
        self,
        table: LocalTable,
        sequence_length: int,
        stride_length: int,
        priority: float,
        padded: bool,
    ) -> None:
        if sequence_length != table.config.sequence_length:
            raise ConfigError(
                f"table {table.name!r} holds items of {table.config.sequence_length} steps, "
                f"a writer asked for {sequence_length}"
            )
        self.table = table
        self.sequence_length = sequence_length
        self.stride_length = stride_length
        self.priority = priority
        self.padded = padded
        self.stream = table.stream()  # the steps this writer stored in the table


class LocalWindowWriter:
    """Appends steps of one episode at a time and inserts windows into local tables.

    A collector's `collect.writing.WindowWriter`, with the items of Reverb's `StructuredWriter`
    configs: for an unpadded table, at step index
    `i >= sequence_length - 1` when at least `stride_length` steps passed since its last item;
    for a padded one, when `i % stride_length == (sequence_length - 1) % stride_length`.

    Args:
      windows: One `Window` per table.
    """

    def __init__(self, windows: Sequence[Window]) -> None:
        self._windows = list(windows)
        fields = self._windows[0].table.fields
        self._fields = [
            (str(f["path"]), np.dtype(f["dtype"]), tuple(int(d) for d in f["shape"]))
            for f in fields
        ]
        self._history: list[list[np.ndarray]] = []
        self._since = [0] * len(self._windows)
        self._step_index = -1
        self._longest = max(w.sequence_length for w in self._windows)
        self._frames = self._windows[0].table.frames  # stacked observations: checked

    def append(self, step: Any) -> None:
        """Appends one step (a nest, or the flat list of its leaves); inserts due windows.

        Raises:
          SpecMismatchError: If the step has the wrong number of fields, or a field the wrong
            shape or a value that does not convert to its dtype (naming the field).
        """
        leaves = step if type(step) is list else tree.flatten(step)
        fields = self._fields
        if len(leaves) != len(fields):
            raise SpecMismatchError(
                f"a step has {len(leaves)} fields, the table stores {len(fields)} "
                f"({[path for path, _, _ in fields]})"
            )
        arrays = []
        for value, (path, dtype, shape) in zip(leaves, fields, strict=True):
            if type(value) is np.ndarray and value.dtype == dtype and value.shape == shape:
                arrays.append(value)  # what the collectors' fast paths hand over
                continue
            try:
                array = np.asarray(value, dtype=dtype)
            except (TypeError, ValueError) as e:
                raise SpecMismatchError(f"field {path!r}: {value!r} is not {dtype}: {e}") from e
            if array.shape != shape:
                raise SpecMismatchError(
                    f"field {path!r}: expected shape {list(shape)}, got {list(array.shape)}"
                )
            arrays.append(array)
        if self._frames is not None:
            self._frames.check_step(
                arrays[self._frames.field],
                self._history[-1][self._frames.field] if self._history else None,
                self._step_index + 1,
                f"table {self._windows[0].table.name!r}",
            )
        history = self._history
        history.append(arrays)
        if len(history) > self._longest:
            del history[0]
        index = self._step_index = self._step_index + 1
        since = self._since
        for position, window in enumerate(self._windows):
            since[position] += 1
            length = window.sequence_length
            if index < length - 1:
                continue
            if window.padded:
                due = index % window.stride_length == (length - 1) % window.stride_length
            else:
                due = since[position] >= window.stride_length
            if due:
                fresh = since[position]
                since[position] = 0
                window.table.insert_window(history[-length:], window.priority, window.stream, fresh)

    def flush(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to wait for: items are in the table once `append` returns."""

    def end_episode(self, clear_buffers: bool = True, timeout_ms: int | None = None) -> None:
        """Ends the episode: the next step starts new windows."""
        del clear_buffers, timeout_ms
        self._history = []
        self._since = [0] * len(self._windows)
        self._step_index = -1
        for window in self._windows:
            window.stream.reset()

    def next_episode(self) -> bool:
        """False: `end_episode` ends the episode (it never waits)."""
        return False

    def abandon(self) -> None:
        """Nothing to give up: nothing is pending."""

    def close(self) -> None:
        """Nothing to release."""


class LocalClient:
    """The calls of a Reverb client that collectors and priority updates make, on local tables.

    Args:
      tables: The buffer's tables by name.
    """

    server_address = LOCAL_ADDRESS

    def __init__(self, tables: dict[str, LocalTable]) -> None:
        self.tables = tables

    def window_writer(
        self,
        windows: Sequence[TableWindows],
        layout: Layout | None = None,
        *,
        timeout_ms: int | None = None,
    ) -> LocalWindowWriter:
        """A writer of `(table, sequence_length, stride_length, priority, padded)` windows
        (`collect.writing.WritingClient`).

        Args:
          windows: The windows of every table written.
          layout: Not read: local tables store the step nest (`LocalWindowWriter` checks each
            step against their fields).
          timeout_ms: Not read: items are in the table once `append` returns.

        Raises:
          ConfigError: If a table is unknown or holds items of another length.
        """
        del layout, timeout_ms
        return LocalWindowWriter(
            [Window(self.table(name), *rest) for name, *rest in windows]  # type: ignore[arg-type]
        )

    def table(self, name: str) -> LocalTable:
        """The table `name`.

        Raises:
          ConfigError: If there is none.
        """
        try:
            return self.tables[name]
        except KeyError:
            raise ConfigError(
                f"the local buffer has no table {name!r}; its tables are {sorted(self.tables)}"
            ) from None

    def reset(self, table: str) -> None:
        """Removes every item of `table`."""
        self.table(table).reset()

    def server_info(self, timeout: int | None = None) -> dict[str, Any]:
        """Per table, the fields of Reverb's `TableInfo` that `stats` and `num_frames` read."""
        del timeout
        return {name: _table_info(table) for name, table in self.tables.items()}

    def mutate_priorities(
        self, table: str, updates: dict[int, float] | None = None, deletes: Any = None
    ) -> None:
        """Sets priorities by item key, as `reverb.Client.mutate_priorities` through the Reverb
        backend's `BoundedClient`: the batch is checked whole first, keys of items no longer
        held (or of another table) are ignored.

        Args:
          table: Name of the table.
          updates: Item key -> new priority.
          deletes: Unsupported (must be empty).

        Raises:
          ConfigError: If `table` is unknown, `deletes` is given, or a priority is NaN,
            infinite, negative or not a real number (`priorities.check_updates`).
          SpecMismatchError: If a key is not an integer in [0, 2**64).
        """
        if deletes:
            raise ConfigError("deleting items by key is not supported by the local backend")
        checked = check_updates(updates)
        self.table(table).update_priorities(checked)


class LocalBackend(Backend):
    """A buffer in this process whose checkpoints go to `store` (see module docstring).

    Args:
      store: The checkpoint directory.
      tables: Table configurations, the primary one first.
      data_spec: Per-step data spec (TF-Agents or `array_specs` specs).
      stored_spec: What each step stores (`data_spec`, or `Masked` for padded tables).
      timeouts: `timeouts.checkpoint` is not enforced (checkpoints run in this thread).
      checkpoint_interval_s: Seconds between automatic checkpoints; None: only on request.
      storage: "memory" or "memmap" (see `LocalTable`).
      seed: Seed of the tables' samplers (each table its own generator); None: fresh entropy.
      device: Torch device of the tables' step rings (`table.check_device`); None: host memory.
      layout: What the collectors are given (`Backend.layout`); None: the nested layout of
        `stored_spec` (local tables have their own storage: no other is taken).

    Raises:
      ConfigError: If a table's options are Reverb-only, or `device` is not usable.
    """

    kind = "local"
    capabilities = frozenset(
        {
            Capability.MEMMAP_STORAGE,
            Capability.RECENT_SAMPLING,
            Capability.SEEDED_SAMPLING,
            Capability.DEVICE_STORAGE,
        }
    )
    description = "the local backend (tables in this process)"

    def __init__(
        self,
        store: CheckpointStore,
        tables: Sequence[TableConfig],
        data_spec: Any,
        stored_spec: Any,
        timeouts: Timeouts,
        checkpoint_interval_s: float | None = None,
        storage: str = "memory",
        seed: int | None = None,
        device: str | None = None,
        layout: Layout | None = None,
    ) -> None:
        self._device = None if device is None else check_device(device)
        if self._device is not None and storage != "memory":
            raise ConfigError(
                f"device={device!r} needs storage='memory': storage={storage!r} keeps the "
                "tables in host files"
            )
        self._lifeline = Lifeline()
        self._store = store
        self._configs = tuple(tables)
        self._data_spec = data_spec
        self._stored_spec = stored_spec
        self._timeouts = timeouts
        self._interval = checkpoint_interval_s
        self._storage = storage
        self._seed = seed
        self._layout = NestedLayout(stored_spec) if layout is None else layout
        self.metadata = StoreMetadata.for_tables(self._configs[0], data_spec, self._configs[1:])
        self._fields = describe_spec(stored_spec)
        self._tables: dict[str, LocalTable] = {}
        self._client: LocalClient | None = None
        self._checkpoints = CheckpointSchedule(
            store, self.metadata, log=_log, thread_name="local-checkpoints"
        )
        self._closed = False
        # Memory-mapped table directories this backend's tables created (`storage="memmap"`):
        # the only scratch files its `close()` deletes.
        self._scratch_made: set[str] = set()
        self.restored_from: Checkpoint | None = None
        for config in self._configs:  # refuse Reverb-only options before touching the disk
            check_local_table(config)

    @classmethod
    def from_options(cls, options: BackendOptions) -> LocalBackend:
        """Local tables for `options` (nothing is created before `create` or `load`)."""
        assert options.checkpoint_dir is not None
        return cls(
            CheckpointStore(options.checkpoint_dir, keep=options.keep_checkpoints),
            options.tables,
            options.data_spec,
            options.stored_spec,
            options.timeouts,
            options.checkpoint_interval_s,
            options.storage,
            options.seed,
            options.device,
        )

    @classmethod
    def way_out(cls, capability: Capability) -> str:
        """Reverb's features need backend='reverb'."""
        del capability
        return "it needs backend='reverb' (dm-reverb, Linux x86_64, Python <= 3.11)"

    @property
    def checkpoint_dir(self) -> str:
        """The absolute checkpoint directory."""
        return self._store.root

    @property
    def tables(self) -> tuple[TableConfig, ...]:
        """The tables' configurations, the primary one first."""
        return self._configs

    @property
    def layout(self) -> Layout:
        """The layout the collectors are given (a local table ignores it)."""
        return self._layout

    # ------------------------------------------------------------------ items in and out

    def open_buffer(self, client: Any, clear: Callable[[], None]) -> Any:
        """A `LocalReplayBuffer` of the primary table whose `clear()` is the manager's."""
        del client
        return local_sampling.LocalReplayBuffer(self._source(self._configs[0].name), clear)

    def num_items(self, client: Any, table: str) -> int:
        """The table's size."""
        return int(client.table(table).size)

    def dataset(
        self,
        replay_buffer: Any,
        table: TableConfig,
        batch_size: int,
        num_steps: int | None,
        num_parallel_calls: int,
        prefetch: int,
    ) -> Any:
        """Whole items of the table as tf.data batches (`sampling.tf_dataset`)."""
        del replay_buffer, num_steps, num_parallel_calls  # whole items only (no SPLIT_SEQUENCES)
        return local_sampling.tf_dataset(self._source(table.name), batch_size, prefetch)

    def torch_source(self, replay_buffer: Any, table: TableConfig) -> Any:
        """A `LocalSampleSource` of the table, ended by `close()` of the manager."""
        del replay_buffer
        return self._source(table.name)

    def export(
        self, table: TableConfig, dirpath: str, prefix: str, overwrite: bool
    ) -> tuple[str, str]:
        """Writes the table's items as they are now (no checkpoint needed in this process)."""
        items = self.read_items(table)
        return export_lib.write_export(
            dirpath, prefix, table, self._stored_spec, items, overwrite=overwrite
        )

    def read_items(self, table: TableConfig) -> export_lib.ExportedItems:
        """A copy of the table's items as they are now, oldest first (under the table's lock)."""
        data, priorities, times_sampled = self.client.table(table.name).items()
        return export_lib.ExportedItems(
            data=data, priorities=priorities, times_sampled=times_sampled
        )

    def insert_items(self, table: TableConfig, items: export_lib.ExportedItems) -> None:
        """Inserts the items into the table, in order, with their priorities."""
        self.client.table(table.name).insert(items.data, items.priorities)

    def read_newest(
        self, table: TableConfig, batch_size: int, window: int, rng: np.random.Generator
    ) -> list[torch.Tensor]:
        """Items drawn from the newest `window` of the table (`LocalTable.read_newest`)."""
        return self.client.table(table.name).read_newest(batch_size, window, rng)

    def _source(self, table: str) -> local_sampling.LocalSampleSource:
        return local_sampling.LocalSampleSource(
            self.client.table(table), self._stored_spec, self._timeouts.sample, self._lifeline
        )

    @property
    def client(self) -> LocalClient:
        """The tables' client (after `create` or `load`)."""
        assert self._client is not None
        return self._client

    def create(self, overwrite: bool) -> LocalClient:
        """Starts a new, empty buffer (same checks as the Reverb backends).

        Raises:
          CheckpointExistsError: If checkpoints exist and `overwrite` is False.
          CheckpointError: If the directory is foreign, in use or not writable.
          ConfigError: If the tables cannot fit in the memory or on the disk they would take
            (`check_tables_fit`); nothing was changed.
        """
        store = self._store
        self._check_sizes()  # before anything is written or deleted
        store.check_new(overwrite)
        self._closed = False  # close() releases the directory again (a manager may retry)
        with store.serving():
            self._check_scratch()  # before prepare_new deletes anything
            store.prepare_new(self.metadata, overwrite=overwrite)
            self._start()
        self._checkpoints.start(self.checkpoint, self._interval)
        _log.info("Created an empty local buffer in %s", store.root)
        return self.client

    def load(self) -> LocalClient:
        """Restores the newest checkpoint that verifies and loads (see `CheckpointStore`).

        Raises:
          NoCheckpointError: If there is no checkpoint left that verifies and loads.
          BackendMismatchError: If the newest checkpoint was written by Reverb.
          SpecMismatchError: If the stored tables or data spec differ from the configured ones.
          CheckpointError: If the directory is foreign, in use or unreadable.
          ConfigError: If the tables cannot fit in the memory or on the disk they would take
            (`check_tables_fit`); nothing was changed.
        """
        store = self._store
        stored = store.read_metadata()  # first: it names an unusable directory
        self._check_sizes()
        store.check_backend("local")
        stored.check_matches(self.metadata, store.store_file)
        self._closed = False  # close() releases the directory again (a manager may retry)
        with store.serving():
            # A refused scratch directory must fail the load, not each restore: a restore
            # that fails is taken for a damaged checkpoint and moved aside.
            self._check_scratch()
            self.restored_from = store.restore_latest(
                self.metadata, self._restore, self._discard, backend="local"
            )
        self._checkpoints.start(self.checkpoint, self._interval)
        _log.info("Loaded %s items from %s", self.restored_from.num_items, self.restored_from.path)
        return self.client

    def checkpoint(self) -> str:
        """Writes, verifies and adopts a checkpoint; returns its path under `checkpoints/`.

        Raises:
          CheckpointError: If it fails (the directory keeps no partial checkpoint and the
            buffer keeps its items); the message names the path.
        """

        def write(staging_root: str) -> tuple[str, Verified]:
            path = os.path.join(staging_root, f"local-{time.time_ns()}-{uuid.uuid4().hex}")
            # Collectors and samplers wait while the storage is written in place (as a
            # Reverb table is locked while it is serialized): a consistent snapshot.
            with contextlib.ExitStack() as frozen:
                for table in self._tables.values():
                    frozen.enter_context(table.frozen())
                return path, local_checkpoint.write(path, self._snapshot(copy=False))

        return self._checkpoints.checkpoint(write).path

    def after_clear(self) -> None:
        """Checkpoints the emptied tables, so a later load does not bring old items back."""
        self.checkpoint()

    def last_checkpoint(self) -> tuple[Checkpoint | None, float | None]:
        """The last checkpoint taken and the seconds it took."""
        return self._checkpoints.last_checkpoint, self._checkpoints.last_checkpoint_duration_s

    def close(self) -> None:
        """Stops the schedule, fails waiting samplers and releases the directory (no
        checkpoint). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._checkpoints.stop(self._timeouts.checkpoint)
        for table in self._tables.values():
            table.close()
        self._note_scratch()
        for directory in sorted(self._scratch_made):  # scratch; the checkpoints hold the data
            remove_path(directory)
        if self._scratch_made:
            with contextlib.suppress(OSError):  # kept while it holds anything else
                os.rmdir(os.path.join(self._store.root, MEMMAP_DIR))
        self._scratch_made = set()
        self._store.unlock()

    # ---------------------------------------------------------------------------- helpers

    def _new_table(self, config: TableConfig) -> LocalTable:
        scratch = None
        if self._storage == "memmap":
            scratch = self._scratch_dir(config.name)
        seed = None
        index = [c.name for c in self._configs].index(config.name)
        if self._seed is not None:  # one generator per table, the same for every start
            seed = np.random.SeedSequence(self._seed, spawn_key=(index,))
        # Keys unique across the buffer's tables: an update with another table's key is ignored.
        return LocalTable(
            config,
            self._fields,
            storage=self._storage,
            scratch_dir=scratch,
            seed=seed,
            device=self._device,
            key_stride=len(self._configs),
            key_offset=index,
        )

    def _start(self) -> None:
        self._tables = {config.name: self._new_table(config) for config in self._configs}
        self._client = LocalClient(self._tables)

    def _note_scratch(self) -> None:
        """Records the memory-mapped directories the current tables created (a table creates
        its files at its first insert or restore, always under this backend's lock)."""
        if self._storage != "memmap":
            return
        for table in self._tables.values():
            if table.nbytes:
                self._scratch_made.add(self._scratch_dir(table.name))

    def _check_sizes(self) -> None:
        """Refuses tables that cannot fit in memory ("memory") or on the disk of `.memmap/`
        ("memmap"), before anything is allocated (`check_tables_fit`); a device's ring is
        refused by torch when it is allocated.

        Raises:
          ConfigError: Naming the fields, their shapes, the bytes and what is available.
        """
        if self._device is None:
            scratch_root = os.path.join(self._store.root, MEMMAP_DIR)
            check_tables_fit(self._configs, self._fields, self._storage, scratch_root)

    def _check_scratch(self) -> None:
        """Checks every table's memory-mapped directory ("memmap"; `check_scratch_dir`).

        Raises:
          CheckpointError: If one cannot be used; nothing is changed.
        """
        if self._storage == "memmap":
            for config in self._configs:
                check_scratch_dir(self._scratch_dir(config.name))

    def _scratch_dir(self, name: str) -> str:
        return os.path.join(self._store.root, MEMMAP_DIR, name)

    def _discard(self) -> None:
        self._note_scratch()
        self._tables = {}
        self._client = None

    def _restore(self, checkpoint: Checkpoint) -> None:
        checkpoint.metadata.check_matches(self.metadata, checkpoint.path)
        path = checkpoint.path
        if not local_checkpoint.is_local_checkpoint(path):
            raise CheckpointError(
                f"{path!r} is a Reverb checkpoint; the local backend reads only its own. Load "
                "it with backend='reverb' and export() it, then import_buffer() the export here"
            )
        if checkpoint.files is None:
            raise CheckpointError(f"{path!r} records no file digests")
        # The index's digest first: a damaged index is damage, never a format to refuse.
        check_recorded_files(path, checkpoint.files, [local_checkpoint.INDEX_FILE])
        check_recorded_files(path, checkpoint.files, local_checkpoint.small_files(path))
        names = local_checkpoint.read_index(path)
        if names != [c.name for c in self._configs]:
            raise CheckpointError(f"{path!r} holds tables {names}, not the configured ones")
        self._start()
        total = 0
        for index, config in enumerate(self._configs):
            local_checkpoint.restore_table(
                path, index, self._stored_spec, self._tables[config.name]
            )
            total += self._tables[config.name].size
        if checkpoint.num_items is not None and total != checkpoint.num_items:
            raise CheckpointError(
                f"restoring {path!r} gave {total} items, but {checkpoint.num_items} were "
                "recorded when it was taken"
            )

    def _snapshot(
        self, *, copy: bool = True
    ) -> list[tuple[TableConfig, Any, export_lib.ExportedItems]]:
        tables = []
        for config in self._configs:
            data, priorities, times_sampled = self._tables[config.name].items(copy=copy)
            items = export_lib.ExportedItems(
                data=data, priorities=priorities, times_sampled=times_sampled
            )
            tables.append((config, self._stored_spec, items))
        return tables


def _table_info(table: LocalTable) -> Any:
    """A `TableInfo`-shaped view of a local table (no rate limiter beyond its minimum size)."""
    ns = types.SimpleNamespace
    return ns(
        name=table.name,
        max_size=table.config.capacity,
        current_size=table.size,
        signature=None,
        rate_limiter_info=ns(
            samples_per_insert=1.0,
            min_diff=-float("inf"),
            max_diff=float("inf"),
            min_size_to_sample=table.config.sampling.min_size_to_sample,
            insert_stats=ns(completed=table.inserts),
            sample_stats=ns(completed=table.samples),
        ),
        table_worker_time=ns(waiting_for_sampling_ms=0, waiting_for_inserts_ms=0),
    )

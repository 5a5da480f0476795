"""The in-process backend: the buffer's tables live in this process, no Reverb server.

`LocalBackend` is what `ReplayBufferManager(backend="local")` holds instead of a Reverb
backend. It owns the checkpoint directory through the same `CheckpointStore` protocol (lock,
verified checkpoints, retention, quarantine and fallback on restore), writing each checkpoint in
the portable export format (`replay_service.backends.local.checkpoint`). The collectors write
through its `LocalClient` (`replay_service.backends.local.client`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from replay_service.backends.base import (
    Backend,
    BackendOptions,
    Capability,
    Lifeline,
)
from replay_service.backends.local import checkpoint as local_checkpoint
from replay_service.backends.local import codecs
from replay_service.backends.local import sampling as local_sampling
from replay_service.backends.local.client import LocalClient
from replay_service.backends.local.compressed_column import PayloadBudget
from replay_service.backends.local.ring_fit import check_tables_fit
from replay_service.backends.local.scratch import check_scratch_dir
from replay_service.backends.local.table import LocalTable, check_device, check_local_table
from replay_service.config.options import TableConfig, Timeouts
from replay_service.errors import ConfigError
from replay_service.sample.view import DatasetRequest
from replay_service.specs.layouts import Layout, NestedLayout
from replay_service.specs.nests import describe_spec
from replay_service.storage import export as export_lib
from replay_service.storage.checkpoint_format import Verified
from replay_service.storage.directory import MEMMAP_DIR
from replay_service.storage.files import remove_path
from replay_service.storage.metadata import Checkpoint, StoreMetadata
from replay_service.storage.schedule import CheckpointSchedule
from replay_service.storage.store import CheckpointStore

if TYPE_CHECKING:
    import torch

_log = logging.getLogger(__name__)


def check_compression(compression: str | None, storage: str, device: str | None) -> None:
    """Refuses a `compression=` the local tables cannot take.

    Args:
      compression: A name of `codecs.CODECS`, or None (uncompressed).
      storage: The manager's `storage=`.
      device: The manager's `device=`.

    Raises:
      ConfigError: If `compression` is not a codec's name or its library is not installed
        (naming the pip package), or it is asked with `storage="memmap"` or a `device`.
    """
    if compression is None:
        return
    codecs.codec(compression)
    if storage != "memory":
        raise ConfigError(
            f"compression={compression!r} needs storage='memory', got storage={storage!r}: "
            "compressed steps have variable sizes and do not fit the memory-mapped files' "
            "fixed-size rows (compression alone makes Atari frames about 17x smaller)"
        )
    if device is not None:
        raise ConfigError(
            f"compression={compression!r} needs device=None, got device={device!r}: "
            "compressed steps are kept and decoded in host memory"
        )


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
      compression: Codec of the stored steps' frames (`codecs.CODECS`: "lz4", "zstd",
        "none"); None: uncompressed (`check_compression`).

    Raises:
      ConfigError: If a table's options are Reverb-only, `device` is not usable, or
        `compression` is refused (`check_compression`).
    """

    kind = "local"
    capabilities = frozenset(
        {
            Capability.MEMMAP_STORAGE,
            Capability.RECENT_SAMPLING,
            Capability.SEEDED_SAMPLING,
            Capability.DEVICE_STORAGE,
            Capability.COMPRESSION,
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
        compression: str | None = None,
    ) -> None:
        check_compression(compression, storage, device)
        self._compression = compression
        self._device = None if device is None else check_device(device)
        if self._device is not None and storage != "memory":
            raise ConfigError(
                f"device={device!r} needs storage='memory': storage={storage!r} keeps the "
                "tables in host files"
            )
        self._lifeline = Lifeline()
        self._store = store
        super().__init__(tables, NestedLayout(stored_spec) if layout is None else layout)
        self._data_spec = data_spec
        self._stored_spec = stored_spec
        self._timeouts = timeouts
        self._interval = checkpoint_interval_s
        self._storage = storage
        self._seed = seed
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
        # One budget for the compressed payloads of every table: none is granted memory that
        # another was granted already.
        self._payload_budget = PayloadBudget()
        for config in self._configs:  # refuse Reverb-only options before touching the disk
            check_local_table(config)

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        """`Backend.check_options`, then `check_compression`.

        Raises:
          ConfigError: See `Backend.check_options` and `check_compression`.
        """
        super().check_options(options)
        check_compression(
            options.get("compression"), options.get("storage", "memory"), options.get("device")
        )

    @property
    def compression(self) -> str | None:
        """The codec of the stored steps' frames (`codecs.CODECS`); None: uncompressed."""
        return self._compression

    @classmethod
    def from_options(cls, options: BackendOptions) -> LocalBackend:
        """Local tables for `options` (nothing is created before `create` or `load`)."""
        return cls(
            options.checkpoint_store(),
            options.tables,
            options.data_spec,
            options.stored_spec,
            options.timeouts,
            options.checkpoint_interval_s,
            options.storage,
            options.seed,
            options.device,
            compression=options.compression,
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

    # ------------------------------------------------------------------ items in and out

    def open_buffer(self, client: Any, clear: Callable[[], None]) -> Any:
        """A `LocalReplayBuffer` of the primary table whose `clear()` is the manager's."""
        del client
        return local_sampling.LocalReplayBuffer(self._source(self._configs[0].name), clear)

    def num_items(self, client: Any, table: str) -> int:
        """The table's size."""
        return int(client.table(table).size)

    def dataset(self, replay_buffer: Any, request: DatasetRequest) -> Any:
        """Whole items of the table as tf.data batches (`sampling.tf_dataset`): `num_steps` and
        `num_parallel_calls` do not apply (no SPLIT_SEQUENCES)."""
        del replay_buffer
        source = self._source(request.table.name)
        return local_sampling.tf_dataset(source, request.batch_size, request.prefetch)

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
                return path, local_checkpoint.write(
                    path, self._snapshot(copy=False), self._compression
                )

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
            compression=self._compression,
            payload_budget=self._payload_budget,
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
            check_tables_fit(
                self._configs, self._fields, self._storage, scratch_root, self._compression
            )

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
        local_checkpoint.check_restorable(checkpoint, [c.name for c in self._configs])
        recorded = local_checkpoint.read_compression(checkpoint.path)
        if recorded != self._compression:  # items are stored decoded: encoded anew
            _log.info(
                "Restoring %s (compression=%r) with compression=%r: its frames are encoded "
                "again as they are restored",
                checkpoint.path,
                recorded,
                self._compression,
            )
        self._start()
        tables = [self._tables[config.name] for config in self._configs]
        local_checkpoint.restore_tables(checkpoint, self._stored_spec, tables)

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

"""`LocalTable`: one table of the in-process backend.

A table holds up to `capacity` items, each a window of `sequence_length` steps: per field of
the stored spec one tensor `[capacity, sequence_length, *field_shape]`: in RAM (`torch.empty`
at the first insert, committed as it fills) or as tensordict `MemoryMappedTensor` files
("memmap", for buffers larger than RAM) created with the table, their whole size reserved on
disk then (a full disk is a `ConfigError` there, never a SIGBUS at a later write). Inserts and
samples index those tensors through numpy views: one copy per field, no per-call container.
Items are evicted oldest first once the table is full (Reverb's FIFO remover) and removed after
`max_times_sampled` samples when set.

Samplers (as Reverb's selectors of the same name):
- "uniform": every item equally likely;
- "prioritized": probability proportional to `priority ** priority_exponent`, kept in a sum
  tree (`sum_tree.SumTree`, numpy);
- "fifo": the oldest item, every time (a queue with `max_times_sampled=1`).

Why not TorchRL's replay buffer parts, with torchrl 0.14.1 and the pinned torch 2.13: its
`PrioritizedSampler` needs TorchRL's C++ extension, which does not load with that torch
(undefined symbol, on Python 3.11 and 3.12 alike), and its storages build a `TensorDict` per
`set`/`get` (about 100 us per insert here, 5x slower sampling than indexing the tensors).

Sampling waits until the table holds `min_size_to_sample` items, at most `timeout` seconds.
Every item has a key that is unique for the life of the table (`update_priorities` takes it).
The table is thread-safe: one lock guards it, so a sampling thread and a collecting thread can
share it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import stat
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from replay_service.backends.local.sum_tree import SumTree
from replay_service.config.options import TableConfig
from replay_service.errors import (
    BufferStateError,
    CheckpointError,
    ConfigError,
    ManagerClosedError,
    SpecMismatchError,
)
from replay_service.storage.file_modes import DIR_MODE, make_dirs

LOCAL_SAMPLERS = ("uniform", "prioritized", "fifo")
LOCAL_REMOVERS = ("fifo",)
STORAGES = ("memory", "memmap")
# A checkpoint writes the storage in place when the items, oldest first, occupy fewer than this
# many runs of consecutive slots (a ring buffer: at most two), else it copies them in order.
MAX_VIEW_RUNS = 16
# The files of a table's memory-mapped storage (`_allocate`): the only ones it ever deletes.
_SCRATCH_FILE = re.compile(r"field[0-9]+\.memmap")

# Reverb's item keys are uint64; these start above 0 so that a key is never 0.
_FIRST_KEY = 1


def check_local_table(config: TableConfig) -> None:
    """Refuses what the local backend cannot do, naming the option and the way out.

    Raises:
      ConfigError: For a sampler, remover or rate limiter that only Reverb has.
    """
    sampling = config.sampling
    if sampling.sampler not in LOCAL_SAMPLERS:
        raise ConfigError(
            f"table {config.name!r}: sampler {sampling.sampler!r} needs backend='reverb'; the "
            f"local backend has {LOCAL_SAMPLERS}"
        )
    if sampling.remover not in LOCAL_REMOVERS:
        raise ConfigError(
            f"table {config.name!r}: remover {sampling.remover!r} needs backend='reverb'; the "
            f"local backend evicts the oldest item (remover='fifo')"
        )
    if sampling.samples_per_insert is not None:
        raise ConfigError(
            f"table {config.name!r}: samples_per_insert={sampling.samples_per_insert!r} (a rate "
            "limiter that blocks inserts) needs backend='reverb'; in one process, train every "
            "k collected steps instead"
        )


class LocalTable:
    """One table of the local backend (see module docstring).

    Args:
      config: The table's name, capacity, sequence length and sampling.
      fields: `specs.describe_spec(stored_spec)`: path, dtype and per-step shape of each field.
      storage: "memory" or "memmap" (memory-mapped files under `scratch_dir`).
      scratch_dir: Directory of the memory-mapped files ("memmap"); None: a temporary one.
      seed: Seed of the sampler; None draws one.

    Raises:
      ConfigError: If the sampling is Reverb-only (`check_local_table`) or `storage` unknown.
    """

    def __init__(
        self,
        config: TableConfig,
        fields: Sequence[dict[str, Any]],
        *,
        storage: str = "memory",
        scratch_dir: str | None = None,
        seed: int | None = None,
    ) -> None:
        check_local_table(config)
        if storage not in STORAGES:
            raise ConfigError(f"storage must be one of {STORAGES}, got {storage!r}")
        self.config = config
        self.fields = [dict(f) for f in fields]
        self._names = [str(i) for i in range(len(self.fields))]
        self._shapes = [
            (config.sequence_length, *(int(d) for d in f["shape"])) for f in self.fields
        ]
        self._dtypes = [np.dtype(f["dtype"]) for f in self.fields]
        self._storage_kind = storage
        self._scratch_dir = scratch_dir
        self._columns: list[np.ndarray] | None = None
        capacity = config.capacity
        self._slot_key = np.zeros(capacity, dtype=np.uint64)
        self._slot_seq = np.zeros(capacity, dtype=np.int64)
        self._priority = np.zeros(capacity, dtype=np.float64)
        self._times_sampled = np.zeros(capacity, dtype=np.int32)
        # The occupied slots, densely: `_dense[:size]`; `_where[slot]` is the slot's position.
        self._dense = np.arange(capacity, dtype=np.int64)
        self._where = np.arange(capacity, dtype=np.int64)
        self._size = 0
        self._order: dict[int, int] = {}  # insertion sequence -> slot, oldest first
        self._key_slot: dict[int, int] = {}
        self._keys = itertools.count(_FIRST_KEY)
        self._sequence = itertools.count()
        self._tree = SumTree(capacity) if config.sampling.sampler == "prioritized" else None
        self._rng = np.random.default_rng(seed)
        self._changed = threading.Condition()
        self._closed = False
        self.inserts = 0
        self.samples = 0
        self.deletes = 0
        self.evictions = 0
        self.resets = 0  # streams holding items drawn ahead drop them when this changes
        if storage == "memmap":
            # The files and their disk space are taken now: a disk too small for the table
            # fails here, not with SIGBUS when a write reaches a page the disk has no room for.
            self._columns = self._allocate()

    # ------------------------------------------------------------------------------ state

    @property
    def name(self) -> str:
        """The table name."""
        return self.config.name

    @property
    def size(self) -> int:
        """Items held."""
        return self._size

    @property
    def item_bytes(self) -> int:
        """Bytes of one item's data (every field, every step)."""
        return sum(
            int(np.prod(s)) * d.itemsize for s, d in zip(self._shapes, self._dtypes, strict=True)
        )

    @property
    def nbytes(self) -> int:
        """Bytes of item data the storage holds (allocated for `capacity` once written)."""
        if self._columns is None:
            return 0
        return self.item_bytes * self.config.capacity

    def close(self) -> None:
        """Wakes and fails every waiting sampler; the items stay readable for a checkpoint."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    # ---------------------------------------------------------------------------- writing

    def insert(self, data: Sequence[np.ndarray], priorities: np.ndarray) -> np.ndarray:
        """Inserts items, evicting the oldest ones when the table is full.

        Args:
          data: One array per field, `[n, sequence_length, *field_shape]`, the field's dtype.
          priorities: `[n]` finite priorities >= 0.

        Returns:
          The new items' keys, `uint64 [n]`.

        Raises:
          SpecMismatchError: If a field's shape or dtype differs from the table's.
        """
        count = len(priorities)
        self._check_data(data, count)
        capacity = self.config.capacity
        if count > capacity:  # only the newest `capacity` would survive
            data = [a[count - capacity :] for a in data]
            priorities = priorities[count - capacity :]
            self.deletes += count - capacity
            self.inserts += count - capacity
            count = capacity
        with self._changed:
            self._require_open()
            self._make_room(count)
            slots = self._dense[self._size : self._size + count].copy()
            self._size += count
            keys = np.fromiter(itertools.islice(self._keys, count), np.uint64, count)
            self._write_slots(slots, data)
            for slot, key in zip(slots.tolist(), keys.tolist(), strict=True):
                sequence = next(self._sequence)
                self._order[sequence] = slot
                self._slot_seq[slot] = sequence
                self._key_slot[key] = slot
            self._slot_key[slots] = keys
            self._times_sampled[slots] = 0
            self._set_priorities(slots, np.asarray(priorities, dtype=np.float64))
            self.inserts += count
            self._changed.notify_all()
        return keys

    def insert_window(self, steps: Sequence[Sequence[np.ndarray]], priority: float) -> int:
        """Inserts one item from its steps (each the list of its fields, already converted to
        the table's dtypes and per-step shapes), evicting the oldest item if the table is full.

        This is the collectors' path: each field of each step is copied once into the item's
        slot, with no intermediate stacking.

        Args:
          steps: `sequence_length` steps, oldest first.
          priority: The item's priority (finite, >= 0).

        Returns:
          The new item's key.
        """
        with self._changed:
            self._require_open()
            if self._columns is None:
                self._columns = self._allocate()
            self._make_room(1)
            slot = int(self._dense[self._size])
            self._size += 1
            key = next(self._keys)
            for field, column in enumerate(self._columns):
                row = column[slot]
                for index, step in enumerate(steps):
                    row[index] = step[field]
            sequence = next(self._sequence)
            self._order[sequence] = slot
            self._slot_seq[slot] = sequence
            self._key_slot[key] = slot
            self._slot_key[slot] = key
            self._times_sampled[slot] = 0
            self._priority[slot] = priority
            if self._tree is not None:
                self._tree.set(
                    np.array([slot]), np.array([priority**self.config.sampling.priority_exponent])
                )
            self.inserts += 1
            self._changed.notify()
        return key

    def update_priorities(self, updates: dict[int, float]) -> int:
        """Sets the priorities of items by key; keys no longer held are ignored.

        Returns:
          How many items were updated.
        """
        with self._changed:
            pairs = [(self._key_slot[k], p) for k, p in updates.items() if k in self._key_slot]
            if pairs:
                slots, values = zip(*pairs, strict=True)
                self._set_priorities(np.array(slots), np.array(values, dtype=np.float64))
            return len(pairs)

    def reset(self) -> None:
        """Removes every item (keys are not reused) and counts the reset in `resets`."""
        with self._changed:
            self.resets += 1
            self.deletes += self._size
            self._size = 0
            self._order.clear()
            self._key_slot.clear()
            self._dense = np.arange(self.config.capacity, dtype=np.int64)
            self._where = np.arange(self.config.capacity, dtype=np.int64)
            if self._tree is not None:
                self._tree = SumTree(self.config.capacity)

    # --------------------------------------------------------------------------- sampling

    def sample(
        self, batch_size: int, timeout: float | None, *, with_info: bool = True
    ) -> tuple[list[torch.Tensor], dict[str, np.ndarray]]:
        """Samples `batch_size` items with the table's sampler.

        Args:
          batch_size: Items to sample.
          timeout: Seconds to wait for `min_size_to_sample` items; None waits forever.
          with_info: Whether to return the info (else an empty dict; the items are counted
            as sampled all the same).

        Returns:
          `(data, info)`: one tensor per field, `[batch, sequence_length, *field_shape]`, and
          `info` with numpy arrays "key" (uint64), "probability" (float64), "table_size"
          (int64), "priority" (float64) and "times_sampled" (int32, this sample included).

        Raises:
          BufferStateError: If the table does not hold `min_size_to_sample` items within
            `timeout`.
          ManagerClosedError: If the table was closed (also while waiting).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        limit = self.config.sampling.max_times_sampled
        with self._changed:
            if not limit:
                self._wait_for_items(deadline, timeout)
                return self._sample_slots(batch_size, with_info)
            # As Reverb: an item reaching `max_times_sampled` is removed before the next item
            # of the batch is selected (a FIFO queue gives the oldest items, each once).
            parts = []
            for _ in range(batch_size):
                self._wait_for_items(deadline, timeout)
                parts.append(self._sample_slots(1, with_info))
        data = [torch.cat([p[0][j] for p in parts]) for j in range(len(self.fields))]
        info = {name: np.concatenate([p[1][name] for p in parts]) for name in parts[0][1]}
        return data, info

    def _wait_for_items(self, deadline: float | None, timeout: float | None) -> None:
        need = self.config.sampling.min_size_to_sample
        while self._size < max(need, 1) or self._closed:
            self._require_open()
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise BufferStateError(
                    f"no item could be sampled from table {self.name!r} within {timeout} s: "
                    f"it holds {self._size} items and sampling starts at "
                    f"min_size_to_sample={need}; collect more first"
                )
            self._changed.wait(remaining)

    def _sample_slots(
        self, batch_size: int, with_info: bool = True
    ) -> tuple[list[torch.Tensor], dict[str, np.ndarray]]:
        """Selects, counts and reads `batch_size` items (the lock held, the table not empty);
        removes those that reached `max_times_sampled`."""
        slots, probability = self._select(batch_size)
        # Counts every draw, a slot drawn twice in the batch too.
        np.add.at(self._times_sampled, slots, 1)
        info = {}
        if with_info:
            info = {
                "key": self._slot_key.take(slots),
                "probability": probability,
                "table_size": np.full(batch_size, self._size, dtype=np.int64),
                "priority": self._priority.take(slots),
                "times_sampled": self._times_sampled.take(slots),
            }
        data = self._read_slots(slots)
        self.samples += batch_size
        limit = self.config.sampling.max_times_sampled
        if limit:
            self._remove(np.unique(slots[self._times_sampled[slots] >= limit]))
        return data, info

    def _select(self, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        sampler = self.config.sampling.sampler
        size = self._size
        if sampler == "fifo":
            slot = self._order[next(iter(self._order))]
            return np.full(batch_size, slot, dtype=np.int64), np.ones(batch_size)
        if sampler == "prioritized" and self._tree is not None and self._tree.total > 0:
            total = self._tree.total
            targets = self._rng.random(batch_size) * total
            slots = self._tree.find(np.minimum(targets, np.nextafter(total, 0)))
            weights = self._tree.get(slots)
            bad = weights <= 0  # rounding at a boundary: take the slot's left neighbour's mass
            if bad.any():
                slots[bad] = self._dense[self._rng.integers(0, size, int(bad.sum()))]
                weights = self._tree.get(slots)
            return slots, weights / total
        positions = (self._rng.random(batch_size) * size).astype(np.int64)
        return self._dense[positions], np.full(batch_size, 1.0 / size)

    def read_newest(
        self, batch_size: int, window: int, rng: np.random.Generator
    ) -> list[torch.Tensor]:
        """Reads `batch_size` items drawn uniformly (with replacement) from the newest `window`
        items (all of them when the table holds fewer). Read-only: neither `times_sampled`,
        the sample count nor `max_times_sampled` removals are touched.

        Args:
          batch_size: Items to read.
          window: How many of the newest items to draw from (>= 1).
          rng: The generator of the draws.

        Returns:
          One tensor per field, `[batch, sequence_length, *field_shape]`.

        Raises:
          BufferStateError: If the table is empty.
          ManagerClosedError: If the table was closed.
        """
        with self._changed:
            self._require_open()
            count = min(int(window), self._size)
            if count <= 0:
                raise BufferStateError(f"table {self.name!r} holds no items to read")
            newest = np.fromiter(
                itertools.islice(reversed(self._order.values()), count), np.int64, count
            )
            return self._read_slots(newest[rng.integers(0, count, batch_size)])

    # ------------------------------------------------------------------------ checkpoints

    def items(self, *, copy: bool = True) -> tuple[list[Any], np.ndarray, np.ndarray]:
        """Every item, oldest first: `(data, priorities, times_sampled)`, data one array per
        field `[size, sequence_length, *field_shape]` (the export layout).

        Args:
          copy: False: fields may be `export.Concatenated` views of the storage (no copy, for
            writing a checkpoint), valid only while the caller holds `frozen()`.
        """
        from replay_service.storage.export import Concatenated

        with self._changed:
            slots = np.fromiter(self._order.values(), np.int64, len(self._order))
            if len(slots) == 0 or self._columns is None:
                data: list[Any] = [
                    np.zeros((0, *s), d) for s, d in zip(self._shapes, self._dtypes, strict=True)
                ]
            else:
                breaks = np.flatnonzero(np.diff(slots) != 1) + 1
                if not copy and len(breaks) < MAX_VIEW_RUNS:
                    runs = np.split(slots, breaks)
                    data = [
                        Concatenated(tuple(column[r[0] : r[-1] + 1] for r in runs))
                        for column in self._columns
                    ]
                else:
                    data = [column.take(slots, axis=0) for column in self._columns]
            return data, self._priority[slots].copy(), self._times_sampled[slots].copy()

    def frozen(self) -> Any:
        """A context manager holding the table's lock: no insert, sample or removal meanwhile
        (a checkpoint writes a consistent snapshot of the storage under it)."""
        return self._changed

    def restore(
        self, data: Sequence[np.ndarray], priorities: np.ndarray, times_sampled: np.ndarray
    ) -> None:
        """Refills an empty table with `items()` of a checkpoint (oldest first).

        Raises:
          BufferStateError: If the table is not empty.
          SpecMismatchError: If a field's shape or dtype differs.
        """
        if self._size:
            raise BufferStateError(f"table {self.name!r} is not empty; restore needs an empty one")
        if len(priorities) == 0:
            return
        self.insert(data, np.asarray(priorities, dtype=np.float64))
        with self._changed:
            slots = np.fromiter(self._order.values(), np.int64, len(self._order))
            self._times_sampled[slots] = np.asarray(times_sampled, dtype=np.int32)[-len(slots) :]
            self.inserts -= len(slots)  # restored, not inserted

    # ---------------------------------------------------------------------------- helpers

    def _require_open(self) -> None:
        if self._closed:
            raise ManagerClosedError(
                f"table {self.name!r} was closed with its buffer; create or load a new one"
            )

    def _check_data(self, data: Sequence[np.ndarray], count: int) -> None:
        if len(data) != len(self.fields):
            raise SpecMismatchError(
                f"table {self.name!r} stores {len(self.fields)} fields, got {len(data)}"
            )
        for field, shape, dtype, array in zip(
            self.fields, self._shapes, self._dtypes, data, strict=True
        ):
            if tuple(array.shape) != (count, *shape) or array.dtype != dtype:
                raise SpecMismatchError(
                    f"table {self.name!r} field {field['path']!r}: expected {dtype.name} "
                    f"{[count, *shape]}, got {array.dtype} {list(array.shape)}"
                )

    def _make_room(self, count: int) -> None:
        excess = self._size + count - self.config.capacity
        if excess > 0:
            oldest = list(itertools.islice(self._order.values(), excess))
            self._remove(np.array(oldest, dtype=np.int64))
            self.evictions += excess

    def _remove(self, slots: np.ndarray) -> None:
        for slot in slots.tolist():
            del self._order[int(self._slot_seq[slot])]
            self._key_slot.pop(int(self._slot_key[slot]), None)
            position = int(self._where[slot])
            last = self._size - 1
            moved = int(self._dense[last])
            self._dense[position], self._dense[last] = moved, slot
            self._where[moved], self._where[slot] = position, last
            self._size -= 1
        if len(slots) and self._tree is not None:
            self._tree.set(slots, np.zeros(len(slots)))
        self.deletes += len(slots)

    def _set_priorities(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        self._priority[slots] = priorities
        if self._tree is not None:
            self._tree.set(slots, priorities**self.config.sampling.priority_exponent)

    def _write_slots(self, slots: np.ndarray, data: Sequence[np.ndarray]) -> None:
        if self._columns is None:
            self._columns = self._allocate()
        for column, array in zip(self._columns, data, strict=True):
            column[slots] = array

    def _read_slots(self, slots: np.ndarray) -> list[torch.Tensor]:
        assert self._columns is not None
        return [torch.from_numpy(column.take(slots, axis=0)) for column in self._columns]

    def _allocate(self) -> list[np.ndarray]:
        """One tensor per field, `[capacity, sequence_length, *field_shape]`, as numpy views.

        RAM: `torch.empty` (pages are committed as items are written). "memmap": tensordict's
        `MemoryMappedTensor` files under `scratch_dir`, so the buffer can exceed RAM, their
        whole size reserved on disk first (`_reserve_files`).

        Raises:
          ConfigError: If the disk of `scratch_dir` cannot hold the memory-mapped files.
          CheckpointError: If `scratch_dir` cannot be used (`prepare_scratch_dir`).
        """
        capacity = self.config.capacity
        directory = None
        if self._storage_kind == "memmap":
            if self._scratch_dir is None:
                directory = tempfile.mkdtemp(prefix="replay_memmap_")
            else:
                directory = self._scratch_dir
                prepare_scratch_dir(directory)
            _reserve_files(
                [
                    (
                        os.path.join(directory, f"field{index}.memmap"),
                        capacity * int(np.prod(shape)) * dtype.itemsize,
                    )
                    for index, (shape, dtype) in enumerate(
                        zip(self._shapes, self._dtypes, strict=True)
                    )
                ],
                f"the memory-mapped storage of table {self.name!r} ({capacity} items of "
                f"{self.item_bytes} bytes)",
            )
        columns = []
        for index, (shape, dtype) in enumerate(zip(self._shapes, self._dtypes, strict=True)):
            torch_dtype = torch.from_numpy(np.zeros(0, dtype)).dtype
            if directory is not None:
                from tensordict import MemoryMappedTensor

                tensor = MemoryMappedTensor.empty(
                    (capacity, *shape),
                    dtype=torch_dtype,
                    filename=os.path.join(directory, f"field{index}.memmap"),
                    existsok=True,  # reserved above
                )
            else:
                tensor = torch.empty((capacity, *shape), dtype=torch_dtype)
            columns.append(tensor.numpy())
        return columns


def check_scratch_dir(directory: str) -> None:
    """Checks, without changing anything, that `directory` can hold a table's memory-mapped
    files (see `prepare_scratch_dir`): run it before anything is deleted or restored.

    Args:
      directory: The table's scratch directory, `<checkpoint_dir>/.memmap/<table name>`.

    Raises:
      CheckpointError: If the directory's name is not a plain file name, if it or its parent
        is a symbolic link or not a directory, or if it holds anything but the files of an
        earlier buffer (`field<N>.memmap` regular files); the message names the path.
    """
    name, parent = os.path.basename(directory), os.path.dirname(directory)
    if name in ("", ".", ".."):
        raise CheckpointError(
            f"{directory!r} is not a directory of its own for memory-mapped files: its last "
            f"component {name!r} is not a plain file name"
        )
    try:
        for path in (parent, directory):
            if os.path.islink(path):
                raise CheckpointError(
                    f"{path!r} is a symbolic link (to {_link_target(path)!r}); the memory-mapped "
                    "storage writes and deletes there and never follows links. Nothing was "
                    "changed: remove the link"
                )
            if os.path.lexists(path) and not stat.S_ISDIR(os.lstat(path).st_mode):
                raise CheckpointError(
                    f"{path!r} exists and is not a directory; the memory-mapped storage needs a "
                    "directory there. Nothing was changed: move it aside"
                )
        if not os.path.lexists(directory):
            return
        foreign = [
            entry
            for entry in sorted(os.listdir(directory))
            if not _SCRATCH_FILE.fullmatch(entry)
            or not stat.S_ISREG(os.lstat(os.path.join(directory, entry)).st_mode)
        ]
    except OSError as e:
        raise CheckpointError(
            f"cannot use {directory!r} for memory-mapped files: {e.strerror or e}"
        ) from e
    if foreign:
        raise CheckpointError(
            f"{directory!r} holds entries the memory-mapped storage did not create "
            f"({', '.join(repr(e) for e in foreign[:5])}); nothing was deleted: move them aside"
        )


def prepare_scratch_dir(directory: str) -> None:
    """Makes `directory` an empty, real directory (mode `DIR_MODE`) for memory-mapped files.

    Its parent (`<checkpoint_dir>/.memmap`) is created (mode `DIR_MODE`) if missing. Files that
    an earlier buffer of this directory left there (`field<N>.memmap` regular files: a closed
    buffer, a failed restore, a crash; their items live in the checkpoints) are deleted;
    nothing else is ever deleted, and no symbolic link is followed.

    Args:
      directory: The table's scratch directory, `<checkpoint_dir>/.memmap/<table name>`.

    Raises:
      CheckpointError: If `check_scratch_dir` refuses it (nothing was deleted then), or it
        cannot be created or emptied; the message names the path.
    """
    check_scratch_dir(directory)
    try:
        make_dirs(os.path.dirname(directory))
        with contextlib.suppress(FileExistsError):  # checked above: a real directory
            os.mkdir(directory, DIR_MODE)
        os.chmod(directory, DIR_MODE)
        for entry in os.listdir(directory):  # an earlier buffer's files (checked above)
            if _SCRATCH_FILE.fullmatch(entry):
                os.unlink(os.path.join(directory, entry))
    except OSError as e:
        raise CheckpointError(
            f"cannot use {directory!r} for memory-mapped files: {e.strerror or e}"
        ) from e


def _link_target(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def _reserve_files(files: Sequence[tuple[str, int]], what: str) -> None:
    """Creates each file of `files` with its whole size allocated on disk (`posix_fallocate`).

    A memory-mapped file whose blocks are not allocated takes them when a page is first
    written; on a full disk that write kills the process with SIGBUS. Reserved blocks are the
    file's until it is deleted, so writes through the mapping never need new ones.

    Args:
      files: `(path, bytes)` of each file to create; none of them may exist.
      what: What the files hold, for the error.

    Raises:
      ConfigError: If a file cannot be created or its space cannot be reserved (a full disk, a
        quota); it names the file, the bytes needed and those free. The files this call created
        are removed again.
    """
    created: list[str] = []
    path, size = "", 0
    try:
        for path, size in files:
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(path, flags, 0o600)
            created.append(path)
            try:
                if size:
                    os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
    except OSError as e:
        for done in created:
            with contextlib.suppress(OSError):
                os.unlink(done)
        needed = sum(n for _, n in files)
        try:
            stats = os.statvfs(os.path.dirname(path) or ".")
            free = f"{stats.f_bavail * stats.f_frsize} bytes free there"
        except OSError:
            free = "free space unknown"
        raise ConfigError(
            f"cannot reserve {needed} bytes on disk for {what} in "
            f"{os.path.dirname(path)!r} ({free}): {path!r} ({size} bytes): {e.strerror or e}; "
            "free disk space, lower the capacity or use storage='memory'"
        ) from e

"""The step ring of a local table: where its items' steps are stored, and how it grows.

Every field of the stored spec is one tensor `[ring size, *field_shape]` in which each step is
stored once, however many items it belongs to, as Reverb's chunks and TorchRL's slice sampler
keep them. Steps have serial numbers in the order they were written; the ring holds the serials
`[_oldest, _written)`, the one at ring position `p` being `p - _head + _written` (mod the ring
size). Per step the ring keeps the number of items it is the first step of (`_refs`, uint8 until
a step is the first of 255 items) and, once the writers of a table interleave their steps, the
distance to its writer's next step (`_gap`; None: every gap 1).

The ring starts at `capacity + sequence_length - 1` steps, what one writer's overlapping
windows need, and grows (the storage is copied in step order, by an eighth of its size or more)
whenever the step it would overwrite next still belongs to an item (`_claim`), so `capacity`
items fit whatever the writers, strides and padding. Its storage is in RAM (`torch.empty`,
committed as it fills), growing up to `capacity * sequence_length**2` steps, or, with
"memmap", tensordict `MemoryMappedTensor` files (for buffers larger than RAM) created with the
table for `capacity * sequence_length` steps (`capacity` windows that share nothing), their
whole size reserved on disk then (`scratch.reserve_files`: a full disk is a `ConfigError`
there, never a SIGBUS at a later write); its writers do not share steps between windows (each
window is written whole into a ring of `capacity` windows, so `capacity` items fit there too).
Should a ring at its largest size still be short, it evicts the oldest items until none holds a
step it overwrites. With a `device` the ring is torch tensors on that device, written from
host steps and gathered there by index.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from replay_service.backends.local.scratch import (
    check_free,
    prepare_scratch_dir,
    reserve_files,
    scratch_file,
    scratch_file_bytes,
)
from replay_service.backends.local.shared import SharedTable
from replay_service.config.options import TableConfig
from replay_service.errors import ConfigError
from replay_service.specs import sizes

STORAGES = ("memory", "memmap")
# A growing step ring takes at least this fraction of its size more (a growth copies the ring).
_GROWTH = 0.125


class StepRing:
    """The step ring of a `LocalTable`, a base class of it (see the module docstring).

    It owns the storage (`_columns`, `_tensors`), the per-step metadata (`_refs`, `_gap`) and
    the ring's counters; the table's items are the table's (`_first`, `_consecutive`: where
    each item's steps start and whether they are consecutive serials), and removing them is
    the table's (`_evict_oldest`), which `_claim` calls when a ring at its largest size is
    short.
    """

    # What the table provides.
    name: str
    size: int
    _length: int
    _first: np.ndarray
    _consecutive: np.ndarray | None
    _scattered: int
    _shared: SharedTable | None
    _evict_oldest: Callable[[int], None]

    def _init_ring(
        self,
        *,
        capacity: int,
        step_shapes: Sequence[tuple[int, ...]],
        dtypes: Sequence[np.dtype],
        storage: str,
        scratch_dir: str | None,
        device: torch.device | None,
    ) -> None:
        """Sets up an empty ring (its storage is allocated at the first insert, or now by the
        table for "memmap", see `_allocate`).

        Args:
          capacity: Items the table holds at most.
          step_shapes: Per-step shape of each field.
          dtypes: Each field's dtype.
          storage: One of `STORAGES` (checked by the table): "memory", or "memmap" (files
            under `scratch_dir`).
          scratch_dir: Directory of the memory-mapped files; None: a temporary one.
          device: Where the ring lives (checked by the table); None: host memory.

        """
        length = self._length
        self._device = device
        self._step_shapes = list(step_shapes)
        self._dtypes = list(dtypes)
        self._storage_kind = storage
        self._scratch_dir = scratch_dir
        self._ring_size = ring_steps(capacity, length, storage)
        self._max_steps = capacity * length * length
        # Files cannot grow: reserved once, for `capacity` windows that share no step.
        self._shares = storage == "memory"
        if storage == "memmap":
            self._max_steps = self._ring_size
        # numpy views of `_tensors`, or with a `device` the tensors themselves.
        self._columns: list[Any] | None = None
        self._tensors: list[torch.Tensor] = []
        self._gap: np.ndarray | None = None
        self._refs = np.zeros(0, dtype=np.uint8)
        self._head = 0
        self._written = 0
        self._oldest = 0
        self._offsets = np.arange(length, dtype=np.int64)

    @property
    def step_bytes(self) -> int:
        """Bytes of one step's data (every field)."""
        return sum(
            int(np.prod(s)) * d.itemsize
            for s, d in zip(self._step_shapes, self._dtypes, strict=True)
        )

    @property
    def item_bytes(self) -> int:
        """Bytes of one item's data as sampled (every field, every step)."""
        return self.step_bytes * self._length

    @property
    def step_capacity(self) -> int:
        """Steps the ring holds now (it grows as needed, see the module docstring)."""
        return self._ring_size

    @property
    def nbytes(self) -> int:
        """Bytes the storage holds: the step ring's data and its per-step metadata (0 before
        the first insert in RAM)."""
        if self._columns is None:
            return 0
        gap = 0 if self._gap is None else self._gap.nbytes
        return self._ring_size * self.step_bytes + gap + self._refs.nbytes

    def _positions(self, serials: np.ndarray) -> np.ndarray:
        """Ring positions of steps still in the ring, by serial number."""
        positions = serials + (self._head - self._written)  # in [head - ring size, head)
        np.add(positions, self._ring_size, out=positions, where=positions < 0)
        return positions

    def _claim(self, count: int, keep: int) -> bool:
        """Makes room for `count` new steps at the head of the ring: grows it while the
        oldest steps they would overwrite are an item's (or at serial `keep` >= 0 or later).

        At its largest size, the oldest items are evicted instead until none of them starts
        in the overwritten steps.

        Returns:
          False (nothing changed) if the steps from `keep` on cannot be kept. `count` steps
          always fit (`count` is at most the largest size).
        """
        while True:
            size = self._ring_size
            cutoff = self._written + count - size  # serials below it are overwritten
            oldest = self._oldest
            if cutoff <= oldest:
                return True
            if 0 <= keep < cutoff or count > size:  # the new steps themselves must fit
                used = True
            elif cutoff - oldest <= 8:  # a few steps (an item's): no arrays
                refs, base = self._refs, self._head - self._written
                used = any(refs[(serial + base) % size] for serial in range(oldest, cutoff))
            else:
                lost = np.arange(oldest, cutoff, dtype=np.int64)
                used = bool(self._refs[self._positions(lost)].any())
            if not used:
                return True
            if size < self._max_steps:
                needed = self._written - self._oldest + count
                self._grow(min(self._max_steps, max(needed, size + int(size * _GROWTH) + 1)))
                continue
            if 0 <= keep < cutoff:
                return False
            # Oldest first, as the FIFO remover, until no held item starts in those steps.
            lost = self._positions(np.arange(oldest, cutoff, dtype=np.int64))
            while self.size and self._refs[lost].any():
                self._evict_oldest(1)
            return True

    def _grow(self, steps: int) -> None:
        """Moves the ring into a larger one of `steps` steps, oldest step first."""
        assert self._columns is not None
        held = self._written - self._oldest
        order = self._positions(np.arange(self._oldest, self._written, dtype=np.int64))
        assert self._shared is None, "a shared ring has its largest size"
        columns, tensors = [], []
        for column in self._columns:
            if self._device is not None:
                tensor = column.new_empty((steps, *column.shape[1:]))
                tensor[:held] = column[self._index(order)]
                columns.append(tensor)
            else:
                tensor = torch.empty(
                    (steps, *column.shape[1:]), dtype=torch.from_numpy(column[:0]).dtype
                )
                grown = tensor.numpy()
                np.take(column, order, axis=0, out=grown[:held])
                columns.append(grown)
            tensors.append(tensor)
        self._tensors = tensors
        if self._gap is not None:
            gap = np.ones(steps, dtype=np.int32)
            gap[:held] = self._gap[order]
            self._gap = gap
        refs = np.zeros(steps, dtype=self._refs.dtype)
        refs[:held] = self._refs[order]
        self._columns, self._refs = columns, refs
        self._ring_size = steps
        self._head = held % steps

    def _gaps(self) -> np.ndarray:
        """`_gap`, made when a writer's steps first interleave with another's."""
        if self._gap is None:
            self._gap = np.ones(self._ring_size, dtype=np.int32)
        return self._gap

    def _window_positions(self, slots: np.ndarray) -> np.ndarray:
        """Ring positions `[len(slots), sequence_length]` of the steps of the items of `slots`."""
        first = self._first.take(slots)
        consecutive = None if not self._scattered else self._consecutive.take(slots)
        if consecutive is None or consecutive.all():  # every item: its consecutive positions
            positions = first[:, None] + (self._offsets + (self._head - self._written))
            np.add(positions, self._ring_size, out=positions, where=positions < 0)
            return positions
        # Interleaved writers: follow each step to its writer's next one.
        serials = first[:, None] + self._offsets
        scattered = np.flatnonzero(~consecutive)
        serial = first[scattered]
        for index in range(1, self._length):
            serial = serial + self._gap[self._positions(serial)]
            serials[scattered, index] = serial
        return self._positions(serials)

    def _step_positions(self, slots: np.ndarray, last: int) -> list[np.ndarray]:
        """Ring positions of steps `0..last` of the items of `slots`, one array `[len(slots)]`
        per step: as the columns of `_window_positions`, without its whole windows (a
        transition reads two steps of each item)."""
        position = self._first.take(slots)
        position += self._head - self._written
        np.add(position, self._ring_size, out=position, where=position < 0)
        positions = [position]
        if last:
            # Interleaved writers: a scattered item's next step is its writer's next one (where
            # every held item is scattered, as a vector env's, no item needs telling apart).
            scattered = self._scattered
            consecutive = None
            if scattered and scattered != self.size:
                consecutive = self._consecutive.take(slots)
            for _ in range(last):
                if not scattered:
                    position = position + 1
                elif consecutive is None:
                    position = position + self._gap.take(position)
                else:
                    position = position + np.where(consecutive, 1, self._gap.take(position))
                np.subtract(
                    position, self._ring_size, out=position, where=position >= self._ring_size
                )
                positions.append(position)
        return positions

    def _read_slots(self, slots: np.ndarray) -> list[torch.Tensor]:
        """The items of `slots` gathered from the ring, one tensor per field."""
        assert self._columns is not None
        positions = self._window_positions(slots)
        if self._device is not None:  # gathered on the device: only the positions travel
            index = self._index(positions)
            return [column[index] for column in self._columns]
        return [torch.from_numpy(column.take(positions, axis=0)) for column in self._columns]

    def _read_steps(
        self, slots: np.ndarray, steps: Sequence[tuple[int, int]]
    ) -> list[torch.Tensor]:
        """Step `step` of field `field` of the items of `slots`, per `(field, step)` pair."""
        assert self._columns is not None
        by_step = self._step_positions(slots, max(step for _, step in steps))
        if self._device is not None:
            index = [self._index(at) for at in by_step]
            return [self._columns[field][index[step]] for field, step in steps]
        return [
            torch.from_numpy(self._columns[field].take(by_step[step], axis=0))
            for field, step in steps
        ]

    def _index(self, positions: np.ndarray) -> torch.Tensor:
        """Ring positions as an index tensor on the table's device."""
        return torch.from_numpy(np.ascontiguousarray(positions)).to(self._device)

    def _allocate(self) -> None:
        """The step ring: one tensor per field, `[ring size, *field_shape]`, as numpy views.

        RAM: `torch.empty` (pages are committed as steps are written; `share_memory` makes
        its own ring in shared memory). "memmap": tensordict's `MemoryMappedTensor` files
        under `scratch_dir` (shared mappings), so the buffer can exceed RAM, their whole size
        reserved on disk first (`scratch.reserve_files`).

        Raises:
          ConfigError: If the disk of `scratch_dir` cannot hold the memory-mapped files.
          CheckpointError: If `scratch_dir` cannot be used (`scratch.prepare_scratch_dir`).
        """
        steps = self._ring_size
        directory = None
        if self._storage_kind == "memmap":
            if self._scratch_dir is None:
                directory = tempfile.mkdtemp(prefix="replay_memmap_")
            else:
                directory = self._scratch_dir
                prepare_scratch_dir(directory)
            reserve_files(
                [
                    (scratch_file(directory, index), steps * int(np.prod(shape)) * dtype.itemsize)
                    for index, (shape, dtype) in enumerate(
                        zip(self._step_shapes, self._dtypes, strict=True)
                    )
                ],
                f"the memory-mapped storage of table {self.name!r} ({steps} steps of "
                f"{self.step_bytes} bytes)",
                self.fields,
            )
        columns, tensors = [], []
        for index, (shape, dtype) in enumerate(zip(self._step_shapes, self._dtypes, strict=True)):
            torch_dtype = torch.from_numpy(np.zeros(0, dtype)).dtype
            if directory is not None:
                from tensordict import MemoryMappedTensor

                tensor = MemoryMappedTensor.empty(
                    (steps, *shape),
                    dtype=torch_dtype,
                    filename=scratch_file(directory, index),
                    existsok=True,  # reserved above
                )
            else:
                tensor = torch.empty((steps, *shape), dtype=torch_dtype, device=self._device)
            columns.append(tensor if self._device is not None else tensor.numpy())
            tensors.append(tensor)
        self._columns = columns
        self._tensors = tensors
        self._gap = None
        self._refs = np.zeros(steps, dtype=np.uint8)


def ring_steps(capacity: int, sequence_length: int, storage: str) -> int:
    """Steps of a table's step ring when it is made: `capacity + sequence_length - 1` in RAM
    (windows of one writer share steps; it grows if writers interleave), `capacity *
    sequence_length` in files ("memmap": reserved once, for windows that share no step)."""
    if storage == "memmap":
        return capacity * sequence_length
    return capacity + sequence_length - 1


def check_tables_fit(
    configs: Sequence[TableConfig],
    fields: Sequence[dict[str, Any]],
    storage: str,
    scratch_root: str,
) -> None:
    """Refuses tables whose step rings cannot fit where they would live, before any exists.

    `storage="memory"`: the rings' bytes (`ring_steps` x the step's bytes, every table) must
    fit in the memory available (`sizes.available_memory`); RAM pages are committed as steps
    are written, so a ring too large would be accepted and the process killed once it fills.
    "memmap": every table's files must fit on the disk of `scratch_root` (`scratch.check_free`,
    which `reserve_files` applies again to each table's files when they are made). Unknown
    amounts (another platform) pass.

    Args:
      configs: The tables (capacity, sequence length, name).
      fields: `specs.describe_spec(stored_spec)` of one step.
      storage: "memory" or "memmap".
      scratch_root: `<checkpoint_dir>/.memmap` (it may not exist yet), for "memmap".

    Raises:
      ConfigError: Naming the bytes per step and the largest fields with their shapes, each
        table's steps, the total and the bytes available.
    """
    per_step = sizes.step_bytes(fields)
    rings = [(c.name, ring_steps(c.capacity, c.sequence_length, storage), c) for c in configs]
    if storage == "memmap":
        files = [
            (os.path.join(scratch_root, name, f"field{index}.memmap"), steps * field.nbytes)
            for name, steps, _ in rings
            for index, field in enumerate(sizes.field_sizes(fields))
        ]
        names = ", ".join(repr(name) for name, _, _ in rings)
        # An earlier buffer's files there are deleted before the new ones are reserved.
        reclaimable = sum(scratch_file_bytes(os.path.join(scratch_root, n)) for n, _, _ in rings)
        what = f"the memory-mapped storage of tables {names}"
        check_free(files, what, fields, scratch_root, reclaimable)
        return
    available = sizes.available_memory()
    total = sum(steps for _, steps, _ in rings) * per_step
    if available is None or total <= available:
        return
    tables = "; ".join(
        f"table {name!r}: {steps} steps for capacity {config.capacity}"
        for name, steps, config in rings
    )
    raise ConfigError(
        f"the local tables need {total} bytes ({sizes.human(total)}) of memory "
        f"(storage='memory'), but {available} bytes ({sizes.human(available)}) are available: "
        f"{per_step} bytes per step ({tables}); the largest fields per step: "
        f"{sizes.largest_fields(fields)}. Nothing was allocated: lower the capacity or the "
        "field's shape, or use storage='memmap' (the rings in files on the disk of "
        "checkpoint_dir)"
    )

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
items fit whatever the writers, strides and padding, up to `capacity * sequence_length**2`
steps. Its storage is in RAM (`torch.empty`, committed as it fills) or, with "memmap",
tensordict `MemoryMappedTensor` files (for buffers larger than RAM), written the same way:
each step once, the same bytes per step. The files are created with the table for the
starting ring, their whole size reserved on disk then (`scratch.reserve_files`: a full disk is
a `ConfigError` there, never a SIGBUS at a later write). A growing memory-mapped ring moves
into new files (`scratch.spare_file`), their whole size reserved before anything is copied;
its steps are copied oldest first from mapping to mapping (through the page cache, no copy
in RAM) and the new files renamed over the old ones. Files reserved up front at the largest
size would hold the disk at `sequence_length**2` times the starting ring's size for a ring
that rarely grows past an eighth more. Where the disk cannot hold the larger files the ring
keeps its size, logs a warning, and evicts instead (below) until it has been written round
once more, when growing is tried again; an insert of more steps than the ring holds
(`insert` of many windows, a restore) is refused whole then with a `ConfigError`.
Should a ring at its largest size still be short, it evicts the oldest items until none holds a
step it overwrites. With a `device` the ring is torch tensors on that device, written from
host steps and gathered there by index. With `compression=` the frame column of a stacked
observation and every field of at least `COMPRESS_MIN_BYTES` per step are
`compressed_column.CompressedColumn`s (a payload per step, grown by `remap`); an insert whose
payloads the memory cannot hold (those it encodes under the table's lock counted at their
largest) is refused whole with a `ConfigError` before it changes anything
(`_check_payload_room`, `compressed_column.PayloadBudget`, one for the backend's tables).
Reads (`ring_reads`) gather their payloads under the table's lock and return `Deferred`s,
which the table decodes (`decoded`) after releasing it.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from replay_service.backends.local.batch_buffers import BatchBuffers
from replay_service.backends.local.codecs import COMPRESS_MIN_BYTES, SLOT_OVERHEAD, Codec, codec
from replay_service.backends.local.compressed_column import CompressedColumn, PayloadBudget
from replay_service.backends.local.ring_fit import ring_steps
from replay_service.backends.local.ring_reads import RingReads
from replay_service.backends.local.scratch import (
    prepare_scratch_dir,
    remove_files,
    reserve_files,
    scratch_file,
    spare_file,
)
from replay_service.backends.local.shared import SharedTable
from replay_service.errors import ConfigError
from replay_service.specs.frames import FrameStack

_log = logging.getLogger(__name__)

STORAGES = ("memory", "memmap")
# A growing step ring takes at least this fraction of its size more.
_GROWTH = 0.125
# Linux's MAP_NORESERVE (Python's mmap module does not name it before 3.12): address space
# reserved for a ring's largest size, its pages committed only as steps are written.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)


class StepRing(RingReads):
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
    fields: list[dict[str, Any]]
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
        frames: FrameStack | None = None,
        compression: str | None = None,
        budget: PayloadBudget | None = None,
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
          frames: The stacked observation (`frames.FrameStack`): its column holds each
            step's newest frame and `_preds` the serials of its earlier frames; None: none.
          compression: Codec of the large fields (`codecs.CODECS`; "memory" storage on the
            host only, checked by the backend): the frame column and every field of at
            least `COMPRESS_MIN_BYTES` per step become `CompressedColumn`s; None: none.
          budget: The `PayloadBudget` of the backend's tables (one for all of them, so that
            two tables are never granted the same memory); None: one of the table's own.
        """
        length = self._length
        self._device = device
        self._frames = frames
        self._step_shapes = list(step_shapes)
        if frames is not None:
            self._step_shapes[frames.field] = frames.frame
        # Steps an item needs: its window and, stacked, its first step's earlier frames.
        span = length if frames is None else length + frames.k - 1
        self._dtypes = list(dtypes)
        self._compression = compression
        self._codec: Codec | None = None if compression is None else codec(compression)
        # Per compressed field, its payloads' largest bytes with a slot's (made on first use).
        self._payload_bounds: dict[int, int] | None = None
        # The fields stored compressed (indexes).
        self._compressed: frozenset[int] = frozenset(
            index
            for index, (shape, dtype) in enumerate(
                zip(self._step_shapes, self._dtypes, strict=True)
            )
            if compression is not None
            and (
                (frames is not None and index == frames.field)
                or int(np.prod(shape)) * dtype.itemsize >= COMPRESS_MIN_BYTES
            )
        )
        # How far the compressed columns (the backend's tables') may grow before the memory is
        # looked at again.
        self._budget = PayloadBudget() if budget is None else budget
        self._storage_kind = storage
        self._scratch_dir = scratch_dir
        self._ring_size = ring_steps(capacity, length, frames and frames.k)
        self._max_steps = capacity * span * span
        # Whether a writer's windows share steps (not once in shared memory, see `sharing`).
        self._shares = True
        # The writers' path (`next_steps.NextSteps`): the fields other than the stacked
        # one, and a zero frame's bytes (b"": frames not stacked along axis 0; None: not made).
        self._unstacked = [
            index
            for index in range(len(self._step_shapes))
            if frames is None or index != frames.field
        ]
        self._zero_frame: bytes | None = None
        # `next_steps.NextSteps.insert_next`'s flat views of `_columns` and `_preds`
        # (`_flat_views`), remade when either is.
        self._flat: Any = None
        # "memmap": the directory of the files (made by `_allocate`); None: none yet.
        self._memmap_dir: str | None = None
        # Files that could not grow: the ring grows again once this serial is written.
        self._grow_after = 0
        self._grow_refused = ""
        # numpy views of `_tensors`, or with a `device` the tensors themselves.
        self._columns: list[Any] | None = None
        self._tensors: list[torch.Tensor] = []
        self._gap: np.ndarray | None = None
        self._refs = np.zeros(0, dtype=np.uint8)
        # Per step, the serials of its K-1 earlier frames, oldest first (-1: a zero frame).
        self._preds: np.ndarray | None = None
        # Host RAM rings: per field the array of the ring's largest size, address space only
        # until written; the ring grows inside it (`_grow`). None: a ring that is copied.
        self._reserved: list[np.ndarray] | None = None
        # The arrays reads gather batches into, reused once no batch refers to them.
        self._buffers = BatchBuffers()
        self._head = 0
        self._written = 0
        self._oldest = 0
        self._offsets = np.arange(length, dtype=np.int64)

    @property
    def frames(self) -> FrameStack | None:
        """The stacked observation whose frames are stored once; None: none."""
        return self._frames

    @property
    def on_host(self) -> bool:
        """Whether the step ring is in host memory (numpy columns), not on a device."""
        return self._device is None

    @property
    def step_bytes(self) -> int:
        """Bytes of one step's data (every field)."""
        return sum(
            int(np.prod(s)) * d.itemsize
            for s, d in zip(self._step_shapes, self._dtypes, strict=True)
        )

    @property
    def item_bytes(self) -> int:
        """Bytes of one item's data as sampled (every field, every step, whole stacks)."""
        step = self.step_bytes
        if self._frames is not None:
            frame = int(np.prod(self._frames.frame)) * self._dtypes[self._frames.field].itemsize
            step += frame * (self._frames.k - 1)
        return step * self._length

    @property
    def compression(self) -> str | None:
        """The codec of the large fields (`codecs.CODECS`); None: stored as they are."""
        return self._compression

    @property
    def step_capacity(self) -> int:
        """Steps the ring holds now (it grows as needed, see the module docstring)."""
        return self._ring_size

    @property
    def nbytes(self) -> int:
        """Bytes the storage holds: the step ring's data (compressed fields: their payloads and
        slots, `CompressedColumn.nbytes`) and its per-step metadata (0 before the first insert
        in RAM)."""
        if self._columns is None:
            return 0
        gap = 0 if self._gap is None else self._gap.nbytes
        preds = 0 if self._preds is None else self._preds.nbytes
        data = sum(
            column.nbytes
            if isinstance(column, CompressedColumn)
            else self._ring_size * int(np.prod(shape)) * dtype.itemsize
            for column, shape, dtype in zip(
                self._columns, self._step_shapes, self._dtypes, strict=True
            )
        )
        return data + gap + self._refs.nbytes + preds

    def _check_payload_room(self, payloads: Iterable[bytes], unencoded: int = 0) -> None:
        """Refuses an insert whose compressed payloads the memory cannot hold: call it under
        the table's lock before the insert changes anything (`compressed_column.PayloadBudget`,
        shared by the backend's tables).

        Args:
          payloads: The payloads encoded before the lock was taken.
          unencoded: Bytes of the payloads the insert may encode under the lock (a window's
            first stack's K-1 earlier frames, steps its writer's last window held), at their
            most (`codecs.payload_bound`) with their `SLOT_OVERHEAD`.

        Raises:
          ConfigError: Naming the bytes held, needed and available; nothing is changed.
        """
        if not self._compressed or self._columns is None:
            return
        incoming = unencoded
        for payload in payloads:
            incoming += len(payload) + SLOT_OVERHEAD
        columns = self._columns
        held = 0
        for index in self._compressed:
            held += columns[index].nbytes
        self._budget.check(held, incoming, f"table {self.name!r}", owner=self)

    def _claim(self, count: int, keep: int) -> bool:
        """Makes room for `count` new steps at the head of the ring: grows it while the
        oldest steps they would overwrite are an item's (or at serial `keep` >= 0 or later).

        At its largest size, or where its memory-mapped files cannot grow (`_grow`), the
        oldest items are evicted instead until none of them starts in the overwritten steps.

        Returns:
          False (nothing changed but the ring's size) if the steps from `keep` on cannot be
          kept. `count` steps always fit (`count` is at most the largest size).

        Raises:
          ConfigError: If `count` is more steps than the ring holds and its files cannot grow
            (the disk is full); nothing is changed.
        """
        while True:
            size = self._ring_size
            cutoff = self._written + count - size  # serials below it are overwritten
            oldest = self._oldest
            if cutoff <= oldest:
                return True
            if 0 <= keep < cutoff or count > size:  # the new steps themselves must fit
                used = True
            elif cutoff - oldest == 1:  # a collector's step
                used = bool(self._refs[(oldest + self._head - self._written) % size])
            elif cutoff - oldest <= 8:  # a few steps (an item's): no arrays
                refs, base = self._refs, self._head - self._written
                used = any(refs[(serial + base) % size] for serial in range(oldest, cutoff))
            else:
                lost = np.arange(oldest, cutoff, dtype=np.int64)
                used = bool(self._refs[self._positions(lost)].any())
            if not used:
                return True
            if size < self._max_steps and (count > size or self._written >= self._grow_after):
                needed = self._written - self._oldest + count
                if self._grow(min(self._max_steps, max(needed, size + int(size * _GROWTH) + 1))):
                    continue
            if count > size:
                raise ConfigError(
                    f"table {self.name!r}: {count} new steps need more than its {size} steps, "
                    f"and its memory-mapped files cannot grow: {self._grow_refused}. Nothing "
                    "was inserted"
                )
            if 0 <= keep < cutoff:
                return False
            # Oldest first, as the FIFO remover, until no held item starts in those steps.
            lost = self._positions(np.arange(oldest, cutoff, dtype=np.int64))
            while self.size and self._refs[lost].any():
                self._evict_oldest(1)
            return True

    def _grow(self, steps: int) -> bool:
        """Makes the ring `steps` steps long: in place inside `_reserved` (the steps written
        before the head's wrap move up by the growth, a block at a time: no second copy of
        the ring), or by moving it into a larger one, oldest step first ("memmap": into new
        files, `_spare_files`).

        Returns:
          False, the ring unchanged and a warning logged, if its memory-mapped files cannot
          grow (the disk cannot hold the larger ones): `_claim` evicts instead until the ring
          has been written round once more.
        """
        assert self._columns is not None
        assert self._shared is None, "a shared ring has its largest size"
        if self._reserved is not None and steps <= len(self._reserved[0]):
            self._grow_in_place(steps)
            return True
        files = None
        if self._memmap_dir is not None:
            try:
                files = self._spare_files(steps)
            except ConfigError as e:
                self._grow_after = self._written + self._ring_size
                self._grow_refused = str(e)
                _log.warning(
                    "table %r: its memory-mapped step ring cannot grow from %d to %d steps "
                    "(%s); it keeps its size and evicts its oldest items where a step it "
                    "overwrites still belongs to one (it holds fewer than its capacity of %d "
                    "items meanwhile), and tries to grow again after %d more steps",
                    self.name,
                    self._ring_size,
                    steps,
                    e,
                    len(self._first),
                    self._ring_size,
                )
                return False
        try:
            self._move(steps, files)
        except BaseException:
            if files is not None:
                self._drop_spare_files()
            raise
        return True

    def _move(self, steps: int, files: list[torch.Tensor] | None) -> None:
        """`_grow` into new storage of `steps` steps: `files` (the spare files of
        `_spare_files`, renamed over the ring's own once the steps are copied) or, None, new
        tensors in RAM or on the device."""
        assert self._columns is not None
        held = self._written - self._oldest
        order = self._positions(np.arange(self._oldest, self._written, dtype=np.int64))
        columns, tensors = [], []
        for index, (column, old) in enumerate(zip(self._columns, self._tensors, strict=True)):
            if isinstance(column, CompressedColumn):
                column.remap(order, steps)
                columns.append(column)
                tensors.append(old)
                continue
            if self._device is not None:
                tensor = column.new_empty((steps, *column.shape[1:]))
                tensor[:held] = column[self._index(order)]
                columns.append(tensor)
            else:
                tensor = (
                    files[index]
                    if files is not None
                    else torch.empty(
                        (steps, *column.shape[1:]), dtype=torch.from_numpy(column[:0]).dtype
                    )
                )
                grown = tensor.numpy()
                # The held steps are at most two runs of the ring: copied slice by slice.
                start = int(order[0]) if held else 0
                first = min(held, len(column) - start)
                grown[:first] = column[start : start + first]
                grown[first:held] = column[: held - first]
                columns.append(grown)
            tensors.append(tensor)
        if files is not None:
            tensors = self._swap_files(tensors, steps)
            columns = [tensor.numpy() for tensor in tensors]
        self._tensors = tensors
        if self._gap is not None:
            gap = np.ones(steps, dtype=np.int32)
            gap[:held] = self._gap[order]
            self._gap = gap
        refs = np.zeros(steps, dtype=self._refs.dtype)
        refs[:held] = self._refs[order]
        if self._preds is not None:
            preds = np.full((steps, self._preds.shape[1]), -1, dtype=np.int64)
            preds[:held] = self._preds[order]
            self._preds = preds
        self._columns, self._refs = columns, refs
        self._reserved = None
        self._ring_size = steps
        self._head = held % steps

    def _map_files(self, paths: Sequence[str], steps: int) -> list[torch.Tensor]:
        """Creates the files `paths` (one per field, none existing) for `steps` steps, their
        whole size reserved on disk first (`scratch.reserve_files`), and maps them.

        Raises:
          ConfigError: If the disk cannot hold them; none of them is left then.
        """
        from tensordict import MemoryMappedTensor

        shapes = list(zip(self._step_shapes, self._dtypes, strict=True))
        reserve_files(
            [
                (path, steps * int(np.prod(shape)) * dtype.itemsize)
                for path, (shape, dtype) in zip(paths, shapes, strict=True)
            ],
            f"the memory-mapped storage of table {self.name!r} ({steps} steps of "
            f"{self.step_bytes} bytes)",
            self.fields,
        )
        try:
            return [
                MemoryMappedTensor.empty(
                    (steps, *shape),
                    dtype=torch.from_numpy(np.zeros(0, dtype)).dtype,
                    filename=path,
                    existsok=True,  # reserved above
                )
                for path, (shape, dtype) in zip(paths, shapes, strict=True)
            ]
        except BaseException:
            remove_files(paths)
            raise

    def _spare_files(self, steps: int) -> list[torch.Tensor]:
        """New files for the memory-mapped ring at `steps` steps (`scratch.spare_file`),
        mapped, their space reserved: `_swap_files` makes them the ring's own.

        Raises:
          ConfigError: If the disk cannot hold them, or a file of that name exists (this
            process created none: it is kept); none of them is left then.
        """
        assert self._memmap_dir is not None
        paths = [spare_file(self._memmap_dir, i) for i in range(len(self._step_shapes))]
        return self._map_files(paths, steps)

    def _swap_files(self, tensors: list[torch.Tensor], steps: int) -> list[torch.Tensor]:
        """Renames the spare files of `tensors` (`_spare_files`, written) over the ring's
        own, whose blocks are freed once their mappings are dropped, and maps them again under
        their new names (which workers in other processes open). Returns the new mappings."""
        from tensordict import MemoryMappedTensor

        assert self._memmap_dir is not None
        mapped = []
        for index, tensor in enumerate(tensors):
            path = scratch_file(self._memmap_dir, index)
            os.replace(spare_file(self._memmap_dir, index), path)
            mapped.append(
                MemoryMappedTensor.from_filename(path, tensor.dtype, (steps, *tensor.shape[1:]))
            )
        return mapped

    def _drop_spare_files(self) -> None:
        """Deletes the spare files of `_spare_files` that are still there (a failed move)."""
        if self._memmap_dir is not None:
            remove_files([spare_file(self._memmap_dir, i) for i in range(len(self._step_shapes))])

    def _grow_in_place(self, steps: int) -> None:
        """`_grow` inside `_reserved`: positions `[head, size)` that hold steps still in the
        ring (written before the head wrapped) move up by `steps - size`, in blocks that do not
        overlap, so every step keeps `_positions`' formula with the new size."""
        assert self._reserved is not None
        size, head = self._ring_size, self._head
        shift = steps - size
        wrapped = self._written - self._oldest - head  # steps in [size - wrapped, size)
        start = size - wrapped if wrapped > 0 else size

        def move(array: np.ndarray) -> None:
            end = size
            while end > start:
                begin = max(start, end - shift)
                array[begin + shift : end + shift] = array[begin:end]
                end = begin

        for reserved in self._reserved:
            move(reserved)
        self._columns = [r[:steps] for r in self._reserved]
        self._tensors = [torch.from_numpy(c) for c in self._columns]

        def extend(array: np.ndarray, fill: int) -> np.ndarray:
            grown = np.full((steps, *array.shape[1:]), fill, dtype=array.dtype)
            grown[:size] = array
            move(grown)
            return grown

        if self._gap is not None:
            self._gap = extend(self._gap, 1)
        self._refs = extend(self._refs, 0)
        self._refs[start : min(start + shift, size)] = 0  # moved up: free now
        if self._preds is not None:
            self._preds = extend(self._preds, -1)
        self._ring_size = steps

    def _gaps(self) -> np.ndarray:
        """`_gap`, made when a writer's steps first interleave with another's."""
        if self._gap is None:
            self._gap = np.ones(self._ring_size, dtype=np.int32)
        return self._gap

    def _anchors(self, first: np.ndarray) -> np.ndarray:
        """The oldest serial each item of first step serials `first` needs: its first step's
        oldest earlier frame (stacked observations) or the step itself. The item's count in
        `_refs` is there, so `_claim` keeps its frames."""
        if self._frames is None or self._preds is None:
            return first
        serials = self._preds[self._positions(np.asarray(first, dtype=np.int64))]
        return np.minimum(np.where(serials < 0, first[..., None], serials).min(axis=-1), first)

    def _anchor(self, first: int) -> int:
        """`_anchors` of one item (the writers' path: no arrays)."""
        assert self._preds is not None
        row = self._preds[(first - self._written + self._head) % self._ring_size].tolist()
        oldest = min(row)
        if oldest >= 0:  # no zero frame: the common case
            return oldest
        return min([s for s in row if s >= 0], default=first)

    def _allocate(self) -> None:
        """The step ring: one tensor per field, `[ring size, *field_shape]`, as numpy views.

        RAM: `torch.empty` (pages are committed as steps are written; `share_memory` makes
        its own ring in shared memory). "memmap": tensordict's `MemoryMappedTensor` files
        under `scratch_dir` (shared mappings; `share_memory` moves the ring into files of its
        own), so the buffer can exceed RAM, their whole size reserved on disk first
        (`_map_files`).

        Raises:
          ConfigError: If the disk of `scratch_dir` cannot hold the memory-mapped files.
          CheckpointError: If `scratch_dir` cannot be used (`scratch.prepare_scratch_dir`).
        """
        steps = self._ring_size
        files = None
        if self._storage_kind == "memmap":
            if self._scratch_dir is None:
                directory = tempfile.mkdtemp(prefix="replay_memmap_")
            else:
                directory = self._scratch_dir
                prepare_scratch_dir(directory)
            self._memmap_dir = directory
            paths = [scratch_file(directory, i) for i in range(len(self._step_shapes))]
            files = self._map_files(paths, steps)
        columns, tensors = [], []
        reserved = None
        if files is None and self._device is None and not self._compressed:
            reserved = self._reserve()
        for index, (shape, dtype) in enumerate(zip(self._step_shapes, self._dtypes, strict=True)):
            torch_dtype = torch.from_numpy(np.zeros(0, dtype)).dtype
            if index in self._compressed:
                assert self._codec is not None
                columns.append(CompressedColumn(steps, shape, dtype, self._codec))
                tensors.append(torch.empty((0, *shape), dtype=torch_dtype))  # nothing shared
                continue
            if reserved is not None:
                tensor = torch.from_numpy(reserved[index][:steps])
            elif files is not None:
                tensor = files[index]
            else:
                tensor = torch.empty((steps, *shape), dtype=torch_dtype, device=self._device)
            columns.append(tensor if self._device is not None else tensor.numpy())
            tensors.append(tensor)
        self._columns = columns
        self._tensors = tensors
        self._reserved = reserved
        self._gap = None
        self._refs = np.zeros(steps, dtype=np.uint8)
        if self._frames is not None:
            self._preds = np.full((steps, self._frames.k - 1), -1, dtype=np.int64)

    def _reserve(self) -> list[np.ndarray] | None:
        """Per field an array of the ring's largest size in anonymous memory whose pages are
        committed only when written (`MAP_NORESERVE`), so the ring grows inside it without a
        copy (`_grow_in_place`); None where the address space cannot be had (the ring is
        then allocated at its size, and copied when it grows)."""
        rows = self._max_steps
        if rows <= self._ring_size:
            return None
        arrays = []
        for shape, dtype in zip(self._step_shapes, self._dtypes, strict=True):
            size = rows * int(np.prod(shape)) * dtype.itemsize
            try:
                memory = mmap.mmap(
                    -1,
                    max(size, 1),
                    flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE,
                )
            except (OSError, ValueError, OverflowError):
                return None
            _advise_huge_pages(memory)
            arrays.append(
                np.frombuffer(memory, dtype=dtype, count=rows * int(np.prod(shape))).reshape(
                    rows, *shape
                )
            )
        return arrays


def _advise_huge_pages(memory: mmap.mmap) -> None:
    """Asks Linux to back `memory` with transparent huge pages where it allows them on request
    (`madvise`, as numpy does for its large arrays): a sample reads steps at random places of
    the ring, and with 4 KiB pages nearly every read of a large ring also misses the TLB (a
    gather of 4096 CartPole steps from a ring of 1M: about 3 times slower). Pages are still
    committed as written, 2 MiB at a time. Does nothing where `madvise` is not available."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or not hasattr(memory, "madvise"):
        return
    with contextlib.suppress(OSError):  # a kernel without transparent huge pages
        memory.madvise(advice)

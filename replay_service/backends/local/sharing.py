"""Moving a local table into shared memory for DataLoader worker processes: `share_memory`.

The owner's side of `shared.SharedTable`: `share_memory()` gives the step ring its largest
size in shared memory ("memmap": in new files, their space reserved on disk first) and copies
the held items into it, one whole window each, then moves the per-item metadata that readers
need there too. Everything is allocated before anything of the
table changes: a table that does not fit (a small /dev/shm, as Docker's 64 MB default) is
refused with the bytes it needs and those free, and stays as it was, writable, sampled and
checkpointed in its process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch

from replay_service.backends.local.ring import StepRing
from replay_service.backends.local.scratch import free_bytes
from replay_service.backends.local.shared import SharedTable
from replay_service.backends.local.slots import RingSlots, Slots
from replay_service.config.options import TableConfig
from replay_service.errors import ConfigError

# The per-slot arrays (and the cell of counters) a `SharedTable` reads, moved to shared memory.
SHARED_FIELDS = ("_first", "_priority", "_times_sampled", "_cell")
# Where torch places shared memory (POSIX shared memory, a tmpfs: Docker gives it 64 MB).
SHM_DIR = "/dev/shm"


class Shareable(StepRing):
    """`share_memory` of a `LocalTable`, a base class of it (see the module docstring).

    It swaps the table's step ring (its base class `ring.StepRing`) for one in shared memory,
    and the arrays of `SHARED_FIELDS` for shared copies; the table's lock is held meanwhile.
    """

    # What the table provides (besides its step ring).
    config: TableConfig
    _changed: threading.Condition
    _slots: Slots
    _seed: np.random.SeedSequence | None
    _cell: np.ndarray
    _priority: np.ndarray | None
    _flat_priority: float
    _times_sampled: np.ndarray
    _require_open: Callable[[], None]

    def share_memory(self) -> SharedTable:
        """Moves the table into shared memory for readers in other processes (DataLoader
        workers, forked or spawned) and returns what they read it through.

        Once shared, the step ring has its largest size, `capacity * sequence_length` steps
        (every window written whole, so `capacity` items always fit), in shared memory
        (`Tensor.share_memory_`; "memmap": new files, which are shared mappings, renamed over
        the ring's own, `ring.StepRing._spare_files`); the items held are copied into it,
        keys, priorities and order unchanged.
        The per-item metadata that readers need (first step, priority, times sampled) and
        the cell of counters (size, closed, the insertion numbers of the oldest held and of the
        next item, which give the held slots and keys) move to shared memory too. Writes stay
        in this process; a `SharedTable` reads without the lock (see its docstring). Calling
        it again returns the same object.

        Returns:
          The table's `SharedTable` (picklable: spawned workers receive it).

        Raises:
          ConfigError: If the table's sampling changes the table when sampled or needs state
            of this process: a sampler other than "uniform", or `max_times_sampled`; or if
            shared memory cannot hold the table (the message names the bytes needed and those
            free in /dev/shm), or, "memmap", the disk cannot hold the ring's new files. Nothing
            is changed then: the table stays as it was, writable, sampled and checkpointed in
            this process.
          ManagerClosedError: If the table was closed.
        """
        sampling = self.config.sampling
        if self.config.frame_stack is not None:
            raise ConfigError(
                f"table {self.name!r} stores each frame once (frame_stack="
                f"{self.config.frame_stack!r}): DataLoader worker processes cannot rebuild its "
                "stacks yet; sample it in this process (num_workers=0, torch_batches)"
            )
        if self._compression is not None:
            raise ConfigError(
                f"table {self.name!r} stores its large fields compressed (compression="
                f"{self._compression!r}): DataLoader worker processes cannot decode them from "
                "shared memory yet; sample it in this process (num_workers=0, torch_batches)"
            )
        if self._device is not None and self._device.type != "cpu":
            raise ConfigError(
                f"table {self.name!r} lives on device {str(self._device)!r}: DataLoader worker "
                "processes cannot sample it; sample it in this process (num_workers=0, "
                "torch_batches), which needs no workers, or keep it on the CPU"
            )
        if sampling.sampler != "uniform" or sampling.max_times_sampled:
            raise ConfigError(
                f"table {self.name!r}: DataLoader worker processes sample a local table "
                "read-only with the uniform sampler; its sampler="
                f"{sampling.sampler!r}, max_times_sampled={sampling.max_times_sampled!r} "
                "select or remove items in this process: use num_workers=0 (a local table is "
                "sampled in microseconds in-process) or backend='reverb'"
            )
        with self._changed:
            self._require_open()
            if self._shared is not None:
                return self._shared
            # Everything is allocated first, then swapped in: a failure (too little shared
            # memory) leaves the table exactly as it was, still writable and checkpointable.
            ring = self._new_shared_ring()
            try:
                tensors = self._new_shared_metadata(ring)
            except BaseException:
                self._drop_spare_files()
                raise
            self._install_shared_ring(ring)
            for name, tensor in tensors.items():
                unsigned = (
                    getattr(self, name) is not None and getattr(self, name).dtype == np.uint64
                )
                view = tensor.numpy()
                setattr(self, name, view.view(np.uint64) if unsigned else view)
            assert isinstance(self._slots, RingSlots)  # uniform, no `max_times_sampled`
            self._shared = SharedTable(
                name=self.name,
                capacity=self.config.capacity,
                length=self._length,
                ring_size=self._ring_size,
                min_size=self.config.sampling.min_size_to_sample,
                columns=list(self._tensors),
                metadata=tensors,
                seed=self._seed,
                key_stride=self._slots.stride,
                key_offset=self._slots.offset,
            )
            return self._shared

    def _shared_bytes(self) -> int:
        """Bytes `share_memory` places in shared memory: the RAM ring at its largest size
        ("memmap": in files on disk instead) and the per-slot metadata."""
        capacity = self.config.capacity
        ring = capacity * self._length * self.step_bytes if self._storage_kind == "memory" else 0
        per_slot = sum(
            np.dtype(d).itemsize for d in (np.int64, np.float64, self._times_sampled.dtype)
        )
        return ring + capacity * per_slot + self._cell.nbytes

    def _share_failure(self, cause: BaseException | None) -> ConfigError:
        """The error of a table that does not fit in shared memory: the bytes it needs, those
        free in `SHM_DIR`, and the ways out."""
        needed = self._shared_bytes()
        free = free_bytes(SHM_DIR)
        where = f"{SHM_DIR} has {'an unknown number of' if free is None else free} bytes free"
        reason = "" if cause is None else f" ({cause})"
        return ConfigError(
            f"table {self.name!r} cannot move into shared memory for DataLoader worker "
            f"processes: it needs {needed} bytes ({self.config.capacity} items of "
            f"{self._length} steps of {self.step_bytes} bytes, and per-item metadata), "
            f"{where}{reason}. The table is unchanged. Use num_workers=0 (a local table is "
            "sampled in-process in microseconds), lower the capacity, or give the machine "
            "more shared memory (docker run --shm-size=..., a larger /dev/shm)"
        )

    def _new_shared_ring(self) -> tuple[list[torch.Tensor], np.ndarray, np.ndarray, int]:
        """The ring at its largest size in shared memory ("memmap": in spare files, which
        `_install_shared_ring` renames over the ring's own), the held items copied into it
        oldest first, one whole window each; nothing of the table changes (the lock held).

        Returns:
          The ring's tensors, its `_refs`, the held slots (oldest first) and their steps.

        Raises:
          ConfigError: If shared memory cannot hold the ring (`_share_failure`), or the disk
            its files ("memmap", `ring.StepRing._spare_files`); none of them is left then.
        """
        length = self._length
        steps = self.config.capacity * length
        needed, free = self._shared_bytes(), free_bytes(SHM_DIR)
        if free is not None and needed > free:
            raise self._share_failure(None)
        held = self._slots.ordered()
        count = len(held) * length
        if self._storage_kind == "memmap":
            tensors = self._spare_files(steps)
            try:
                self._copy_windows(tensors, held, count)
            except BaseException:
                self._drop_spare_files()
                raise
            refs = np.zeros(steps, dtype=np.uint8)
            refs[np.arange(len(held), dtype=np.int64) * length] = 1
            return tensors, refs, held, count
        try:
            tensors = [
                torch.empty(
                    (steps, *shape), dtype=torch.from_numpy(np.zeros(0, dtype)).dtype
                ).share_memory_()
                for shape, dtype in zip(self._step_shapes, self._dtypes, strict=True)
            ]
            refs = np.zeros(steps, dtype=np.uint8)
        except (RuntimeError, MemoryError) as e:
            raise self._share_failure(e) from e
        self._copy_windows(tensors, held, count)
        refs[np.arange(len(held), dtype=np.int64) * length] = 1
        return tensors, refs, held, count

    def _copy_windows(self, tensors: list[torch.Tensor], held: np.ndarray, count: int) -> None:
        """Copies the windows of the items of slots `held` into the first `count` steps of
        `tensors`, one whole window each, oldest first."""
        if self._columns is None or not count:
            return
        positions = self._window_positions(held).reshape(count)
        for tensor, column in zip(tensors, self._columns, strict=True):
            if self._device is not None:
                tensor[:count] = column[self._index(positions)]
            else:
                # mode="clip": written straight into `tensor`, not through a whole copy.
                np.take(column, positions, axis=0, out=tensor.numpy()[:count], mode="clip")

    def _new_shared_metadata(
        self, ring: tuple[list[torch.Tensor], np.ndarray, np.ndarray, int] | None
    ) -> dict[str, torch.Tensor]:
        """Copies in shared memory of the per-slot arrays readers need (`SHARED_FIELDS`), as
        they are once `ring` is installed; nothing of the table changes.

        Raises:
          ConfigError: If shared memory cannot hold them (`_share_failure`).
        """
        arrays = {name: getattr(self, name) for name in SHARED_FIELDS}
        if arrays["_priority"] is None:  # readers read priorities per slot
            arrays["_priority"] = np.full(self.config.capacity, self._flat_priority)
        if ring is not None:
            _, _, held, _ = ring
            first = arrays["_first"].copy()
            first[held] = np.arange(len(held), dtype=np.int64) * self._length
            arrays["_first"] = first
        tensors = {}
        try:
            for name, array in arrays.items():
                signed = array.view(np.int64) if array.dtype == np.uint64 else array
                tensors[name] = torch.from_numpy(signed.copy()).share_memory_()
        except (RuntimeError, MemoryError) as e:
            raise self._share_failure(e) from e
        return tensors

    def _install_shared_ring(
        self, ring: tuple[list[torch.Tensor], np.ndarray, np.ndarray, int]
    ) -> None:
        """Swaps in the ring of `_new_shared_ring` (nothing here can fail)."""
        tensors, refs, _, count = ring
        steps = len(refs)
        if self._storage_kind == "memmap":
            tensors = self._swap_files(tensors, steps)
        self._shares = False  # the shared ring never grows: each window is written whole
        self._ring_size = self._max_steps = steps
        self._tensors = tensors
        self._columns = tensors if self._device is not None else [t.numpy() for t in tensors]
        self._gap = None
        self._refs = refs
        self._consecutive = None
        self._scattered = 0
        self._head = count % steps
        self._written = count
        self._oldest = 0

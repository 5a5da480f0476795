"""`LocalTable`: one table of the in-process backend.

A table holds up to `capacity` items, each a window of `sequence_length` steps over a ring of
steps, as Reverb's chunks and TorchRL's slice sampler keep them: every field of the stored
spec is one tensor `[step_capacity, *field_shape]` in which each step is stored once, however
many items it belongs to, and an item is the serial number of its first step plus, where the
writers of a table interleave their steps, the distance from each step to its writer's next one
(`gap`, per step, made when writers first interleave). Per-item and per-step metadata are numpy
arrays: no Python object per item. Per item slot a table keeps its first step's serial and its
sample count (12 bytes), its priority only once the items' priorities differ, and which slots
are held, in which order and under which keys through `slots.Slots` (nothing per item where
items leave oldest first; see `slots.slots_for`).

Steps are written as the items that hold them are inserted: a collector's writer
(`WindowStream`, one per writer and table) writes only the steps its previous item did not
hold (one per item at stride 1), `insert` of whole windows (an import, a restore) writes every
step of each item except those it shares with the item before it (the previous window shifted
by one step, compared byte for byte). A writer shares steps only with its last item while that
item is held, so no item holds steps older than every held item's. The ring starts at
`capacity + sequence_length - 1` steps, what one writer's overlapping windows need, and grows
(the storage is copied in step order, by an eighth of its size or more) whenever the step it would
overwrite next still belongs to an item, so `capacity` items fit whatever the writers, strides
and padding. Its storage is in RAM (`torch.empty`, committed as it fills), growing up to
`capacity * sequence_length**2` steps, or, with "memmap", tensordict `MemoryMappedTensor` files
(for buffers larger than RAM) created with the table for `capacity * sequence_length` steps
(`capacity` windows that share nothing), their whole size reserved on disk then (a full disk
is a `ConfigError` there, never a SIGBUS at a later write); its writers do not share steps
between windows (each window is written whole into a ring of `capacity` windows, so
`capacity` items fit there too). Should a ring at its largest size still be short, it evicts
the oldest items until none holds a step it overwrites. Samples gather the steps of the drawn
items with one `np.take` per field.

Items are evicted oldest first once the table is full (Reverb's FIFO remover) and removed after
`max_times_sampled` samples when set.

Samplers (as Reverb's selectors of the same name):
- "uniform": every item equally likely;
- "prioritized": probability proportional to `priority ** priority_exponent`, kept in a sum
  tree (`sum_tree.SumTree`, numpy);
- "fifo": the oldest item, every time (a queue with `max_times_sampled=1`).
The sampler draws from a `np.random.Generator` of its own, seeded by `seed` (the manager's
`seed=`): the same seed and the same inserts give the same samples.

Why not TorchRL's replay buffer parts, with torchrl 0.14.1 and the pinned torch 2.13: its
`PrioritizedSampler` needs TorchRL's C++ extension, which does not load with that torch
(undefined symbol, on Python 3.11 and 3.12 alike), and its storages build a `TensorDict` per
`set`/`get` (about 100 us per insert here, 5x slower sampling than indexing the tensors).

Sampling waits until the table holds `min_size_to_sample` items, at most `timeout` seconds.
Every item has a key that is unique for the life of the table (`update_priorities` takes it).
The table is thread-safe: one lock guards it, so a sampling thread and a collecting thread can
share it. `share_memory()` moves it into shared memory for DataLoader worker processes, which
read it without the lock (`shared.SharedTable`). With `device=` the step ring is torch tensors
on that device (written step by step from the host, gathered there by index).
"""

from __future__ import annotations

import contextlib
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

from replay_service.backends.local.shared import SharedTable
from replay_service.backends.local.slots import RingSlots, slots_for
from replay_service.backends.local.sum_tree import SumTree
from replay_service.config.options import TableConfig
from replay_service.errors import (
    BufferStateError,
    CheckpointError,
    ConfigError,
    ManagerClosedError,
    SpecMismatchError,
)
from replay_service.specs import sizes
from replay_service.storage.file_modes import DIR_MODE, make_dirs

LOCAL_SAMPLERS = ("uniform", "prioritized", "fifo")
LOCAL_REMOVERS = ("fifo",)
STORAGES = ("memory", "memmap")
# The files of a table's memory-mapped storage (`_allocate`): the only ones it ever deletes.
_SCRATCH_FILE = re.compile(r"field[0-9]+\.memmap")
# A growing step ring takes at least this fraction of its size more (a growth copies the ring).
_GROWTH = 0.125

# The per-slot arrays (and the cell of counters) a `SharedTable` reads, moved to shared memory.
_SHARED_FIELDS = ("_first", "_priority", "_times_sampled", "_cell")
# `_cell`: items held, closed, insertion numbers of the oldest held and of the next item.
_SIZE, _CLOSED, _OLDEST, _NEXT = range(4)


def check_device(device: str | torch.device) -> torch.device:
    """The torch device a local table's storage may live on: the CPU or an available CUDA
    device.

    Args:
      device: "cpu", "cuda", "cuda:1", a `torch.device`.

    Returns:
      The `torch.device` ("cuda" without an index: the current CUDA device).

    Raises:
      ConfigError: If `device` is not a torch device, is another kind (e.g. "meta", which
        holds no data), or is a CUDA device that is not available.
    """
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ConfigError(
            f"device must be a torch device such as 'cpu' or 'cuda:0', got {device!r}"
        ) from e
    if target.type not in ("cpu", "cuda"):
        raise ConfigError(
            f"device={device!r}: a local table's storage lives on 'cpu' or a CUDA device "
            f"('cuda', 'cuda:0'), not on {target.type!r}"
        )
    if target.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device={device!r} was asked for, but CUDA is not available here; use "
                "device='cpu' or leave device unset"
            )
        if target.index is not None and target.index >= torch.cuda.device_count():
            raise ConfigError(
                f"device={device!r}: this machine has {torch.cuda.device_count()} CUDA devices"
            )
        if target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
    return target


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


class WindowStream:
    """What a table remembers of one writer's steps: the serial numbers of the last
    `sequence_length` steps it wrote, which its next overlapping window shares.

    Attributes:
      serials: Serial numbers in the table's step ring, oldest first.
    """

    __slots__ = ("key", "serials")

    def __init__(self) -> None:
        self.serials: list[int] = []
        self.key = 0  # the key of the writer's last item, 0: none

    def reset(self) -> None:
        """The writer's next window shares no step with its last one (a new episode)."""
        self.serials = []
        self.key = 0


class LocalTable:
    """One table of the local backend (see module docstring).

    Args:
      config: The table's name, capacity, sequence length and sampling.
      fields: `specs.describe_spec(stored_spec)`: path, dtype and per-step shape of each field.
      storage: "memory" or "memmap" (memory-mapped files under `scratch_dir`).
      scratch_dir: Directory of the memory-mapped files ("memmap"); None: a temporary one.
      seed: Seed of the sampler's `np.random.Generator`; None draws one.
      device: Where the step ring lives (`check_device`): torch tensors on that device,
        written from host steps and gathered there, so samples come back on it; None: host
        memory through numpy views (the default, fastest on the CPU).

    Raises:
      ConfigError: If the sampling is Reverb-only (`check_local_table`), `storage` unknown,
        or `device` not usable (`check_device`) or given with "memmap" (host files).
    """

    def __init__(
        self,
        config: TableConfig,
        fields: Sequence[dict[str, Any]],
        *,
        storage: str = "memory",
        scratch_dir: str | None = None,
        seed: int | np.random.SeedSequence | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        check_local_table(config)
        if storage not in STORAGES:
            raise ConfigError(f"storage must be one of {STORAGES}, got {storage!r}")
        self._device = None if device is None else check_device(device)
        if self._device is not None and storage != "memory":
            raise ConfigError(
                f"device={device!r} needs storage='memory': storage={storage!r} keeps the "
                "table in host files"
            )
        self.config = config
        self.fields = [dict(f) for f in fields]
        length = config.sequence_length
        capacity = config.capacity
        self._length = length
        self._step_shapes = [tuple(int(d) for d in f["shape"]) for f in self.fields]
        self._shapes = [(length, *s) for s in self._step_shapes]
        self._dtypes = [np.dtype(f["dtype"]) for f in self.fields]
        self._storage_kind = storage
        self._scratch_dir = scratch_dir
        # The step ring: one array per field, `[ring size, *field_shape]` (`_allocate`), and per
        # step the distance to its writer's next step (`_gap`) and the number of items it is
        # the first step of (`_refs`). Steps have serial numbers: the one at ring position `p`
        # is `p - _head + _written` (mod the ring size); `[_oldest, _written)` are in the ring.
        self._ring_size = ring_steps(capacity, length, storage)
        self._max_steps = capacity * length * length
        # Files cannot grow: reserved once, for `capacity` windows that share no step.
        self._shares = storage == "memory"
        if storage == "memmap":
            self._max_steps = self._ring_size
        # numpy views of `_tensors`, or with a `device` the tensors themselves.
        self._columns: list[Any] | None = None
        self._tensors: list[torch.Tensor] = []
        # `_gap` exists once a writer's steps interleave with another's (None: every gap 1);
        # `_refs` is uint8 until a step is the first of 255 items.
        self._gap: np.ndarray | None = None
        self._refs = np.zeros(0, dtype=np.uint8)
        self._head = 0
        self._written = 0
        self._oldest = 0
        self._offsets = np.arange(length, dtype=np.int64)
        # Per item slot: its first step's serial and samples; its priority once items differ
        # (before: `_flat_priority`, every item's); whether its steps are consecutive serials
        # once an item's are not. Which slots are held, their order and keys: `_slots`.
        self._first = np.zeros(capacity, dtype=np.int64)
        self._times_sampled = np.zeros(capacity, dtype=np.int32)
        self._priority: np.ndarray | None = None
        self._flat_priority = 1.0
        self._consecutive: np.ndarray | None = None
        self._scattered = 0  # held items whose steps are not consecutive
        self._slots = slots_for(config)
        self._tree = SumTree(capacity) if config.sampling.sampler == "prioritized" else None
        self._exponent = config.sampling.priority_exponent
        self._rng = np.random.default_rng(seed)
        self._seed = (
            seed
            if seed is None or isinstance(seed, np.random.SeedSequence)
            else np.random.SeedSequence(seed)
        )
        # What readers in other processes check (`SharedTable`), see `_publish`.
        self._cell = np.zeros(4, dtype=np.int64)
        self._shared: SharedTable | None = None
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
            self._allocate()

    # ------------------------------------------------------------------------------ state

    @property
    def name(self) -> str:
        """The table name."""
        return self.config.name

    @property
    def size(self) -> int:
        """Items held."""
        return self._slots.size

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

    def close(self) -> None:
        """Wakes and fails every waiting sampler; the items stay readable for a checkpoint."""
        with self._changed:
            self._closed = True
            self._cell[_CLOSED] = 1
            self._changed.notify_all()

    # ---------------------------------------------------------------------------- writing

    def stream(self) -> WindowStream:
        """A new writer's memory of its steps, for `insert_window`."""
        return WindowStream()

    def insert(self, data: Sequence[np.ndarray], priorities: np.ndarray) -> np.ndarray:
        """Inserts items, evicting the oldest ones when the table is full.

        A window that is the one before it shifted by one step stores only its last step.

        Args:
          data: One array per field, `[n, sequence_length, *field_shape]`, the field's dtype.
          priorities: `[n]` finite priorities >= 0.

        Returns:
          The new items' keys, `uint64 [n]`.

        Raises:
          SpecMismatchError: If a field's shape or dtype differs from the table's.
        """
        return self._insert_windows(data, priorities)[0]

    def insert_window(
        self,
        steps: Sequence[Sequence[np.ndarray]],
        priority: float,
        stream: WindowStream | None = None,
        fresh: int | None = None,
    ) -> int:
        """Inserts one item from its steps (each the list of its fields, already converted to
        the table's dtypes and per-step shapes), evicting the oldest item if the table is full.

        This is the collectors' path: only the steps the writer's previous item did not hold
        are copied into the step ring, each field once, with no intermediate stacking.

        Args:
          steps: `sequence_length` steps, oldest first.
          priority: The item's priority (finite, >= 0).
          stream: The writer's `stream()`; None: the window shares no step with earlier ones.
          fresh: How many of the last steps of `steps` the writer appended since its previous
            item in this table (the others are that item's last steps); None: all of them.

        Returns:
          The new item's key.
        """
        length = self._length
        with self._changed:
            if self._closed:
                self._require_open()
            if self._columns is None:
                self._allocate()
            if self.size >= self.config.capacity:
                self._evict_oldest(self.size + 1 - self.config.capacity)
            new = length
            keep = -1
            serials: list[int] = []
            if self._shares and stream is not None and fresh is not None and 0 < fresh < length:
                serials = stream.serials
                # Shared steps only while the writer's last item is held: an item never holds
                # steps older than every held item's (the ring's size stays bounded).
                if (
                    len(serials) >= length - fresh
                    and serials[fresh - length] >= self._oldest
                    and self._slots.holds(stream.key)
                ):
                    new = fresh
                    keep = serials[fresh - length]
            if not self._claim(new, keep):
                new, keep = length, -1
                self._claim(new, -1)
            size = self._ring_size
            head = self._head
            written = self._written
            columns = self._columns
            assert columns is not None
            gap = self._gap
            position = head
            on_device = self._device is not None
            for step in steps[length - new :]:
                for column, value in zip(columns, step):  # noqa: B905 (checked by the writer)
                    column[position] = torch.as_tensor(value) if on_device else value
                if gap is not None:
                    gap[position] = 1
                position += 1
                if position == size:
                    position = 0
            end = written + new
            self._head = position
            self._written = end
            if end - size > self._oldest:
                self._oldest = end - size
            if keep >= 0:
                last = serials[-1]
                if written - last != 1:
                    self._gaps()[(last - written + head) % size] = written - last
                first = keep
                if stream is not None:
                    serials = serials[fresh - length :]
                    serials.extend(range(written, end))
                    stream.serials = serials
            else:
                first = written
                if stream is not None:
                    stream.serials = list(range(written, end))
            refs = self._refs
            at = (first - written + head) % size
            refs[at] += 1
            if refs[at] >= 255 and refs.dtype == np.uint8:
                self._refs = refs.astype(np.int32)
            slot, key = self._slots.allocate_one()
            self._first[slot] = first
            consecutive = first + length == end
            if not consecutive:
                self._consecutives()[slot] = False
                self._scattered += 1
            elif self._consecutive is not None:
                self._consecutive[slot] = True
            self._times_sampled[slot] = 0
            if self._priority is not None and self._tree is None:
                self._priority[slot] = priority
            elif priority != self._flat_priority or self._tree is not None:
                self._set_priorities(np.array([slot]), np.array([priority]))
            if stream is not None:
                stream.key = key
            self._publish()  # held: its steps and first serial are written
            self.inserts += 1
            self._changed.notify()
        return key

    def update_priorities(self, updates: dict[int, float]) -> int:
        """Sets the priorities of items by key; keys no longer held are ignored.

        Returns:
          How many items were updated.
        """
        pairs = [(int(k), p) for k, p in updates.items() if 1 <= int(k) < 1 << 64]
        if not pairs:
            return 0
        keys = np.array([k for k, _ in pairs], dtype=np.uint64)
        values = np.array([p for _, p in pairs], dtype=np.float64)
        with self._changed:
            slots, held = self._slots.find(keys)
            if held.any():
                self._set_priorities(slots[held], values[held])
            return int(held.sum())

    def reset(self) -> None:
        """Removes every item (keys are not reused) and counts the reset in `resets`."""
        with self._changed:
            self.resets += 1
            self.deletes += self.size
            self._clear_items()

    # ---------------------------------------------------------------- worker processes

    def share_memory(self) -> SharedTable:
        """Moves the table into shared memory for readers in other processes (DataLoader
        workers, forked or spawned) and returns what they read it through.

        Once shared, the step ring has its largest size, `capacity * sequence_length` steps
        (the memory-mapped layout: every window written whole, so `capacity` items always
        fit), in shared memory (`Tensor.share_memory_`; "memmap" files are shared mappings
        already); the items held are copied into it, keys, priorities and order unchanged.
        The per-item metadata that readers need (first step, priority, times sampled) and
        the cell of counters (size, closed, the insertion numbers of the oldest held and of the
        next item, which give the held slots and keys) move to shared memory too. Writes stay
        in this process; a `SharedTable` reads without the lock (see its docstring). Calling
        it again returns the same object.

        Returns:
          The table's `SharedTable` (picklable: spawned workers receive it).

        Raises:
          ConfigError: If the table's sampling changes the table when sampled or needs state
            of this process: a sampler other than "uniform", or `max_times_sampled`.
          ManagerClosedError: If the table was closed.
        """
        sampling = self.config.sampling
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
            if self._storage_kind == "memory":
                self._share_ring()
            self._priorities_by_slot()  # readers read them per slot
            tensors = {}
            for name in _SHARED_FIELDS:
                array = getattr(self, name)
                signed = array.view(np.int64) if array.dtype == np.uint64 else array
                tensor = torch.from_numpy(signed.copy()).share_memory_()
                view = tensor.numpy()
                setattr(self, name, view.view(np.uint64) if array.dtype == np.uint64 else view)
                tensors[name] = tensor
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
            )
            return self._shared

    def _share_ring(self) -> None:
        """The RAM ring at its largest size in shared memory, the held items copied into it
        oldest first, one whole window each (the lock held)."""
        length = self._length
        steps = self.config.capacity * length
        held = self._slots.ordered()
        windows = self._read_slots(held) if self._columns is not None and len(held) else None
        self._shares = False  # the shared ring never grows: each window is written whole
        self._ring_size = self._max_steps = steps
        self._allocate(shared=True)
        count = len(held) * length
        if windows is not None:
            for tensor, window, shape in zip(
                self._tensors, windows, self._step_shapes, strict=True
            ):
                tensor[:count] = window.reshape(count, *shape)
        firsts = np.arange(len(held), dtype=np.int64) * length
        self._refs[firsts] = 1
        self._first[held] = firsts
        self._consecutive = None
        self._scattered = 0
        self._head = count % steps
        self._written = count
        self._oldest = 0

    # --------------------------------------------------------------------------- sampling

    def sample(
        self,
        batch_size: int,
        timeout: float | None,
        *,
        with_info: bool = True,
        steps: Sequence[tuple[int, int]] | None = None,
    ) -> tuple[list[torch.Tensor], dict[str, np.ndarray]]:
        """Samples `batch_size` items with the table's sampler.

        Args:
          batch_size: Items to sample.
          timeout: Seconds to wait for `min_size_to_sample` items; None waits forever.
          with_info: Whether to return the info (else an empty dict; the items are counted
            as sampled all the same).
          steps: `(field, step)` pairs: read only those steps of the items, each as one
            tensor `[batch, *field_shape]` (a transition's learner needs a few of a window's
            fields and steps); None: every field's whole window.

        Returns:
          `(data, info)`: one tensor per field, `[batch, sequence_length, *field_shape]` (with
          `steps`: one per pair, `[batch, *field_shape]`), and
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
                return self._sample_slots(batch_size, with_info, steps)
            # As Reverb: an item reaching `max_times_sampled` is removed before the next item
            # of the batch is selected (a FIFO queue gives the oldest items, each once).
            parts = []
            for _ in range(batch_size):
                self._wait_for_items(deadline, timeout)
                parts.append(self._sample_slots(1, with_info, steps))
        data = [torch.cat([p[0][j] for p in parts]) for j in range(len(parts[0][0]))]
        info = {name: np.concatenate([p[1][name] for p in parts]) for name in parts[0][1]}
        return data, info

    def _wait_for_items(self, deadline: float | None, timeout: float | None) -> None:
        need = self.config.sampling.min_size_to_sample
        while self.size < max(need, 1) or self._closed:
            self._require_open()
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise BufferStateError(
                    f"no item could be sampled from table {self.name!r} within {timeout} s: "
                    f"it holds {self.size} items and sampling starts at "
                    f"min_size_to_sample={need}; collect more first"
                )
            self._changed.wait(remaining)

    def _sample_slots(
        self,
        batch_size: int,
        with_info: bool = True,
        steps: Sequence[tuple[int, int]] | None = None,
    ) -> tuple[list[torch.Tensor], dict[str, np.ndarray]]:
        """Selects, counts and reads `batch_size` items (the lock held, the table not empty);
        removes those that reached `max_times_sampled`."""
        slots, probability = self._select(batch_size)
        # Counts every draw, a slot drawn twice in the batch too.
        _count_draws(self._times_sampled, slots)
        info = {}
        if with_info:
            info = {
                "key": self._slots.keys(slots),
                "probability": (
                    np.full(batch_size, 1.0 / self.size) if probability is None else probability
                ),
                "table_size": np.full(batch_size, self.size, dtype=np.int64),
                "priority": self._priorities(slots),
                "times_sampled": self._times_sampled.take(slots),
            }
        data = self._read_slots(slots) if steps is None else self._read_steps(slots, steps)
        self.samples += batch_size
        limit = self.config.sampling.max_times_sampled
        if limit:
            done = np.unique(slots[self._times_sampled[slots] >= limit])
            if len(done):
                self._remove(done)
        return data, info

    def _select(self, batch_size: int) -> tuple[np.ndarray, np.ndarray | None]:
        """`batch_size` slots drawn by the sampler and their probabilities (None: uniform)."""
        sampler = self.config.sampling.sampler
        if sampler == "fifo":
            return np.repeat(self._slots.oldest(1), batch_size), np.ones(batch_size)
        if sampler == "prioritized" and self._tree is not None and self._tree.total > 0:
            total = self._tree.total
            targets = self._rng.random(batch_size) * total
            slots = self._tree.find(np.minimum(targets, np.nextafter(total, 0)))
            weights = self._tree.get(slots)
            bad = weights <= 0  # rounding at a boundary: take the slot's left neighbour's mass
            if bad.any():
                slots[bad] = self._slots.draw(self._rng, int(bad.sum()))
                weights = self._tree.get(slots)
            return slots, weights / total
        return self._slots.draw(self._rng, batch_size), None

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
            count = min(int(window), self.size)
            if count <= 0:
                raise BufferStateError(f"table {self.name!r} holds no items to read")
            held = self._slots.newest(count)
            return self._read_slots(held[rng.integers(0, count, batch_size)])

    # ------------------------------------------------------------------------ checkpoints

    def items(self, *, copy: bool = True) -> tuple[list[Any], np.ndarray, np.ndarray]:
        """Every item, oldest first: `(data, priorities, times_sampled)`, data one array per
        field `[size, sequence_length, *field_shape]` (the export layout).

        Args:
          copy: Kept for the checkpoint writer's call: the windows are always gathered from
            the step ring into new arrays (a checkpoint holds `frozen()` all the same, so that
            every table is written as of one moment).
        """
        del copy
        with self._changed:
            slots = self._slots.ordered()
            if len(slots) == 0 or self._columns is None:
                data: list[Any] = [
                    np.zeros((0, *s), d) for s, d in zip(self._shapes, self._dtypes, strict=True)
                ]
            else:
                data = [t.numpy(force=True) for t in self._read_slots(slots)]  # host copies
            return data, self._priorities(slots), self._times_sampled[slots].copy()

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
        if self.size:
            raise BufferStateError(f"table {self.name!r} is not empty; restore needs an empty one")
        if len(priorities) == 0:
            return
        _, slots = self._insert_windows(data, np.asarray(priorities, dtype=np.float64))
        with self._changed:
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

    def _insert_windows(
        self, data: Sequence[np.ndarray], priorities: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """`insert`; returns the new items' keys and slots."""
        count = len(priorities)
        self._check_data(data, count)
        if not count:  # an empty export: nothing to insert, nothing evicted
            with self._changed:
                self._require_open()
            return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64)
        capacity = self.config.capacity
        length = self._length
        if count > capacity:  # only the newest `capacity` would survive
            data = [a[count - capacity :] for a in data]
            priorities = priorities[count - capacity :]
            self.deletes += count - capacity
            self.inserts += count - capacity
            count = capacity
        data = [np.ascontiguousarray(a) for a in data]
        # Item i shares its first steps with item i-1 when it is that window shifted by one.
        shared = np.zeros(count, dtype=np.bool_)
        if length > 1 and count > 1:
            shared[1:] = True
            for array in data:
                rows = array.reshape(count, length, -1).view(np.uint8)
                shared[1:] &= (rows[1:, :-1] == rows[:-1, 1:]).all(axis=(1, 2))
        new_steps = np.where(shared, 1, length)
        total = int(new_steps.sum())
        keep = np.ones((count, length), dtype=np.bool_)
        keep[shared, :-1] = False
        keep = keep.reshape(-1)
        with self._changed:
            self._require_open()
            if self._columns is None:
                self._allocate()
            self._evict_oldest(self.size + count - capacity)
            self._claim(total, -1)
            columns = self._columns
            assert columns is not None
            size = self._ring_size
            written = self._written
            positions = (self._head + np.arange(total, dtype=np.int64)) % size
            for column, array, shape in zip(columns, data, self._step_shapes, strict=True):
                steps = array.reshape(count * length, *shape)[keep]
                if self._device is None:
                    column[positions] = steps
                else:
                    column[self._index(positions)] = torch.from_numpy(steps).to(self._device)
            if self._gap is not None:
                self._gap[positions] = 1
            firsts = written + np.cumsum(new_steps) - length
            self._head = (self._head + total) % size
            self._written = written + total
            self._oldest = max(self._oldest, self._written - size)
            at = self._positions(firsts)  # distinct: the first serials grow
            if self._refs.dtype == np.uint8 and int(self._refs[at].max()) >= 254:
                self._refs = self._refs.astype(np.int32)
            self._refs[at] += 1
            slots, keys = self._slots.allocate(count)
            self._first[slots] = firsts
            if self._consecutive is not None:
                self._consecutive[slots] = True
            self._times_sampled[slots] = 0
            self._set_priorities(slots, np.asarray(priorities, dtype=np.float64))
            self._publish()  # held: their steps and first serials are written
            self.inserts += count
            self._changed.notify_all()
        return keys, slots

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

    def _publish(self) -> None:
        """Writes the counters readers in other processes check (`SharedTable`): after an
        insert's steps and first serials are written, and after a removal, before anything of
        the removed items is overwritten."""
        cell, slots = self._cell, self._slots
        cell[_SIZE] = slots.size
        if isinstance(slots, RingSlots):
            cell[_OLDEST] = slots.first
            cell[_NEXT] = slots.next

    def _evict_oldest(self, excess: int) -> None:
        if excess <= 0:
            return
        if excess == 1 and self.size > 1:
            # A full table's collector evicts one item per insert: no arrays.
            slot = self._slots.remove_oldest_one()
            self._publish()  # free, before anything is overwritten
            self._refs[(int(self._first[slot]) - self._written + self._head) % self._ring_size] -= 1
            if self._scattered and self._consecutive is not None and not self._consecutive[slot]:
                self._scattered -= 1
            if self._tree is not None:
                self._tree.set(np.array([slot]), np.zeros(1))
            self.deletes += 1
            self.evictions += 1
            return
        if excess >= self.size:
            self.deletes += self.size
            self.evictions += self.size
            self._clear_items()
            return
        self._remove(None, excess)
        self.evictions += excess

    def _clear_items(self) -> None:
        """Drops every item (the steps stay in the ring for the writers' next windows)."""
        self._slots.clear()
        self._publish()  # free, before anything is overwritten
        self._scattered = 0
        self._refs[:] = 0
        if self._tree is not None:
            self._tree = SumTree(self.config.capacity)

    def _remove(self, slots: np.ndarray | None, oldest: int = 0) -> None:
        """Removes the items of `slots` (distinct, held), or with `slots=None` the `oldest`
        items."""
        if slots is None:
            slots = self._slots.remove_oldest(oldest)
        else:
            self._slots.remove(slots)
        self._publish()  # free, before anything is overwritten
        np.subtract.at(self._refs, self._positions(self._first[slots]), 1)
        if self._scattered:
            assert self._consecutive is not None
            self._scattered -= int(np.count_nonzero(~self._consecutive[slots]))
        if self._tree is not None:
            self._tree.set(slots, np.zeros(len(slots)))
        self.deletes += len(slots)

    def _set_priorities(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        """Sets the priorities of the held `slots` (distinct); while every item has the same
        one, only that one is kept."""
        if self._priority is None and len(priorities):
            first = float(priorities[0])
            if len(slots) == self.size and bool((priorities == first).all()):
                self._flat_priority = first  # the only items held
            elif bool((priorities != self._flat_priority).any()):
                self._priorities_by_slot()
        if self._priority is not None:
            self._priority[slots] = priorities
        if self._tree is not None:
            self._tree.set(slots, priorities**self._exponent)

    def _priorities_by_slot(self) -> np.ndarray:
        """`_priority`, made once items' priorities differ (before: `_flat_priority`)."""
        if self._priority is None:
            self._priority = np.full(self.config.capacity, self._flat_priority)
        return self._priority

    def _priorities(self, slots: np.ndarray) -> np.ndarray:
        """The priorities of the held `slots`, a new array."""
        if self._priority is None:
            return np.full(len(slots), self._flat_priority)
        return self._priority.take(slots)

    def _gaps(self) -> np.ndarray:
        """`_gap`, made when a writer's steps first interleave with another's."""
        if self._gap is None:
            self._gap = np.ones(self._ring_size, dtype=np.int32)
        return self._gap

    def _consecutives(self) -> np.ndarray:
        """`_consecutive`, made when an item's steps first are not consecutive serials."""
        if self._consecutive is None:
            self._consecutive = np.ones(self.config.capacity, dtype=np.bool_)
        return self._consecutive

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
        positions = self._window_positions(slots)
        by_step = {step: np.ascontiguousarray(positions[:, step]) for step in {s for _, s in steps}}
        if self._device is not None:
            index = {step: self._index(at) for step, at in by_step.items()}
            return [self._columns[field][index[step]] for field, step in steps]
        return [
            torch.from_numpy(self._columns[field].take(by_step[step], axis=0))
            for field, step in steps
        ]

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

    def _index(self, positions: np.ndarray) -> torch.Tensor:
        """Ring positions as an index tensor on the table's device."""
        return torch.from_numpy(np.ascontiguousarray(positions)).to(self._device)

    def _allocate(self, shared: bool = False) -> None:
        """The step ring: one tensor per field, `[ring size, *field_shape]`, as numpy views.

        RAM: `torch.empty` (pages are committed as steps are written), in shared memory with
        `shared`. "memmap": tensordict's `MemoryMappedTensor` files under `scratch_dir` (shared
        mappings), so the buffer can exceed RAM, their whole size reserved on disk first
        (`_reserve_files`).

        Raises:
          ConfigError: If the disk of `scratch_dir` cannot hold the memory-mapped files.
          CheckpointError: If `scratch_dir` cannot be used (`prepare_scratch_dir`).
        """
        steps = self._ring_size
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
                        steps * int(np.prod(shape)) * dtype.itemsize,
                    )
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
                    filename=os.path.join(directory, f"field{index}.memmap"),
                    existsok=True,  # reserved above
                )
            else:
                tensor = torch.empty((steps, *shape), dtype=torch_dtype, device=self._device)
                if shared:
                    tensor.share_memory_()
            columns.append(tensor if self._device is not None else tensor.numpy())
            tensors.append(tensor)
        self._columns = columns
        self._tensors = tensors
        self._gap = None
        self._refs = np.zeros(steps, dtype=np.uint8)


def _count_draws(counts: np.ndarray, slots: np.ndarray) -> None:
    """Adds one to `counts` per occurrence of each slot, as `np.add.at` without its cost.

    A fancy `+=` counts each distinct slot once; in the sorted slots, the occurrences equal to
    the one before them are the repeats, counted the same way in turn (a batch repeats few).
    """
    counts[slots] += 1
    if len(slots) > 1:
        ordered = np.sort(slots)
        repeats = ordered[1:][ordered[1:] == ordered[:-1]]
        while len(repeats):
            counts[repeats] += 1
            repeats = repeats[1:][repeats[1:] == repeats[:-1]]


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


def _reserve_files(
    files: Sequence[tuple[str, int]], what: str, fields: Sequence[dict[str, Any]]
) -> None:
    """Creates each file of `files` with its whole size allocated on disk (`posix_fallocate`).

    A memory-mapped file whose blocks are not allocated takes them when a page is first
    written; on a full disk that write kills the process with SIGBUS. Reserved blocks are the
    file's until it is deleted, so writes through the mapping never need new ones.

    Args:
      files: `(path, bytes)` of each file to create; none of them may exist.
      what: What the files hold, for the error.
      fields: The step's fields (`specs.describe_spec`), named in the error.

    Raises:
      ConfigError: If a file cannot be created or its space cannot be reserved (a full disk, a
        quota); it names the file, the bytes needed and those free. Files that need more than
        the disk has free are refused before any is created; the files this call created are
        removed again.
    """
    needed = sum(n for _, n in files)
    # Refused before any block is taken: a reservation that fails part way holds the disk
    # full meanwhile, for every other writer on it too.
    _check_free(files, what, fields)
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
        left = _free_bytes(os.path.dirname(path) or ".")
        free = "free space unknown" if left is None else f"{left} bytes free there"
        raise ConfigError(
            f"cannot reserve {needed} bytes on disk for {what} in "
            f"{os.path.dirname(path)!r} ({free}): {path!r} ({size} bytes): {e.strerror or e}; "
            "free disk space, lower the capacity or use storage='memory'"
        ) from e


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
    "memmap": every table's files must fit on the disk of `scratch_root` (`_check_free`, which
    `_reserve_files` applies again to each table's files when they are made). Unknown amounts
    (another platform) pass.

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
        reclaimable = sum(_scratch_file_bytes(os.path.join(scratch_root, n)) for n, _, _ in rings)
        what = f"the memory-mapped storage of tables {names}"
        _check_free(files, what, fields, scratch_root, reclaimable)
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


def _check_free(
    files: Sequence[tuple[str, int]],
    what: str,
    fields: Sequence[dict[str, Any]],
    directory: str | None = None,
    reclaimable: int = 0,
) -> None:
    """Refuses `files` (`(path, bytes)`) that need more than the disk of `directory` (their
    first one's directory by default; the nearest existing parent is measured) has free, plus
    `reclaimable` bytes that are deleted before they are made.

    Raises:
      ConfigError: Naming the bytes needed and free, the files, the bytes per step and the
        largest fields per step with their shapes.
    """
    needed = sum(n for _, n in files)
    directory = directory or (os.path.dirname(files[0][0]) if files else ".")
    free = _free_bytes(directory)
    if free is None or needed <= free + reclaimable:
        return
    shown = sorted({os.path.basename(p) for p, _ in files})
    raise ConfigError(
        f"cannot reserve {needed} bytes ({sizes.human(needed)}) on disk for {what} in "
        f"{directory!r} ({free} bytes free there): files {shown} need more than is free "
        f"({sizes.step_bytes(fields)} bytes per step; the largest fields per step: "
        f"{sizes.largest_fields(fields)}); free disk space, lower the capacity or the field's "
        "shape, or use storage='memory'"
    )


def _scratch_file_bytes(directory: str) -> int:
    """Bytes of the `field<N>.memmap` regular files an earlier buffer left in `directory`
    (which `prepare_scratch_dir` deletes); 0 where there are none or it cannot be listed."""
    total = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            if _SCRATCH_FILE.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    return total


def _free_bytes(directory: str) -> int | None:
    """Bytes an unprivileged process may still write on the disk of `directory` (or of its
    nearest existing parent, for one not made yet); None if unknown."""
    while not os.path.isdir(directory) and os.path.dirname(directory) != directory:
        directory = os.path.dirname(directory)
    try:
        stats = os.statvfs(directory)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize

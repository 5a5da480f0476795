"""`LocalTable`: one table of the in-process backend.

A table holds up to `capacity` items, each a window of `sequence_length` steps over a ring of
steps (`ring.StepRing`): every field of the stored spec is one tensor `[step_capacity,
*field_shape]` in which each step is stored once, however many items it belongs to
(`windows.WindowInserts` writes them), and an item is the serial number of its first step
plus, where the writers of a table interleave their steps, the distance from each step to its
writer's next one. Per-item and per-step metadata are numpy arrays: no Python object per item.
Per item slot a table keeps its first step's serial and its sample count (12 bytes), its
priority only once the items' priorities differ, and which slots are held, in which order and
under which keys through `slots.Slots` (nothing per item where items leave oldest first; see
`slots.slots_for`). Samples gather the steps of the drawn items with one `np.take` per field.

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
Every item has a key that is unique for the life of the table and among the buffer's tables
(`update_priorities` takes it; a key of another table is ignored, as an evicted item's).
The table is thread-safe: one lock guards it, so a sampling thread and a collecting thread can
share it. `share_memory()` (`sharing.Shareable`) moves it into shared memory for DataLoader
worker processes, which read it without the lock (`shared.SharedTable`). With `device=` the
step ring is torch tensors on that device (written step by step from the host, gathered there
by index).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from replay_service.backends.local.compressed_column import PayloadBudget
from replay_service.backends.local.next_steps import NextSteps
from replay_service.backends.local.pair_draws import PairDrawing
from replay_service.backends.local.ring import STORAGES
from replay_service.backends.local.shared import (
    CELL_CLOSED,
    CELL_NEXT,
    CELL_OLDEST,
    CELL_SIZE,
    SharedTable,
)
from replay_service.backends.local.sharing import Shareable
from replay_service.backends.local.slots import RingSlots, slots_for
from replay_service.backends.local.sum_tree import SumTree
from replay_service.backends.local.windows import WindowInserts
from replay_service.config.devices import available_devices, require_device
from replay_service.config.options import TableConfig
from replay_service.errors import (
    BufferStateError,
    ConfigError,
    ManagerClosedError,
)
from replay_service.specs.frames import FrameStack

LOCAL_SAMPLERS = ("uniform", "prioritized", "fifo")
LOCAL_REMOVERS = ("fifo",)


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
            f"device must be a torch device such as 'cpu' or 'cuda:0', got {device!r}; "
            f"available here: {available_devices()}"
        ) from e
    if target.type not in ("cpu", "cuda"):
        raise ConfigError(
            f"device={device!r}: a local table's storage lives on 'cpu' or a CUDA device "
            f"('cuda', 'cuda:0'), not on {target.type!r}; available here: {available_devices()}"
        )
    require_device(device)  # on this machine
    if target.type == "cuda" and target.index is None:
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


class LocalTable(WindowInserts, NextSteps, Shareable, PairDrawing):
    """One table of the local backend (see module docstring): its items, their sampling,
    priorities and checkpoints; its step ring, inserts and move into shared memory are its base
    classes' (`ring.StepRing`, `windows.WindowInserts`, `next_steps.NextSteps`,
    `sharing.Shareable`).

    Args:
      config: The table's name, capacity, sequence length and sampling.
      fields: `specs.describe_spec(stored_spec)`: path, dtype and per-step shape of each field.
      storage: "memory" or "memmap" (memory-mapped files under `scratch_dir`).
      scratch_dir: Directory of the memory-mapped files ("memmap"); None: a temporary one.
      seed: Seed of the sampler's `np.random.Generator`; None draws one.
      device: Where the step ring lives (`check_device`): torch tensors on that device,
        written from host steps and gathered there, so samples come back on it; None: host
        memory through numpy views (the default, fastest on the CPU).
      key_stride: Tables of the buffer; with `key_offset`, the table's index among them, its
        keys are never another table's (`slots.item_keys`).
      key_offset: The table's index among the buffer's tables.
      compression: Codec of the large fields (`ring.StepRing`, `codecs.CODECS`); None: none.
      payload_budget: The backend's `compressed_column.PayloadBudget`, shared by its tables;
        None: one of the table's own.

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
        key_stride: int = 1,
        key_offset: int = 0,
        compression: str | None = None,
        payload_budget: PayloadBudget | None = None,
    ) -> None:
        check_local_table(config)
        if storage not in STORAGES:
            raise ConfigError(f"storage must be one of {STORAGES}, got {storage!r}")
        checked = None if device is None else check_device(device)
        if checked is not None and storage != "memory":
            raise ConfigError(
                f"device={device!r} needs storage='memory': storage={storage!r} keeps the "
                "table in host files"
            )
        if compression is not None and (storage != "memory" or checked is not None):
            raise ConfigError(
                f"compression={compression!r} needs storage='memory' on the host, got "
                f"storage={storage!r}, device={device!r}"
            )
        self.config = config
        self.fields = [dict(f) for f in fields]
        length = config.sequence_length
        capacity = config.capacity
        self._length = length
        step_shapes = [tuple(int(d) for d in f["shape"]) for f in self.fields]
        self._shapes = [(length, *s) for s in step_shapes]
        self._init_ring(
            capacity=capacity,
            step_shapes=step_shapes,
            dtypes=[np.dtype(f["dtype"]) for f in self.fields],
            storage=storage,
            scratch_dir=scratch_dir,
            device=checked,
            frames=FrameStack.for_table(config.frame_stack, config.frame_axis, self.fields),
            compression=compression,
            budget=payload_budget,
        )
        # Per item slot: its first step's serial and samples; its priority once items differ
        # (before: `_flat_priority`, every item's); whether its steps are consecutive serials
        # once an item's are not. Which slots are held, their order and keys: `_slots`.
        self._first = np.zeros(capacity, dtype=np.int64)
        self._times_sampled = np.zeros(capacity, dtype=np.int32)
        self._priority: np.ndarray | None = None
        self._flat_priority = 1.0
        self._consecutive: np.ndarray | None = None
        self._scattered = 0  # held items whose steps are not consecutive
        self._slots = slots_for(config, key_stride, key_offset)
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

    def close(self) -> None:
        """Wakes and fails every waiting sampler; the items stay readable for a checkpoint."""
        with self._changed:
            self._closed = True
            self._cell[CELL_CLOSED] = 1
            self._changed.notify_all()

    # ------------------------------------------------------------------- priorities, reset

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
                data, info = self._sample_slots(batch_size, with_info, steps)
            else:
                # As Reverb: an item reaching `max_times_sampled` is removed before the next
                # item of the batch is selected (a FIFO queue gives the oldest items, each once).
                parts = []
                for _ in range(batch_size):
                    self._wait_for_items(deadline, timeout)
                    parts.append(self._sample_slots(1, with_info, steps))
        # Compressed fields are decoded here, the lock released (their payloads were gathered).
        if not limit:
            return self.decoded(data), info
        parts = [(self.decoded(p[0]), p[1]) for p in parts]
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
            data = self._read_slots(held[rng.integers(0, count, batch_size)])
        return self.decoded(data)

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
                data = self._read_slots(slots)
            priorities, times = self._priorities(slots), self._times_sampled[slots].copy()
        # Host copies (compressed fields decoded, the lock released unless a checkpoint holds it).
        data = [d.numpy(force=True) if torch.is_tensor(d) else d for d in self.decoded(data)]
        return data, priorities, times

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

    def _publish(self) -> None:
        """Writes the counters readers in other processes check (`SharedTable`): after an
        insert's steps and first serials are written, and after a removal, before anything of
        the removed items is overwritten."""
        cell, slots = self._cell, self._slots
        cell[CELL_SIZE] = slots.size
        if isinstance(slots, RingSlots):
            cell[CELL_OLDEST] = slots.first
            cell[CELL_NEXT] = slots.next

    def _evict_oldest(self, excess: int) -> None:
        if excess <= 0:
            return
        if excess == 1 and self.size > 1:
            # A full table's collector evicts one item per insert: no arrays.
            slot = self._slots.remove_oldest_one()
            self._publish()  # free, before anything is overwritten
            anchor = self._first.item(slot)
            if self._frames is not None:
                anchor = self._anchor(anchor)
            refs = self._refs
            at = (anchor - self._written + self._head) % self._ring_size
            refs[at] = refs.item(at) - 1  # Python ints: numpy scalar arithmetic is slower
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
        np.subtract.at(self._refs, self._positions(self._anchors(self._first[slots])), 1)
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

    def _consecutives(self) -> np.ndarray:
        """`_consecutive`, made when an item's steps first are not consecutive serials."""
        if self._consecutive is None:
            self._consecutive = np.ones(self.config.capacity, dtype=np.bool_)
        return self._consecutive


def _count_draws(counts: np.ndarray, slots: np.ndarray) -> None:
    """Adds one to `counts` per occurrence of each slot, as `np.add.at` without its cost.

    torch's `index_add_` accumulates repeated indices in one pass over the slots (a few
    microseconds for a draw of 4096 items, against about 50 to sort them and count the
    repeats, 170 for `np.add.at`); `counts` is updated in place through a shared view.
    """
    if len(slots):
        index = torch.from_numpy(np.asarray(slots, dtype=np.int64))
        view = torch.from_numpy(counts)
        view.index_add_(0, index, torch.ones(len(slots), dtype=view.dtype))

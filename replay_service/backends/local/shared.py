"""`SharedTable`: a local table as DataLoader worker processes read it.

`LocalTable.share_memory()` moves a table's step ring and the per-item metadata that sampling
needs into shared memory; the process that owns the table keeps writing it (under its lock),
and readers in other processes, forked or spawned, sample it without any lock: a worker
cannot take the owner's `threading` lock, and a lock shared between processes would make the
collector wait for every worker's batch.

Consistency comes from the order of the owner's writes. A shareable table removes its oldest
items only (`slots.RingSlots`): it holds the items inserted `[oldest, next)`-th, item `n` in
slot `n % capacity`, and publishes both counters in a shared cell. It raises `next` once a new
item's steps and first step are written, and raises `oldest` when items are removed, before
anything of theirs is overwritten; a held item's steps are never overwritten (the ring has room
for `capacity` whole windows, and the oldest items are evicted first). A reader reads `oldest`
and `next`, draws insertion numbers between them, reads each item's first step and its steps,
then `oldest` again, and keeps an item only if it is still at least that; it draws again for
the others. So every item a reader returns is exactly an item that was written, whole, and
held by the table while it was read. The distribution is uniform over the items held, up to
draws of items evicted while they were read (redrawn). This relies on the stores of the owner
becoming visible in program order (x86-64's total store order); the numpy calls between the
writes and reads are separate C calls that compilers do not reorder.

Readers are read-only: they count no samples (`times_sampled` and the table's sample count
are the owner's draws only) and remove nothing, which is why only uniform tables without
`max_times_sampled` can be shared.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from replay_service.backends.local.slots import item_keys
from replay_service.errors import BufferStateError, ManagerClosedError

# The cell of counters a shared table publishes (`LocalTable._publish`), by index: items held,
# closed, the insertion numbers of the oldest held item and of the next one.
CELL_SIZE, CELL_CLOSED, CELL_OLDEST, CELL_NEXT = range(4)
# How often a reader waiting for `min_size_to_sample` items looks again.
POLL_S = 0.01
# Draws of one batch that may land on slots being changed before the reader gives up (each
# round redraws only those; a full round failing needs that many evictions during one copy).
MAX_ROUNDS = 1000


@dataclasses.dataclass
class SharedTable:
    """What readers in other processes need of a shared `LocalTable` (picklable: shared
    tensors travel by handle, memory-mapped ones by file name).

    Attributes:
      name: The table name.
      capacity: Items the table holds at most (item `n` is in slot `n % capacity`).
      length: Steps per item.
      ring_size: Steps in the ring (fixed once shared): an item starting at serial `s` holds
        ring positions `(s + i) % ring_size`.
      min_size: Items the table must hold before a reader samples.
      columns: The step ring, one tensor `[ring_size, *field_shape]` per field.
      metadata: The table's shared per-slot arrays by attribute name (`_first`, `_priority`,
        `_times_sampled`) and `_cell` (size, closed, the insertion numbers of the oldest held
        and of the next item).
      seed: The table's seed; None: readers draw fresh entropy.
      key_stride: Tables of the buffer (`slots.item_keys`).
      key_offset: The table's index among them.
    """

    name: str
    capacity: int
    length: int
    ring_size: int
    min_size: int
    columns: list[torch.Tensor]
    metadata: dict[str, torch.Tensor]
    seed: np.random.SeedSequence | None
    key_stride: int = 1
    key_offset: int = 0

    def reader(self, worker_id: int) -> SharedReader:
        """A reader with its own generator: seeded from the table's seed and `worker_id`
        when the table has a seed (the same seed, worker and table contents give the same
        draws), else from fresh entropy.

        Args:
          worker_id: The DataLoader worker's id (0 outside a worker).
        """
        seed = None
        if self.seed is not None:
            seed = np.random.SeedSequence(
                self.seed.entropy, spawn_key=(*self.seed.spawn_key, int(worker_id))
            )
        return SharedReader(self, np.random.default_rng(seed))


class SharedReader:
    """Samples a `SharedTable` in one process, uniformly with replacement, read-only.

    Args:
      table: The shared table.
      rng: The generator of the draws.
    """

    def __init__(self, table: SharedTable, rng: np.random.Generator) -> None:
        self.table = table
        self.rng = rng
        self._columns = [t.numpy() for t in table.columns]
        meta = {name: t.numpy() for name, t in table.metadata.items()}
        self._first = meta["_first"]
        self._priority = meta["_priority"]
        self._times_sampled = meta["_times_sampled"]
        self._cell = meta["_cell"]
        self._offsets = np.arange(table.length, dtype=np.int64)

    def _wait(self, deadline: float | None, timeout: float | None) -> tuple[int, int]:
        """`(oldest, size)`: the insertion number of the oldest item held and the number of
        items held, once the table holds `min_size` items (at least 1).

        Raises:
          ManagerClosedError: If the table was closed.
          BufferStateError: If it does not hold them within `timeout`.
        """
        need = max(self.table.min_size, 1)
        while True:
            if self._cell[CELL_CLOSED]:
                raise ManagerClosedError(
                    f"the buffer of table {self.table.name!r} was closed; create or load a new one"
                )
            oldest = int(self._cell[CELL_OLDEST])
            size = min(int(self._cell[CELL_NEXT]) - oldest, self.table.capacity)
            if size >= need:
                return oldest, size
            if deadline is not None and time.monotonic() >= deadline:
                raise BufferStateError(
                    f"no item could be sampled from table {self.table.name!r} within {timeout} "
                    f"s: it holds {size} items and sampling starts at min_size_to_sample="
                    f"{self.table.min_size}; collect more first"
                )
            time.sleep(POLL_S)

    def sample(
        self, batch_size: int, timeout: float | None, *, with_info: bool = True
    ) -> tuple[list[torch.Tensor], dict[str, np.ndarray]]:
        """`batch_size` items drawn uniformly from those held, each read whole (see the
        module docstring).

        Args:
          batch_size: Items to sample.
          timeout: Seconds to wait for `min_size_to_sample` items; None waits forever.
          with_info: Whether to return the info (else an empty dict).

        Returns:
          As `LocalTable.sample`: one tensor per field `[batch, length, *field_shape]` and
          the info; "times_sampled" is the owner's count (readers count nothing),
          "probability" `1 / table_size`.

        Raises:
          BufferStateError: If nothing can be sampled within `timeout`, or the draws keep
            landing on items being replaced (`MAX_ROUNDS`).
          ManagerClosedError: If the table was closed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        data = [
            np.empty((batch_size, self.table.length, *c.shape[1:]), c.dtype) for c in self._columns
        ]
        capacity = self.table.capacity
        numbers_out = np.empty(batch_size, np.int64)
        sizes_out = np.empty(batch_size, np.int64)
        pending = np.arange(batch_size)
        for _ in range(MAX_ROUNDS):
            oldest, size = self._wait(deadline, timeout)
            count = len(pending)
            numbers = self.rng.integers(0, size, count) + oldest
            slots = numbers % capacity
            positions = self._first.take(slots)[:, None] + self._offsets
            np.remainder(positions, self.table.ring_size, out=positions)
            for target, column in zip(data, self._columns, strict=True):
                target[pending] = column.take(positions, axis=0)
            good = numbers >= self._cell[CELL_OLDEST]  # not removed while read
            done = pending[good]
            numbers_out[done] = numbers[good]
            sizes_out[done] = size
            pending = pending[~good]
            if not len(pending):
                info: dict[str, np.ndarray] = {}
                if with_info:
                    slots_out = numbers_out % capacity
                    info = {
                        "key": item_keys(
                            numbers_out,
                            slots_out,
                            capacity,
                            self.table.key_stride,
                            self.table.key_offset,
                        ),
                        "probability": 1.0 / sizes_out,
                        "table_size": sizes_out,
                        "priority": self._priority.take(slots_out),
                        "times_sampled": self._times_sampled.take(slots_out),
                    }
                return [torch.from_numpy(d) for d in data], info
        raise BufferStateError(
            f"table {self.table.name!r}: {MAX_ROUNDS} draws in a row landed on items being "
            "replaced while they were read; sample fewer items per batch or write less often"
        )

    def closed(self) -> bool:
        """Whether the owner closed the table."""
        return bool(self._cell[CELL_CLOSED])

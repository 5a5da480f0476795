"""Writing items into a local table: each step is written once, however many items hold it.

Steps are written as the items that hold them are inserted: a collector's writer
(`WindowStream`, one per writer and table) writes only the steps its previous item did not
hold (one per item at stride 1), `insert` of whole windows (an import, a restore) writes every
step of each item except those it shares with the item before it (the previous window shifted
by one step, compared byte for byte). A writer shares steps only with its last item while that
item is held, so no item holds steps older than every held item's. An item is the serial number
of its first step plus, where the writers of a table interleave their steps, the distance from
each step to its writer's next one (the ring's `_gap`, made when writers first interleave).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from replay_service.backends.local.ring import StepRing
from replay_service.backends.local.slots import Slots
from replay_service.backends.local.sum_tree import SumTree
from replay_service.config.options import TableConfig
from replay_service.errors import SpecMismatchError


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


class WindowInserts(StepRing):
    """The inserts of a `LocalTable`, a base class of it (see the module docstring): they
    write the items' steps into the table's step ring (its base class `ring.StepRing`) and
    record the items through the table's slots and priorities.
    """

    # What the table provides (besides its step ring).
    config: TableConfig
    fields: list[dict[str, Any]]
    inserts: int
    deletes: int
    _shapes: list[tuple[int, ...]]
    _changed: threading.Condition
    _closed: bool
    _slots: Slots
    _times_sampled: np.ndarray
    _priority: np.ndarray | None
    _flat_priority: float
    _tree: SumTree | None
    _require_open: Callable[[], None]
    _publish: Callable[[], None]
    _consecutives: Callable[[], np.ndarray]
    _set_priorities: Callable[[np.ndarray, np.ndarray], None]

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

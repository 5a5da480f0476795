"""Writing items into a local table: each step is written once, however many items hold it.

Steps are written as the items that hold them are inserted: a collector's writer (`WindowStream`,
one per writer and table) writes only the steps its previous item did not hold (one per item at
stride 1; a stacked step that continues its last item: `next_steps`), `insert` of whole windows (an
import, a restore) writes every step of each item except those it shares with the item before it
(the previous window shifted by one step, compared byte for byte); stacked observations are laid out
as the writers lay them out (`frame_writes.plan_windows`: each step once, even where writers'
windows interleave, and each earlier frame shared), so a restored table holds the frames its
checkpoint's did. A writer shares steps only with its last item while that item is held, so no item
holds steps older than every held item's. An item is the serial number of its first step plus, where
the writers of a table interleave their steps, the distance from each step to its writer's next one
(the ring's `_gap`, made when writers first interleave). Compressed fields (`compression=`) are
encoded before the table's lock is taken and their payloads stored under it; an insert whose
payloads the memory cannot hold is refused whole before it changes anything
(`ring.StepRing._check_payload_room`).
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from replay_service.backends.local.codecs import SLOT_OVERHEAD, payload_bound
from replay_service.backends.local.compressed_column import CompressedColumn
from replay_service.backends.local.frame_writes import (
    FrameWrites,
    continues_previous,
    plan_windows,
)
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

    __slots__ = ("anchored", "frames", "key", "number", "serials")

    def __init__(self) -> None:
        self.serials: list[int] = []
        self.key = 0  # the key of the writer's last item, 0: none
        # Its insertion number where `next_steps.NextSteps.insert_next` held it, else -1.
        self.number = -1
        # Stacked observations: the serials of the earlier frames of the writer's next step
        # (-1: a zero frame); []: its next step starts an episode; None: unknown.
        self.frames: list[int] | None = []
        # Stacked observations: `(serial, anchor)` of the writer's last step written by
        # `next_steps.NextSteps._insert_next` (`StepRing._anchor`, known as it is written).
        self.anchored = (-1, -1)

    def reset(self) -> None:
        """The writer's next window shares no step with its last one (a new episode)."""
        self.serials = []
        self.key = 0
        self.number = -1
        self.frames = []
        self.anchored = (-1, -1)


class WindowInserts(FrameWrites):
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
    # A writer's next stacked step, the lock held and room made (`next_steps.NextSteps`).
    _insert_next: Callable[
        [Sequence[np.ndarray], float, WindowStream, dict[tuple[int, int], bytes]], int | None
    ]

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
          ConfigError: If the memory cannot hold the compressed payloads
            (`ring.StepRing._check_payload_room`), or the items need more steps than the
            ring holds and its memory-mapped files cannot grow (`ring.StepRing._claim`);
            nothing is inserted then.
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

        Raises:
          ConfigError: If the memory cannot hold the compressed payloads
            (`ring.StepRing._check_payload_room`); nothing is inserted then.
        """
        length = self._length
        # Compressed fields: the payloads of the steps the writer appended, encoded before the
        # lock is taken (a window that cannot share its steps encodes the others under it).
        compressed = self._compressed
        appended = length if fresh is None else fresh
        encoded = self._encode_steps(steps, appended) if compressed else {}
        with self._changed:
            if self._closed:
                self._require_open()
            if self._columns is None:
                self._allocate()
            if compressed:
                unencoded = self._unencoded_bytes(steps, appended, stream)
                self._check_payload_room(encoded.values(), unencoded)
            held = self._slots.size
            if held >= self.config.capacity:
                self._evict_oldest(held + 1 - self.config.capacity)
            if (
                fresh == 1
                and length > 1
                and stream is not None
                and self._frames is not None
                and self._device is None
            ):
                key = self._insert_next(steps[-1], priority, stream, encoded)
                if key is not None:
                    return key
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
            frames = self._frames
            extra, chain = 0, None
            if frames is None:
                if not self._claim(new, keep):
                    new, keep = length, -1
                    self._claim(new, -1)
            else:
                new, keep, extra, chain = self._claim_frames(steps, new, keep, stream, fresh)
            size = self._ring_size
            head = self._head
            written = self._written
            columns = self._columns
            assert columns is not None
            gap = self._gap
            position = head
            on_device = self._device is not None
            if frames is not None:
                position = self._write_frames(steps, new, extra, chain, stream, encoded)
                written += extra  # the earlier frames written first are no step of the item
            for at in () if frames is not None else range(length - new, length):
                for index, (column, value) in enumerate(zip(columns, steps[at])):  # noqa: B905
                    if isinstance(column, CompressedColumn):
                        column.put(position, self._payload(encoded, at, index, value))
                    else:
                        column[position] = torch.as_tensor(value) if on_device else value
                if gap is not None:
                    gap[position] = 1
                position += 1
                if position == size:
                    position = 0
            head = (head + extra) % size
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
            anchor = first if frames is None else self._anchor(first)
            key = self._hold((anchor - written + head) % size, first, end, priority, stream)
            self._changed.notify()
        return key

    def _hold(
        self, at: int, first: int, end: int, priority: float, stream: WindowStream | None
    ) -> int:
        """Makes the item whose first step is serial `first` (its window ends before serial
        `end`) held: its count in `_refs` at ring position `at` (its anchor), its slot, key and
        priority; `stream`'s last item. Returns its key."""
        refs = self._refs
        count = refs.item(at) + 1  # Python ints: numpy scalar arithmetic is slower
        refs[at] = count
        if count >= 255 and refs.dtype == np.uint8:
            self._refs = refs.astype(np.int32)
        slot, key = self._slots.allocate_one()
        self._first[slot] = first
        if first + self._length != end:
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
            stream.number = -1
        self._publish()  # held: its steps and first serial are written
        self.inserts += 1
        return key

    def _encode_steps(
        self, steps: Sequence[Sequence[np.ndarray]], fresh: int
    ) -> dict[tuple[int, int], bytes]:
        """The payloads of the compressed fields of the last `fresh` steps of a window, by
        `(step in the window, field)` (a stacked observation: its newest frame); {} without
        compressed fields. Touches no storage: called before the table's lock is taken."""
        if not self._compressed:
            return {}
        assert self._codec is not None
        encode = self._codec.encode
        frames = self._frames
        encoded = {}
        for at in range(len(steps) - fresh, len(steps)):
            for index in self._compressed:
                value = steps[at][index]
                if type(value) is not np.ndarray:
                    value = np.asarray(value)
                if frames is not None and index == frames.field:
                    value = frames.part(value, frames.k - 1, frames.k)
                if not value.flags.c_contiguous:
                    value = np.ascontiguousarray(value)
                encoded[at, index] = encode(value)
        return encoded

    def _unencoded_bytes(
        self, steps: Sequence[Sequence[np.ndarray]], fresh: int, stream: WindowStream | None
    ) -> int:
        """Bytes of the payloads `insert_window` may encode under the lock (`_payload`), at
        their most (`codecs.payload_bound`, with their `SLOT_OVERHEAD`): the compressed fields
        of the window's steps its writer's last window held (written again where the window
        cannot share them) and, stacked, its first stack's K-1 earlier frames unless it starts
        an episode with a padded stack (`_claim_frames`)."""
        frames = self._frames
        bounds = self._payload_bounds
        if bounds is None:  # per compressed field, a payload's largest bytes with its slot's
            bounds = self._payload_bounds = {
                index: payload_bound(
                    math.prod(self._step_shapes[index]) * self._dtypes[index].itemsize
                )
                + SLOT_OVERHEAD
                for index in self._compressed
            }
        held = len(steps) - fresh
        total = held * sum(bounds.values())
        if frames is not None:
            starts = (
                stream is not None
                and stream.frames == []
                and fresh == len(steps)
                and frames.padding(np.asarray(steps[0][frames.field])) is not None
            )
            if not starts:
                total += (frames.k - 1) * bounds[frames.field]
        return total

    def _payload(
        self,
        encoded: dict[tuple[int, int], bytes] | None,
        at: int,
        index: int,
        value: np.ndarray,
    ) -> bytes:
        """The payload of `value`, step `at` of the window's field `index`: encoded before the
        lock, or now (an earlier frame, a step the writer's last window held but this one
        cannot share)."""
        payload = None if encoded is None else encoded.get((at, index))
        if payload is None:
            assert self._codec is not None
            payload = self._codec.encode(np.ascontiguousarray(value))
        return payload

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
        frames = self._frames
        plan = None
        if frames is not None:
            frames.check_windows(data[frames.field], self.name)
            # Each step once, earlier frames shared (`plan_windows`); the windows laid out with
            # their first stack's earlier frames first (`_framed_windows`).
            plan = plan_windows(data, frames, length)
            data = self._framed_windows(data)
            width = length + frames.k - 1
            source = plan.rows
        else:
            # Item i shares its first steps with item i-1 when it is that window shifted by one.
            shared = continues_previous(data, length)
            width = length
            keep = np.ones((count, width), dtype=np.bool_)
            keep[shared, :-1] = False
            source = np.flatnonzero(keep)
            new_steps = np.where(shared, 1, width)
        total = len(source)
        # Compressed fields: every step's payload, encoded before the lock is taken.
        encoded = {
            index: [
                self._codec.encode(row)
                for row in data[index].reshape(count * width, *self._step_shapes[index])[source]
            ]
            for index in sorted(self._compressed)
            if self._codec is not None
        }
        with self._changed:
            self._require_open()
            if self._columns is None:
                self._allocate()
            self._check_payload_room(itertools.chain.from_iterable(encoded.values()))
            if total > self._ring_size and self._memmap_dir is not None:
                # Files that cannot grow refuse the insert before anything is evicted.
                self._claim(total, -1)
            self._evict_oldest(self.size + count - capacity)
            self._claim(total, -1)
            columns = self._columns
            assert columns is not None
            size = self._ring_size
            written = self._written
            positions = (self._head + np.arange(total, dtype=np.int64)) % size
            for index, (column, array, shape) in enumerate(
                zip(columns, data, self._step_shapes, strict=True)
            ):
                if isinstance(column, CompressedColumn):
                    column.store(positions, encoded[index])
                    continue
                steps = array.reshape(count * width, *shape)[source]
                if self._device is None:
                    column[positions] = steps
                else:
                    column[self._index(positions)] = torch.from_numpy(steps).to(self._device)
            if plan is not None and len(plan.gaps):
                gap = self._gaps()
                gap[positions] = 1
                gap[positions[plan.gaps[:, 0]]] = plan.gaps[:, 1]
            elif self._gap is not None:
                self._gap[positions] = 1
            if plan is None:
                firsts = written + np.cumsum(new_steps) - length
            else:
                firsts = written + plan.firsts
            self._head = (self._head + total) % size
            self._written = written + total
            self._oldest = max(self._oldest, self._written - size)
            if plan is not None:
                assert self._preds is not None
                self._preds[positions] = np.where(plan.preds < 0, -1, plan.preds + written)
            at = self._positions(self._anchors(firsts))  # distinct: the first serials grow
            if self._refs.dtype == np.uint8 and int(self._refs[at].max()) >= 254:
                self._refs = self._refs.astype(np.int32)
            self._refs[at] += 1
            slots, keys = self._slots.allocate(count)
            self._first[slots] = firsts
            if plan is not None and not plan.consecutive.all():
                # Interleaved writers' windows: each step's next one is found through `_gap`.
                self._consecutives()[slots] = plan.consecutive
                self._scattered += int(np.count_nonzero(~plan.consecutive))
            elif self._consecutive is not None:
                self._consecutive[slots] = True
            self._times_sampled[slots] = 0
            self._set_priorities(slots, np.asarray(priorities, dtype=np.float64))
            self._publish()  # held: their steps and first serials are written
            self.inserts += count
            self._changed.notify_all()
        return keys, slots

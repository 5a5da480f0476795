"""A writer's next stacked step into a local table: its one new step written, its item held.

A collector's writer (`windows.WindowStream`) whose next window shares all but its last step
with its previous item writes only that step: its newest frame and other fields in place of the
ring's next position, the serials of its earlier frames, the ring's head and counters, and the
item held. `NextSteps.insert_next` does it all under one acquisition of the table's lock on an
uncompressed host ring whose items leave oldest first at one flat priority: the oldest item
evicted inline where the table is full, the frame's bytes and each one-value field written
through flat memoryviews of the ring's columns, the shared counters written in place;
`NextSteps._insert_next` writes it for any other table (`windows.WindowInserts.insert_window`
calls it, the lock held and room made).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from replay_service.backends.local.compressed_column import CompressedColumn
from replay_service.backends.local.frame_writes import FrameWrites
from replay_service.backends.local.shared import CELL_NEXT, CELL_OLDEST, CELL_SIZE
from replay_service.backends.local.slots import RingSlots, Slots
from replay_service.backends.local.sum_tree import SumTree
from replay_service.backends.local.windows import WindowStream
from replay_service.config.options import TableConfig
from replay_service.specs.frames import any_bit


def _flat_views(
    columns: list[Any], preds: np.ndarray, fields: list[int], stacked: int
) -> tuple[
    list[Any],
    np.ndarray,
    list[tuple[int, memoryview | None, bool]],
    memoryview,
    memoryview | None,
]:
    """`NextSteps.insert_next`'s views of a host ring's `columns` and `preds`: per field
    of `fields`, `(index, view, first)`: a one-dimensional memoryview of a column of one value
    per step (`first`: of shape [1], its values given as one-element arrays), None for any
    other column; the flat view of `preds`; the bytes of the frames' column `stacked` (None
    where it is not one C-contiguous numpy array)."""
    views: list[tuple[int, memoryview | None, bool]] = []
    for index in fields:
        column = columns[index]
        view = None
        if (
            type(column) is np.ndarray
            and column.ndim in (1, 2)
            and column.shape[1:] in ((), (1,))
            and column.dtype.kind in "biuf"
            and column.flags.c_contiguous
        ):
            try:
                view = memoryview(column).cast("B").cast(column.dtype.char)
            except (TypeError, ValueError):  # a format memoryview does not take
                view = None
        views.append((index, view, column.ndim == 2))
    frames = columns[stacked]
    frame_view = (
        memoryview(frames).cast("B")
        if type(frames) is np.ndarray and frames.flags.c_contiguous
        else None
    )
    return columns, preds, views, memoryview(preds).cast("B").cast(preds.dtype.char), frame_view


class NextSteps(FrameWrites):
    """The writes of a writer's next stacked step into a `LocalTable`, a base class of it
    beside `windows.WindowInserts` (see the module docstring): the step written into the
    table's step ring (its base class `ring.StepRing`) and its item held.
    """

    # What the table provides (besides its step ring).
    config: TableConfig
    inserts: int
    deletes: int
    evictions: int
    _changed: threading.Condition
    _cell: np.ndarray
    _closed: bool
    _slots: Slots
    _times_sampled: np.ndarray
    _priority: np.ndarray | None
    _flat_priority: float
    _tree: SumTree | None
    _require_open: Callable[[], None]
    _hold: Callable[[int, int, int, float, WindowStream | None], int]

    def insert_next(
        self, step: Sequence[np.ndarray], priority: float, stream: WindowStream
    ) -> int | None:
        """`insert_window` of a writer's window that shares all but its last step, `step`, with
        the writer's previous item, on an uncompressed host ring of stacked observations,
        without the window's other steps at hand: `_insert_next` and `_hold` in one, for a
        table whose items leave oldest first, of one flat priority, its writers' steps not
        interleaved (any other table: through them).

        Returns:
          The new item's key; None, having changed nothing but the ring's size and the held
          items (the oldest evicted where the table was full, as `insert_window` does first),
          where the window cannot be written so (`insert_window` then writes it).
        """
        if self._compressed or self._device is not None or self._length < 2 or not self._frames:
            return None
        changed = self._changed
        changed.acquire()  # `with changed`, without its two Python-level calls
        try:
            return self._insert_next_held(step, priority, stream)
        finally:
            changed.release()

    def _insert_next_held(
        self, step: Sequence[np.ndarray], priority: float, stream: WindowStream
    ) -> int | None:
        """`insert_next`, the table's lock held."""
        if self._closed:
            self._require_open()
        slots = self._slots
        if self._columns is None:
            return None
        held = slots.size
        serials = stream.serials
        if (
            type(slots) is not RingSlots
            or self._gap is not None
            # Another writer's steps follow this one's last: the step interleaves them (its
            # item is not consecutive, `_hold` tells so).
            or (serials and serials[-1] != self._written - 1)
            or self._tree is not None
            or self._priority is not None
            or priority != self._flat_priority
        ):
            if held >= self.config.capacity:
                self._evict_oldest(held + 1 - self.config.capacity)
            return self._insert_next(step, priority, stream, {})
        if held >= self.config.capacity:
            if held != self.config.capacity or held < 2:
                self._evict_oldest(held + 1 - self.config.capacity)
            else:  # `_evict_oldest(1)` of a full table: its oldest item leaves
                slot = slots.remove_oldest_one()
                cell = self._cell  # `_publish`: free, before anything is overwritten
                cell[CELL_SIZE] = slots.size
                cell[CELL_OLDEST] = slots.first
                cell[CELL_NEXT] = slots.next
                refs = self._refs
                at = (self._anchor(self._first.item(slot)) - self._written + self._head) % (
                    self._ring_size
                )
                refs[at] = refs.item(at) - 1
                consecutive = self._consecutive
                if self._scattered and consecutive is not None and not consecutive[slot]:
                    self._scattered -= 1
                self.deletes += 1
                self.evictions += 1
        keep = self._shared_first(stream)
        if keep is None:
            return None
        chain = stream.frames
        assert chain is not None
        # `slots.holds(stream.key)`: the writer's last item, number `stream.number`, is held
        # until the oldest held one is a later one (-1: not known, asked).
        number = stream.number
        if keep < self._oldest or (
            slots.first > number if number >= 0 else not slots.holds(stream.key)
        ):
            return None
        anchored = stream.anchored  # the oldest serial the item needs
        anchor = anchored[1] if anchored[0] == keep else self._anchor(keep)
        serial = self._written
        size = self._ring_size
        position = self._head
        cutoff = serial + 1 - size  # serials below it are overwritten
        if cutoff > self._oldest and (
            anchor < cutoff
            or cutoff - self._oldest != 1
            or self._refs.item((self._oldest + position - serial) % size)
        ):  # not `_claim(1, anchor)`'s common case: the oldest step no item's first
            if not self._claim(1, anchor):
                return None
            size = self._ring_size
            position = self._head
        columns, preds, frames = self._columns, self._preds, self._frames
        assert columns is not None and preds is not None and frames is not None
        field = frames.field
        stack = step[field]
        newest = self._newest_frame(stack)
        zeros = self._zero_frame
        if zeros and newest.flags.c_contiguous:  # `_insert_next`'s zero test
            zero = zeros.startswith(newest) and not any_bit(stack)
        else:
            zero = frames.zero(stack)
        row = [-1] * (frames.k - 1) if zero else chain
        flat = self._flat
        if flat is None or flat[0] is not columns or flat[1] is not preds:
            flat = self._flat = _flat_views(columns, preds, self._unstacked, field)
        frame_view = flat[4]
        if frame_view is not None and newest.flags.c_contiguous:  # its bytes, as they are
            start = position * newest.nbytes
            frame_view[start : start + newest.nbytes] = memoryview(newest).cast("B")
        else:
            columns[field][position] = newest
        for index, view, first in flat[2]:
            value = step[index]
            if view is None:
                columns[index][position] = value
            else:  # one value per step, through a flat view: no numpy indexing
                view[position] = value[0] if first and type(value) is np.ndarray else value
        at = position * (frames.k - 1)
        pview = flat[3]
        for serial_of in row:
            pview[at] = serial_of
            at += 1
        self._advance_next(stream, row, serial, position)
        # `_hold`: the item's count at its anchor, its slot, key and first serial.
        at = (anchor - serial + position) % size
        refs = self._refs
        count = refs.item(at) + 1
        refs[at] = count
        if count >= 255 and refs.dtype == np.uint8:
            self._refs = refs.astype(np.int32)
        number = slots.next  # `slots.allocate_one()`
        slot = number % slots.capacity
        slots.next = number + 1
        slots.size += 1
        key = slots.key_of(number, slot)
        self._first[slot] = keep
        if self._consecutive is not None:
            self._consecutive[slot] = True
        self._times_sampled[slot] = 0
        stream.key = key
        stream.number = number
        cell = self._cell  # `_publish`: held, its steps and first serial are written
        cell[CELL_SIZE] = slots.size
        cell[CELL_OLDEST] = slots.first
        cell[CELL_NEXT] = slots.next
        self.inserts += 1
        self._changed.notify()
        return key

    def _shared_first(self, stream: WindowStream) -> int | None:
        """The first serial of a writer's next window that shares all but its last step with
        its previous one; None where it cannot (an episode's first window, frames not known,
        a ring whose writers do not share steps)."""
        serials = stream.serials
        length = self._length
        if not stream.frames or len(serials) < length - 1 or not self._shares:
            return None
        return serials[1 - length]

    def _advance_next(
        self, stream: WindowStream, row: list[int], serial: int, position: int
    ) -> int:
        """After a writer's next step, serial `serial` at ring `position` with earlier frames
        `row`, was written: the stream's frames, anchor and serials, the ring's head and
        counters (a gap where writers interleave). Returns the serial after it."""
        stream.frames = [*row[1:], serial]
        oldest = min(row)  # `_anchor(serial)`, from the row at hand
        if oldest < 0:
            oldest = min([s for s in row if s >= 0], default=serial)
        stream.anchored = (serial, oldest)
        serials = stream.serials
        last = serials[-1]
        size = self._ring_size
        if serial - last != 1:  # interleaved writers
            self._gaps()[(last - serial + position) % size] = serial - last
        end = serial + 1
        self._head = position + 1 if position + 1 < size else 0
        self._written = end
        if end - size > self._oldest:
            self._oldest = end - size
        stream.serials = [*serials[1 - self._length :], serial]
        return end

    def _newest_frame(self, stack: np.ndarray) -> np.ndarray:
        """The newest frame of `stack` (`FrameStack.part`), with `_zero_frame` made on first
        use (a zero frame's bytes along axis 0, b"" along another axis)."""
        frames = self._frames
        assert frames is not None
        newest = frames.part(stack, frames.k - 1, frames.k)
        if self._zero_frame is None:
            self._zero_frame = bytes(newest.nbytes) if not frames.axis else b""
        return newest

    def _insert_next(
        self,
        step: Sequence[np.ndarray],
        priority: float,
        stream: WindowStream,
        encoded: dict[tuple[int, int], bytes],
    ) -> int | None:
        """`insert_window` of a writer's window of stacked observations that shares all but
        its last step (`step`) with its previous item (a collector's every step after its
        first window), on a host ring, the lock held and room made: the step's newest frame
        and other fields written in place (compressed ones: their payloads, `encoded` by
        `(step in the window, field)` before the lock was taken). Returns the item's key, or
        None, having changed nothing but the ring's size, where the window cannot share its
        steps (`insert_window` then writes it as it writes any)."""
        keep = self._shared_first(stream)
        if keep is None:
            return None
        chain = stream.frames
        assert chain is not None
        if keep < self._oldest or not self._slots.holds(stream.key):
            return None
        # The oldest serial the item needs.
        anchored = stream.anchored
        anchor = anchored[1] if anchored[0] == keep else self._anchor(keep)
        size = self._ring_size
        position, serial = self._head, self._written
        # `_claim(1, anchor)`, whose first test passes until the ring is first full.
        if serial + 1 - size > self._oldest and not self._claim(1, anchor):
            return None
        size = self._ring_size
        position = self._head
        frames = self._frames
        columns, preds = self._columns, self._preds
        assert frames is not None and columns is not None and preds is not None
        field, k = frames.field, frames.k
        stack = step[field]
        newest = self._newest_frame(stack)
        # `frames.zero(stack)`, the newest frame already at hand: along axis 0 it is compared
        # in place with a zero frame's bytes.
        zeros = self._zero_frame
        if zeros and type(newest) is np.ndarray and newest.flags.c_contiguous:
            zero = zeros.startswith(newest) and not any_bit(stack)
        else:
            zero = not any_bit(newest) and not any_bit(stack)
        row = [-1] * (k - 1) if zero else chain
        if self._compressed:
            at = self._length - 1  # the step's place in its window
            for index, value in enumerate(step):
                column = columns[index]
                value = newest if index == field else value
                if isinstance(column, CompressedColumn):
                    column.put(position, self._payload(encoded, at, index, value))
                else:
                    column[position] = value
        else:
            columns[field][position] = newest
            for index in self._unstacked:
                columns[index][position] = step[index]
        preds[position] = row
        if self._gap is not None:
            self._gap[position] = 1
        end = self._advance_next(stream, row, serial, position)
        key = self._hold((anchor - serial + position) % size, keep, end, priority, stream)
        self._changed.notify()
        return key

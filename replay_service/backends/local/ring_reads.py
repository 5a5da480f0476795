"""Reads of a local table's step ring (`ring.StepRing`, its subclass): the ring positions of
items' steps, whole windows or single steps, gathered per field; stacked observations
assembled from their stored frames (`frames.FrameStack`); compressed fields gathered as
payloads under the table's lock and returned as `Deferred`s, which the table decodes
(`decoded`) after releasing it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from replay_service.backends.local.batch_buffers import BatchBuffers
from replay_service.backends.local.compressed_column import CompressedColumn
from replay_service.specs.frames import FrameStack


class RingReads:
    """The reads of `ring.StepRing` (a base class of it; its storage and counters are the
    ring's, see `ring`'s module docstring)."""

    # What the ring and the table provide.
    size: int
    _length: int
    _first: np.ndarray
    _consecutive: np.ndarray | None
    _scattered: int
    _columns: list[Any] | None
    _device: torch.device | None
    _frames: FrameStack | None
    _compressed: frozenset[int]
    _gap: np.ndarray | None
    _preds: np.ndarray | None
    _offsets: np.ndarray
    _head: int
    _written: int
    _oldest: int
    _ring_size: int
    _buffers: BatchBuffers

    def _positions(self, serials: np.ndarray) -> np.ndarray:
        """Ring positions of steps still in the ring, by serial number."""
        positions = serials + (self._head - self._written)  # in [head - ring size, head)
        np.add(positions, self._ring_size, out=positions, where=positions < 0)
        return positions

    def _index(self, positions: np.ndarray) -> torch.Tensor:
        """Ring positions as an index tensor on the table's device."""
        return torch.from_numpy(np.ascontiguousarray(positions)).to(self._device)

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

    def _read_slots(self, slots: np.ndarray) -> list[Any]:
        """The items of `slots` gathered from the ring, one tensor per field (a compressed
        field: a `Deferred` decoding it, see `decoded`)."""
        assert self._columns is not None
        positions = self._window_positions(slots)
        frames = self._frames
        if self._device is not None:  # gathered on the device: only the positions travel
            index = self._index(positions)
            data = [column[index] for column in self._columns]
        else:
            data = [
                None
                if frames is not None and field == frames.field
                else self._take(field, positions)
                for field, column in enumerate(self._columns)
            ]
        if frames is not None:
            data[frames.field] = self._stacks(positions)
        return data

    def _read_steps(self, slots: np.ndarray, steps: Sequence[tuple[int, int]]) -> list[Any]:
        """Step `step` of field `field` of the items of `slots`, per `(field, step)` pair (a
        compressed field: a `Deferred`, see `decoded`)."""
        assert self._columns is not None
        step_positions = self._step_positions(slots, max(step for _, step in steps))
        by_step = {step: step_positions[step] for step in {s for _, s in steps}}
        frames = self._frames
        if (
            self._device is not None
            and frames is not None
            and frames.field not in self._compressed
            and any(field == frames.field for field, _ in steps)
        ):
            return self._read_steps_on_device(by_step, steps)
        if (
            frames is not None
            and frames.field in self._compressed
            and any(field == frames.field for field, _ in steps)
        ):
            # Every requested step's stacks in one gather and one decode (their shared
            # frames decoded once).
            stacked = sorted({step for field, step in steps if field == frames.field})
            both = self._stacks(np.stack([by_step[step] for step in stacked], axis=1))
            plain = self._read_plain(by_step, [p for p in steps if p[0] != frames.field])
            split = _Split(both, len(stacked))
            at = {step: index for index, step in enumerate(stacked)}
            return [
                split.part(at[step]) if field == frames.field else plain.pop(0)
                for field, step in steps
            ]
        if frames is not None and any(field == frames.field for field, _ in steps):
            stacked = sorted({step for field, step in steps if field == frames.field})
            if len(stacked) == 2 and self._device is None:
                # A transition's state and next state: one gather of the frames they share.
                pair = self._stack_pair(by_step[stacked[0]], by_step[stacked[1]])
                stacks = dict(zip(stacked, pair, strict=True))
            else:
                stacks = {step: self._stacks(by_step[step]) for step in stacked}
            plain = self._read_plain(by_step, [p for p in steps if p[0] != frames.field])
            return [
                stacks[step] if field == frames.field else plain.pop(0) for field, step in steps
            ]
        return self._read_plain(by_step, steps)

    def _read_steps_on_device(
        self, by_step: dict[int, np.ndarray], steps: Sequence[tuple[int, int]]
    ) -> list[torch.Tensor]:
        """`_read_steps` of a frame-stacked ring on a device: every position the steps read
        (each stack's K frames, each other field's step) crosses to the device in one copy,
        the frames of every stack are gathered by one `index_select`, and an episode's zero
        padding is a multiply by a keep mask that crossed with them (a boolean-mask write
        would wait for the device; float frames: a `masked_fill_` by it, as a multiply keeps
        NaN and -0.0)."""
        frames = self._frames
        assert frames is not None and self._preds is not None and self._columns is not None
        k = frames.k
        stacked = sorted({step for field, step in steps if field == frames.field})
        plain = sorted({step for field, step in steps if field != frames.field})
        count = len(by_step[stacked[0]])
        parts = []
        zeros = []
        for step in stacked:
            positions = by_step[step]
            serials = self._preds[positions]  # [count, K-1]
            zero = serials < 0
            at = np.empty((count, k), np.int64)
            at[:, :-1] = self._positions(np.where(zero, self._oldest, serials))
            at[:, -1] = positions
            parts.append(at.reshape(-1))
            zeros.append(zero)
        parts += [by_step[step] for step in plain]
        masked = any(zero.any() for zero in zeros)
        frame_count = len(stacked) * count * k
        if masked:
            keep = np.ones((len(stacked), count, k), np.int64)
            keep[:, :, :-1] = ~np.stack(zeros)
            parts.append(keep.reshape(-1))
        index = self._index(np.concatenate(parts))
        column = self._columns[frames.field]
        gathered = column.index_select(0, index[:frame_count])
        if masked:
            keep_mask = index[-frame_count:].view(frame_count, *([1] * (column.dim() - 1)))
            if column.dtype.is_floating_point or column.dtype == torch.bool:
                # A multiply would keep a NaN or infinity (NaN) and a negative value's sign
                # (-0.0) of the frame read in the padding's place: zeros written, no sync.
                gathered.masked_fill_(keep_mask == 0, 0)
            else:
                gathered.mul_(keep_mask.to(column.dtype))
        gathered = gathered.view(len(stacked), count, k, *column.shape[1:])
        stacks = {step: frames.assemble(gathered[i]) for i, step in enumerate(stacked)}
        at_step = {
            step: index[frame_count + i * count : frame_count + (i + 1) * count]
            for i, step in enumerate(plain)
        }
        return [
            stacks[step]
            if field == frames.field
            else self._columns[field].index_select(0, at_step[step])
            for field, step in steps
        ]

    def _read_plain(
        self, by_step: dict[int, np.ndarray], steps: Sequence[tuple[int, int]]
    ) -> list[torch.Tensor]:
        """`_read_steps` of columns read as stored, by step's positions."""
        assert self._columns is not None
        if self._device is not None:
            index = {step: self._index(at) for step, at in by_step.items()}
            return [self._columns[field][index[step]] for field, step in steps]
        return [self._take(field, by_step[step]) for field, step in steps]

    def _take(self, field: int, positions: np.ndarray) -> Any:
        """Field `field` of the steps at ring `positions` (any shape), from the host ring: a
        tensor, or for a compressed field a `Deferred` holding the gathered payloads."""
        assert self._columns is not None
        column = self._columns[field]
        if not isinstance(column, CompressedColumn):
            return torch.from_numpy(self._gather(column, positions))
        payloads = column.gather(positions.reshape(-1))

        def decode() -> torch.Tensor:
            out = self._buffers.empty((*positions.shape, *column.shape), column.dtype)
            column.decode(payloads, out.reshape(-1, *column.shape))
            return torch.from_numpy(out)

        return Deferred(decode)

    def _gather(self, column: np.ndarray, at: np.ndarray) -> np.ndarray:
        """`column.take(at, axis=0)` (ring positions `at`, any shape) into an array of
        `_buffers` (a batch's array no longer used, whose pages need not be faulted in
        again)."""
        out = self._buffers.empty((*at.shape, *column.shape[1:]), column.dtype)
        # Positions are in range: "wrap" writes `out` directly ("raise" gathers into a
        # temporary first).
        return column.take(at, axis=0, out=out, mode="wrap")

    @staticmethod
    def decoded(data: list[Any]) -> list[torch.Tensor]:
        """`data` of `_read_slots` or `_read_steps` with every `Deferred` decoded: call it
        after releasing the table's lock (the payloads were gathered under it)."""
        return [d() if isinstance(d, Deferred) else d for d in data]

    def _stacks(self, positions: np.ndarray) -> Any:
        """The stacked observations of the steps at ring `positions` (any shape): each step's
        K-1 earlier frames and its own, one gather, zero frames where a serial is -1."""
        frames = self._frames
        assert frames is not None and self._preds is not None and self._columns is not None
        serials = self._preds[positions]  # [..., K-1]
        zero = serials < 0
        at = self._positions(np.where(zero, self._oldest, serials))
        at = np.concatenate([at, positions[..., None]], axis=-1)  # [..., K]
        column = self._columns[frames.field]
        if isinstance(column, CompressedColumn):
            unique, inverse = np.unique(at, return_inverse=True)
            payloads = column.gather(unique)
            k = frames.k

            def decode() -> torch.Tensor:
                out = self._buffers.empty((*at.shape, *column.shape), column.dtype)
                taken = column.decode_take(payloads, inverse.reshape(at.shape), out=out)
                if zero.any():
                    taken[(slice(None),) * positions.ndim + (slice(0, k - 1),)][zero] = 0
                return frames.assemble(torch.from_numpy(taken))

            return Deferred(decode)
        if self._device is not None:
            gathered = column[self._index(at)]
            if zero.any():
                mask = np.concatenate([zero, np.zeros_like(zero[..., :1])], axis=-1)
                gathered[torch.from_numpy(mask).to(self._device)] = 0
        else:
            taken = self._gather(column, at)
            if zero.any():
                taken[(slice(None),) * positions.ndim + (slice(0, frames.k - 1),)][zero] = 0
            gathered = torch.from_numpy(taken)
        return frames.assemble(gathered)

    def _stack_pair(self, first: np.ndarray, second: np.ndarray) -> tuple[Any, Any]:
        """The stacked observations of the steps at ring positions `first` and `second`
        (`[n]` each, a host ring of uncompressed frames), as `_stacks` of each.

        Where the second step's stack is the first's shifted by one frame (a transition's
        next state within its episode, its terminal one included), each row's K+1 frames are
        gathered once and both stacks are views of them (they share memory); other rows
        (a zero stack: an unknown final observation) have their second stack gathered alone.
        """
        frames = self._frames
        preds = self._preds
        assert frames is not None and preds is not None and self._columns is not None
        k = frames.k
        n = len(first)
        shift = self._written - self._head  # a serial less its ring position (before the head)
        # `at`: the ring positions of each row's K+1 frames, oldest first.
        at = np.empty((n, k + 1), dtype=np.int64)
        earlier = at[:, : k - 1]
        preds.take(first, axis=0, out=earlier)
        # The second stack is the first shifted by one frame where its earlier serials are the
        # first's last K-2 earlier ones and the first step's own serial.
        expected = np.empty((n, k - 1), dtype=np.int64)
        expected[:, :-1] = earlier[:, 1:]
        np.add(first, shift, out=expected[:, -1])
        expected[:, -1][first >= self._head] -= self._ring_size
        after = preds.take(second, axis=0)
        chained = None if after.tobytes() == expected.tobytes() else (after == expected).all(1)
        zero = earlier < 0
        masked = zero.any()
        if masked:
            earlier[zero] = self._oldest  # any frame held, zeroed once gathered
        earlier -= shift
        np.add(earlier, self._ring_size, out=earlier, where=earlier < 0)
        at[:, k - 1] = first
        at[:, k] = second
        taken = self._gather(self._columns[frames.field], at)  # [n, K+1, *frame]
        if masked:
            taken[:, : k - 1][zero] = 0
        nexts = taken[:, 1:]
        if chained is not None:
            nexts = nexts.copy()
            alone = np.flatnonzero(~chained)
            nexts[alone] = frames.frames(self._stacks(second[alone]).numpy())
        return (
            torch.from_numpy(frames.stacks(taken[:, :k])),
            torch.from_numpy(frames.stacks(nexts)),
        )

    def _pair_plan(self, first: np.ndarray, second: np.ndarray, batch_size: int) -> PairPlan:
        """What `_pair_frames` needs to gather the stacks of `_stack_pair(first, second)`
        later, a batch of `batch_size` rows at a time (a host ring of uncompressed frames):
        each row's K+1 frames as ring positions (valid while the rows' items are held and the
        ring keeps its layout; `PairPlan.at` finds them again once it grew), which frames are
        zeros, and the rows whose second stack is gathered alone (it is not the first shifted
        by one frame). Computed for every row at once, in numpy."""
        frames = self._frames
        preds = self._preds
        assert frames is not None and preds is not None
        k = frames.k
        n = len(first)
        batches = n // batch_size
        head, ring = self._head, self._ring_size
        shift = self._written - head  # a serial less its ring position (before the head)
        positions = np.empty((n, k + 1), dtype=np.int64)
        earlier = positions[:, : k - 1]  # serials first, ring positions below
        preds.take(first, axis=0, out=earlier)
        positions[:, k - 1] = first
        positions[:, k] = second
        # The second stack is the first shifted by one frame where its earlier serials are the
        # first's last K-2 earlier ones and the first step's own serial (bytes compared once,
        # row by row only where they differ).
        expected = np.empty((n, k - 1), dtype=np.int64)
        expected[:, :-1] = earlier[:, 1:]
        own = expected[:, -1]
        np.add(first, shift, out=own)
        np.subtract(own, ring, out=own, where=first >= head)
        after = preds.take(second, axis=0)
        chained = None if after.tobytes() == expected.tobytes() else (after == expected).all(1)
        zero = earlier < 0
        zero_in = [False] * batches
        if zero.any():
            np.copyto(earlier, own[:, None], where=zero)  # a frame held, zeroed once gathered
            zero_in = zero.reshape(batches, batch_size, -1).any(axis=(1, 2)).tolist()
        earlier -= shift
        np.add(earlier, ring, out=earlier, where=earlier < 0)
        alone: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        if chained is not None and not chained.all():
            rows = np.flatnonzero(~chained)
            nxt = second[rows] + shift
            nxt[second[rows] >= head] -= ring
            held = after[rows] >= 0
            stacks = np.concatenate([np.where(held, after[rows], nxt[:, None]), nxt[:, None]], 1)
            batch_of = rows // batch_size
            for batch in np.unique(batch_of).tolist():
                inside = batch_of == batch
                alone[batch] = (rows[inside] - batch * batch_size, stacks[inside], held[inside])
        return PairPlan(positions, head, ring, shift, zero, zero_in, alone)

    def _pair_frames(self, plan: PairPlan, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stacks of batch `batch` of `plan` (its items held), as `_stack_pair`'s: the
        batch's K+1 frames per row gathered straight into a reused array (`_gather`), both
        stacks views of it."""
        frames = self._frames
        assert frames is not None and self._columns is not None
        k = frames.k
        column = self._columns[frames.field]
        size = plan.batch_size
        lo = batch * size
        ring = self._ring_size
        at = plan.positions[lo : lo + size]
        shift = self._written - self._head
        if ring != plan.ring_size or (shift != plan.shift and shift % ring != plan.shift % ring):
            at = self._positions(plan.serials(at))  # the ring grew since the draw
        taken = self._gather(column, at)  # [size, K+1, *frame]
        if plan.zero_in[batch]:
            taken[:, : k - 1][plan.zero[lo : lo + size]] = 0
        alone = plan.alone.get(batch)
        if alone is None and not frames.axis:
            # Frames stacked along their first axis: both stacks are slices of the K+1 frames
            # laid end to end (`frames.stacks` of each, without its reshapes).
            c = frames.channels
            laid = taken.reshape(size, (k + 1) * c, *frames.stacked[1:])
            return torch.from_numpy(laid[:, : k * c]), torch.from_numpy(laid[:, c:])
        nexts = taken[:, 1:]
        if alone is not None:
            rows, serials, held = alone
            nexts = nexts.copy()
            stacks = column.take(self._positions(serials.copy()), axis=0)
            stacks[:, : k - 1][~held] = 0
            nexts[rows] = stacks
        return (
            torch.from_numpy(frames.stacks(taken[:, :k])),
            torch.from_numpy(frames.stacks(nexts)),
        )


class PairPlan:
    """Batches of transitions drawn ahead (`RingReads._pair_plan`).

    Attributes:
      positions: Per row, the ring positions of its K+1 frames, oldest first, `[n, K+1]`.
      head: The ring's head when drawn.
      ring_size: The ring's size when drawn.
      shift: A serial less its ring position (before the head) when drawn.
      zero: Per row, which of its first K-1 frames are zeros, `[n, K-1]`.
      zero_in: Per batch, whether any of its frames are zeros.
      alone: Per batch that has them, the rows (in the batch) whose second stack is gathered
        alone, the serials of its K frames and which of its first K-1 are held (not zeros).
      batch_size: Rows per batch.
    """

    __slots__ = (
        "alone",
        "batch_size",
        "head",
        "positions",
        "ring_size",
        "shift",
        "zero",
        "zero_in",
    )

    def __init__(
        self,
        positions: np.ndarray,
        head: int,
        ring_size: int,
        shift: int,
        zero: np.ndarray,
        zero_in: list[bool],
        alone: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]],
    ) -> None:
        self.positions = positions
        self.head = head
        self.ring_size = ring_size
        self.shift = shift
        self.zero = zero
        self.zero_in = zero_in
        self.alone = alone
        self.batch_size = len(positions) // max(1, len(zero_in))

    def serials(self, positions: np.ndarray) -> np.ndarray:
        """The serials of ring `positions` of this plan (a new array), as the ring laid them
        out when drawn."""
        serials = positions + self.shift
        np.subtract(serials, self.ring_size, out=serials, where=positions >= self.head)
        return serials


class Deferred:
    """A compressed field's gathered payloads and how to decode them: called (after the
    table's lock is released), returns the tensor."""

    __slots__ = ("_decode",)

    def __init__(self, decode: Callable[[], torch.Tensor]) -> None:
        self._decode = decode

    def __call__(self) -> torch.Tensor:
        """The decoded tensor."""
        return self._decode()


class _Split:
    """One decode of `[batch, parts, ...]` stacks shared by the parts' `Deferred`s."""

    def __init__(self, whole: Deferred, parts: int) -> None:
        self._whole = whole
        self._parts = parts
        self._value: torch.Tensor | None = None

    def part(self, index: int) -> Deferred:
        """The `Deferred` of `whole[:, index]`."""

        def decode() -> torch.Tensor:
            if self._value is None:
                self._value = self._whole()
            return self._value[:, index]

        return Deferred(decode)

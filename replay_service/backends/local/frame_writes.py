"""Writing the steps of a local table's stacked observations (`frames.FrameStack`): each
step's newest frame and the serials of its K-1 earlier ones, a window's first stack preceded
by its earlier frames where it shares none (`WindowInserts`' base class `FrameWrites`); and
the layout of whole windows inserted (`plan_windows`), each step once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from replay_service.backends.local.compressed_column import CompressedColumn
from replay_service.backends.local.ring import StepRing
from replay_service.specs.frames import FrameStack, bits


class FrameWrites(StepRing):
    """The frame writes of `windows.WindowInserts` (a base class of it; its streams are
    `windows.WindowStream`s)."""

    _payload: Any

    def _claim_frames(
        self,
        steps: Sequence[Sequence[np.ndarray]],
        new: int,
        keep: int,
        stream: Any,
        fresh: int | None,
    ) -> tuple[int, int, int, list[int] | str | None]:
        """`_claim` for a window of stacked observations (`frames.FrameStack`).

        A window that shares steps keeps them and its first step's earlier frames (from its
        anchor on, `_anchors`). A whole window that starts an episode needs no earlier frame
        (its padding: "reset" or "zero"); any other is preceded by its first stack's K-1
        earlier frames, written as steps of their own.

        Returns:
          `(new, keep, extra, chain)`: window steps to write, the first shared serial (-1:
          none), earlier frames to write first, and the earlier frames of the first step
          written (serials, "reset", "zero", or None: the `extra` ones).
        """
        frames = self._frames
        assert frames is not None
        length = self._length
        if new < length and stream is not None and stream.frames:
            anchor = self._anchor(keep)
            if self._claim(new, anchor):
                return new, keep, 0, list(stream.frames)
        starts = stream is not None and stream.frames == [] and fresh == length
        padding = frames.padding(np.asarray(steps[0][frames.field])) if starts else None
        extra = 0 if padding is not None else frames.k - 1
        self._claim(length + extra, -1)
        return length, -1, extra, padding

    def _write_frames(
        self,
        steps: Sequence[Sequence[np.ndarray]],
        new: int,
        extra: int,
        chain: list[int] | str | None,
        stream: Any,
        encoded: dict[tuple[int, int], bytes] | None = None,
    ) -> int:
        """Writes the last `new` steps of a window of stacked observations at the head, after
        `extra` earlier frames of its first step: each step's newest frame and the serials of
        its earlier ones (`_preds`); returns the ring position after them. `encoded`: the
        payloads of compressed fields by `(step in the window, field)` (`_encode_steps`)."""
        frames = self._frames
        columns, preds = self._columns, self._preds
        assert frames is not None and columns is not None and preds is not None
        field, k, size = frames.field, frames.k, self._ring_size
        gap = self._gap
        on_device = self._device is not None
        plain = not on_device and not self._compressed
        position, serial = self._head, self._written

        def put(index: int, value: np.ndarray, at: int = -1) -> None:
            column = columns[index]
            if isinstance(column, CompressedColumn):
                column.put(position, self._payload(encoded, at, index, value))
            else:
                column[position] = torch.as_tensor(value) if on_device else value

        if extra:
            earlier = frames.frames(np.asarray(steps[0][field])[None])[0]
            chain = []
            for j in range(extra):
                put(field, earlier[j])
                preds[position] = -1
                if gap is not None:
                    gap[position] = 1
                chain.append(serial)
                serial += 1
                position = position + 1 if position + 1 < size else 0
        for at in range(self._length - new, self._length):
            step = steps[at]
            stack = np.asarray(step[field])
            if chain == "zero" or frames.zero(stack):
                row = [-1] * (k - 1)
            elif chain == "reset":
                row = [serial] * (k - 1)
            else:
                assert isinstance(chain, list)
                row = chain
            if plain:  # host arrays: each field's value copied in place
                for index, value in enumerate(step):
                    columns[index][position] = (
                        frames.part(stack, k - 1, k) if index == field else value
                    )
            else:
                for index, value in enumerate(step):
                    put(index, frames.part(stack, k - 1, k) if index == field else value, at)
            preds[position] = row
            if gap is not None:
                gap[position] = 1
            chain = [*row[1:], serial]
            serial += 1
            position = position + 1 if position + 1 < size else 0
        if stream is not None:
            stream.frames = chain if isinstance(chain, list) else None
        return position

    def _framed_windows(self, data: list[np.ndarray]) -> list[np.ndarray]:
        """Windows `[n, length, ...]` as written with stacked observations: `[n, K-1 + length,
        ...]`, the first K-1 rows the first step's earlier frames (zeros in the other
        fields), the observation column each step's newest frame."""
        frames = self._frames
        assert frames is not None
        extra = frames.k - 1
        out = []
        for index, array in enumerate(data):
            count, length = array.shape[:2]
            if index == frames.field:
                stacked = frames.frames(array.reshape(count * length, *frames.stacked))
                stacked = stacked.reshape(count, length, frames.k, *frames.frame)
                rows = np.concatenate([stacked[:, 0, :extra], stacked[:, :, -1]], axis=1)
            else:
                pad = np.zeros((count, extra, *array.shape[2:]), dtype=array.dtype)
                rows = np.concatenate([pad, array], axis=1)
            out.append(np.ascontiguousarray(rows))
        return out


class FramedPlan(NamedTuple):
    """Where `plan_windows` puts whole windows of stacked observations in the step ring.

    Attributes:
      rows: int64 `[total]`: the rows written, in order, as indexes into the windows as
        `FrameWrites._framed_windows` lays them out (`[count * (K-1 + length)]`).
      preds: int64 `[total, K-1]`: each row's earlier frames as rows written (-1: a zero
        frame).
      firsts: int64 `[count]`: each window's first step, as a row written.
      consecutive: bool `[count]`: whether a window's steps are consecutive rows.
      gaps: int64 `[n, 2]`: `(row, distance)` of each step whose window's next step is not the
        row after it.
    """

    rows: np.ndarray
    preds: np.ndarray
    firsts: np.ndarray
    consecutive: np.ndarray
    gaps: np.ndarray


def continues_previous(data: Sequence[np.ndarray], length: int) -> np.ndarray:
    """Which of whole windows `data` (`[count, length, ...]` per field) are the window before
    them shifted by one step, so that they share its last `length - 1` steps.

    Args:
      data: Every field's windows.
      length: Steps per window.

    Returns:
      `[count]` booleans (the first window: False).
    """
    count = len(data[0])
    shared = np.zeros(count, dtype=np.bool_)
    if length > 1 and count > 1:
        shared[1:] = True
        for array in data:
            rows = array.reshape(count, length, -1).view(np.uint8)
            shared[1:] &= (rows[1:, :-1] == rows[:-1, 1:]).all(axis=(1, 2))
    return shared


def plan_windows(data: Sequence[np.ndarray], frames: FrameStack, length: int) -> FramedPlan:
    """The steps-once layout of whole windows of stacked observations (an import, a restore):
    each step written once and each earlier frame shared, as the collectors' writers lay out
    the steps they append.

    Windows are taken in order. One whose first `length - 1` steps are the last ones of a
    window before it (every field byte for byte: the same writer's next window, even where
    other writers' windows come between) writes only its last step, after that window's. Any
    other starts its own steps: its first stack's earlier frames are its own frame or zeros
    (an episode's first, padded stack, or an all-zero one), rows written before (it continues
    the episode of a window's last step, at a stride of `length` or more, or repeats that
    step's stack), or else K-1 rows of their own written first.

    Args:
      data: One C-contiguous array per field, `[count, length, *field_shape]`, the stacks
        checked (`FrameStack.check_windows`).
      frames: The stacked observation.
      length: Steps per window.

    Returns:
      The `FramedPlan`.
    """
    count = len(data[0])
    k = frames.k
    extra = k - 1
    width = length + extra
    stacks = data[frames.field]
    # Window i is window i-1 shifted by one step (the common case, found without hashing).
    shared = continues_previous(data, length)
    # A window whose next one does not continue it may be continued by a later one.
    open_end = np.ones(count, dtype=np.bool_)
    open_end[:-1] = ~shared[1:]
    zero = ~bits(stacks).reshape(count, length, -1).any(axis=2)
    framed = frames.frames(stacks.reshape(count * length, *frames.stacked))
    framed = framed.reshape(count, length, k, *frames.frame)

    def steps_key(window: int, start: int, stop: int) -> bytes:
        digest = hashlib.blake2b(digest_size=16)
        for array in data:
            digest.update(memoryview(array[window, start:stop]).cast("B"))
        return digest.digest()

    def frames_key(window: int, step: int, start: int, stop: int) -> bytes:
        part = np.ascontiguousarray(framed[window, step, start:stop])
        return hashlib.blake2b(memoryview(part).cast("B"), digest_size=16).digest()

    none = (-1,) * extra
    rows: list[int] = []
    preds: list[tuple[int, ...]] = []
    firsts: list[int] = []
    consecutive: list[bool] = []
    gaps: list[tuple[int, int]] = []
    # Open ends: by their last `length - 1` steps, the window's serials; by K-1 frames, the
    # rows holding them (a stack's earlier frames).
    ends: dict[bytes, list[int]] = {}
    frame_ends: dict[bytes, tuple[int, ...]] = {}
    last: list[int] = []
    for i in range(count):
        base = i * width + extra
        chain = last if shared[i] else None
        if chain is None and length > 1:
            chain = ends.pop(steps_key(i, 0, length - 1), None)
        if chain is not None:
            before = chain[-1]
            serial = len(rows)
            if serial - before != 1:
                gaps.append((before, serial - before))
            rows.append(base + length - 1)
            preds.append(none if zero[i, -1] else (*preds[before][1:], before))
            window = [*chain[1 - length :], serial]
        else:
            first: tuple[int, ...] | None = none
            if not zero[i, 0]:
                padding = frames.padding(stacks[i, 0])
                if padding == "reset":
                    first = None  # the step's own frame, once it has a serial
                elif padding is None:
                    first = frame_ends.get(frames_key(i, 0, 0, extra))
                    if first is None:  # its earlier frames, as rows of their own
                        first = tuple(range(len(rows), len(rows) + extra))
                        rows.extend(range(i * width, base))
                        preds.extend([none] * extra)
            serial = len(rows)
            window = list(range(serial, serial + length))
            rows.extend(range(base, base + length))
            row = (serial,) * extra if first is None else first
            for step in range(length):
                if step:
                    row = none if zero[i, step] else (*row[1:], serial + step - 1)
                elif zero[i, 0]:
                    row = none
                preds.append(row)
        firsts.append(window[0])
        consecutive.append(window[-1] - window[0] == length - 1)
        last = window
        if open_end[i]:
            if length > 1:
                ends[steps_key(i, 1, length)] = window
            end = window[-1]
            # A stack after the last one (its episode goes on) or beside it (the same stack in
            # a step that differs in another field) takes its earlier frames from there.
            frame_ends[frames_key(i, length - 1, 1, k)] = (*preds[end][1:], end)
            frame_ends.setdefault(frames_key(i, length - 1, 0, extra), preds[end])
    return FramedPlan(
        np.asarray(rows, dtype=np.int64),
        np.asarray(preds, dtype=np.int64).reshape(len(rows), extra),
        np.asarray(firsts, dtype=np.int64),
        np.asarray(consecutive, dtype=np.bool_),
        np.asarray(gaps, dtype=np.int64).reshape(-1, 2),
    )

"""Writing the steps of a local table's stacked observations (`frames.FrameStack`): each
step's newest frame and the serials of its K-1 earlier ones, a window's first stack preceded
by its earlier frames where it shares none (`WindowInserts`' base class `FrameWrites`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from replay_service.backends.local.compressed_column import CompressedColumn
from replay_service.backends.local.ring import StepRing


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


def earlier_serials(written: int, total: int, zero: np.ndarray, k: int) -> np.ndarray:
    """`_preds` of `total` rows written from serial `written` on by `_insert_windows`: each
    step's K-1 earlier frames are the K-1 serials before it (windows and their earlier frames
    are written in order), except at and before the last step whose stack is all zeros (-1):
    a zero stack (an unknown final observation) is zero padding of a zero frame.

    Args:
      written: The first row's serial.
      total: Rows written.
      zero: `[total]` whether the row is a step whose stack is all zeros.
      k: Frames per stack.
    """
    serials = written + np.arange(total, dtype=np.int64)
    preds = serials[:, None] + np.arange(-(k - 1), 0, dtype=np.int64)
    if zero.any():
        last_zero = np.maximum.accumulate(np.where(zero, serials, -1))
        preds[preds <= last_zero[:, None]] = -1
    return preds

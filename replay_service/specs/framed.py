"""The framed packed layout: a Reverb table of frame stacks whose steps store one frame each.

With `frame_stack=K` on a Reverb buffer (`specs.frames`), a step's packed row holds its newest
frame instead of its whole observation stack, then one byte, its mark: `CONTINUES` (its stack is
the previous step's shifted by one frame), `RESET` (it starts an episode whose first stack
repeats its frame: gymnasium's `padding_type="reset"`) or `ZERO` (zeros before its frame: an
episode started with `padding_type="zero"`, SB3's, or an all-zero stack, an unknown final
observation). An item of `sequence_length` L then spans `K - 1 + L` stored steps: the K-1 steps
before its first one (whose frames its first stack holds) and its own. Reverb's chunks (of
`CHUNK_STEPS` rows) share the steps among overlapping items, so a step costs one frame however
many items hold it.

Reading rebuilds each of the L stacks from the item's frames and marks (`unpack_leaves` in
numpy, which torch batches use: one gather of the batch's frames; `unpack_tf` in TensorFlow
datasets): step p's frames are the K steps ending at p, where those
before the last mark at or before p are padding: that step's own frame (`RESET`) or zeros
(`ZERO`). The K-1 steps before an item's first step may belong to an earlier episode (or be
a writer's zero fillers): a mark at the episode's first step hides them.

`FramedLayout` is a `PackedLayout` whose `fields` and `step_bytes` are the stored row's (the
frame, the other fields, the mark); what it reads back is the stacked data spec (`structure`).
Its rows are written by `backends.reverb.framed_writers.FramedWindowWriter` (collectors) and
`encode_columns` (imports of whole items).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from replay_service.specs.arrays import ArraySpec
from replay_service.specs.frames import OBSERVATION, FrameStack, bits
from replay_service.specs.layouts import BatchRead
from replay_service.specs.nests import flatten_with_paths, numpy_dtype
from replay_service.specs.packed import PackedLayout

CONTINUES, RESET, ZERO = 0, 1, 2
MARK = "frame_mark"
# Rows per Reverb chunk of a framed table. A row (an Atari frame: ~7 KB) would otherwise get a
# chunk of its own: Reverb compresses each chunk alone (consecutive frames together compress
# to ~60% of what single ones do) and pays per chunk, in the server's memory (the chunk and each
# item's reference to it) and per sampled item (an item of K + 1 rows that starts in the last
# K rows of a chunk references two). 16 rows: about 1,220 B of heap per stored Breakout
# transition against 1,290 with 8 (and 1,480 with 4), an item in two chunks one time in four
# instead of one in two, and a sampled batch about a quarter less CPU; 32 rows store about the
# same as 16 and sample slower (each sampled chunk is decompressed whole).
CHUNK_STEPS = 16


class FramedLayout(PackedLayout):
    """A packed table of `frame_stack` observations stored one frame per step (see the
    module docstring).

    Args:
      stored_spec: The per-step data spec (whole stacks); TF specs or `ArraySpec`.
      frame_stack: Frames per stack (K >= 2).
      frame_axis: 0 or -1 (`specs.frames`).

    Attributes:
      structure: `stored_spec`, what reads give.
      fields: The stored row's fields: the spec's, the observation one frame, then the mark.
      step_bytes: Bytes of one stored row.
      frames: The stack's geometry (`FrameStack`).
    """

    def __init__(self, stored_spec: Any, frame_stack: int, frame_axis: int) -> None:
        leaves = flatten_with_paths(stored_spec)
        index = next((i for i, (path, _) in enumerate(leaves) if path == OBSERVATION), None)
        if index is None:
            raise ValueError(f"frame_stack={frame_stack} needs an 'observation' field")
        stacked = tuple(int(d) for d in leaves[index][1].shape)
        self.frames = FrameStack(frame_stack, frame_axis, index, stacked)
        row = [
            ArraySpec(self.frames.frame if i == index else spec.shape, numpy_dtype(spec), path)
            for i, (path, spec) in enumerate(leaves)
        ]
        row.append(ArraySpec((), np.uint8, MARK))
        super().__init__(row)
        for field, path in zip(self.fields, [p for p, _ in leaves] + [MARK], strict=True):
            field.path = path
        self.rows = PackedLayout(row)  # the stored rows as a plain packed layout
        self.structure = stored_spec
        self.stacks = PackedLayout(stored_spec)  # the whole steps (reads, imports)
        self.frame_stack = int(frame_stack)
        self.frame_axis = int(frame_axis)

    # A step's row does not decode alone: its stack needs the rows before it.
    steps_apart = False

    def __repr__(self) -> str:
        return (
            f"FramedLayout({self.structure!r}, frame_stack={self.frame_stack}, "
            f"frame_axis={self.frame_axis})"
        )

    @property
    def history(self) -> int:
        """Steps an item holds before its first one: K-1."""
        return self.frames.k - 1

    def mismatch_notes(self) -> list[str]:
        """The packed layout's note, with the frame stack."""
        return [
            f"this manager's layout is 'packed' with frame_stack={self.frame_stack} "
            f"(frame_axis={self.frame_axis}): a step stores one frame in {self.step_bytes} "
            f"bytes and an item {self.history} steps more than its sequence_length"
        ]

    # ------------------------------------------------------------------------------ writing

    def encode_step(self, step: Any) -> np.ndarray:
        """Refused: a framed row depends on the episode's previous step (its writer's).

        Raises:
          ValueError: Always.
        """
        raise ValueError(
            f"frame_stack={self.frame_stack}: steps are written by the manager's writers "
            "(observer(), transition_writer(), writers), which store one frame per step"
        )

    def encode_row(self, leaves: list[Any], mark: int) -> np.ndarray:
        """One step's leaves (`tree.flatten` order, the observation a whole stack already
        checked) as a stored row: the stack's newest frame and `mark`."""
        field = self.frames.field
        stack = np.asarray(leaves[field])
        row = list(leaves)
        row[field] = self.frames.newest(stack[None])[0]
        row.append(np.uint8(mark))
        return self.rows.encode_step(row)

    def mark(self, stack: np.ndarray, first: bool) -> int:
        """The mark of a step whose (checked) observation is `stack`; `first`: it starts an
        episode."""
        if not bits(stack).any():
            return ZERO
        if not first:
            return CONTINUES
        return ZERO if self.frames.padding(stack) == "zero" else RESET

    def encode_columns(self, columns: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Whole items (`[n, L, *shape]` per field, stacks whole, checked by
        `FrameStack.check_windows`) as rows `uint8[n, K - 1 + L, step_bytes]`: each item's
        first K-1 rows hold its first stack's earlier frames."""
        field = self.frames.field
        k = self.frames.k
        stacks = np.asarray(columns[field])
        n, length = stacks.shape[:2]
        frames = self.frames.frames(stacks.reshape(n * length, *self.frames.stacked))
        frames = frames.reshape(n, length, k, *self.frames.frame)
        zero = ~bits(stacks).reshape(n, length, -1).any(axis=2)
        newest = np.concatenate([frames[:, 0, :-1], frames[:, :, -1]], axis=1)
        marks = np.concatenate(
            [np.full((n, k - 1), CONTINUES, np.uint8), np.where(zero, ZERO, CONTINUES)], axis=1
        ).astype(np.uint8)
        rows = []
        for i, column in enumerate(columns):
            if i == field:
                rows.append(newest)
                continue
            column = np.asarray(column)
            # The earlier steps' other fields are never read: the first step's, repeated.
            rows.append(np.concatenate([np.repeat(column[:, :1], k - 1, axis=1), column], 1))
        rows.append(marks)
        return [self.rows.pack_items(rows)]

    def writer_chunking(self, sequence_length: int) -> tuple[int, int]:
        """Constant chunks of `CHUNK_STEPS` rows, and at least an item's K - 1 + L steps
        kept alive."""
        return max(CHUNK_STEPS, sequence_length + self.history), CHUNK_STEPS

    # ------------------------------------------------------------------------------ reading

    def sources(self, marks: Any, xp: Any = None) -> tuple[Any, Any]:
        """Where each stack's frames come from, for marks `[B, K - 1 + L]` (numpy, or
        a TensorFlow tensor with `xp` `_TFOps`; None: numpy, looked up in a `_SourceTable`
        where the item is short enough for one and the marks are bytes).

        Returns:
          `(index, zero)`, both `[B, L, K]`: the item's step holding each frame, and whether
          the frame is a zero frame.
        """
        n = int(marks.shape[-1])
        if xp is None and n <= _SourceTable.MAX_STEPS and marks.dtype == np.uint8:
            table = _SOURCE_TABLES.get((self.frames.k, n))
            if table is None:
                table = _SOURCE_TABLES[self.frames.k, n] = _SourceTable(self, n)
            return table.lookup(marks)
        return self._sources(marks, xp or _NumpyOps)

    def _sources(self, marks: Any, xp: Any) -> tuple[Any, Any]:
        """`sources` computed by `xp` (`_NumpyOps`, `_TFOps`) from the marks themselves."""
        k = self.frames.k
        n = int(marks.shape[-1])
        length = n - (k - 1)
        position = np.arange(n)
        # start[b, p]: the last marked step at or before p (-1: none).
        upto = position[None, :] <= position[:, None]  # [p, q]: q <= p
        q = np.arange(length)[:, None] + np.arange(k)[None, :]  # [L, K]
        p = np.arange(k - 1, n)
        return xp.sources(marks, upto, q, p)

    def unpack(self, rows: Any) -> Any:
        """numpy rows `uint8[..., K - 1 + L, step_bytes]` as the stacked nest `[..., L, ...]`."""
        import tree

        return tree.unflatten_as(self.structure, self.unpack_leaves(rows))

    def unpack_leaves(self, rows: Any, *, copy: bool = False) -> list[np.ndarray]:
        """Items' rows `uint8[..., K - 1 + L, step_bytes]` as one `[..., L, *shape]` array
        per field of `structure`, the observation's stacks rebuilt (always copies).

        Raises:
          ValueError: If `rows` is not `uint8[..., n, step_bytes]` with n > K - 1.
        """
        del copy
        rows = self._checked(rows)
        k = self.frames.k
        if rows.ndim < 2 or rows.shape[-2] < k:
            raise ValueError(
                f"framed rows must be uint8[..., >= {k}, {self.step_bytes}], got {list(rows.shape)}"
            )
        lead, n = rows.shape[:-2], rows.shape[-2]
        flat = rows.reshape(-1, n, self.step_bytes)
        marks = flat[:, :, self.rows.fields[-1].start]
        index, zero = self.sources(marks)
        # The frames' bytes of the rows, one gather of the stacks' frames (the only copy of
        # them), as one vector per frame: the copy moves whole frames.
        field = self.rows.fields[self.frames.field]
        frames = flat[:, :, field.start : field.stop]
        gathered = frames[np.arange(len(flat))[:, None, None], index]  # [B, L, K, bytes]
        if zero.any():
            gathered[zero] = 0
        gathered = gathered.view(field.dtype).reshape(*index.shape, *self.frames.frame)
        stacks = _assemble(gathered, self.frames)
        out = []
        steps = flat[:, k - 1 :]
        for i in range(len(self.stacks.fields)):
            value = stacks if i == self.frames.field else self.rows.leaf(steps, i)
            out.append(value.reshape(*lead, *value.shape[1:]))
        return out

    def leaf(self, rows: Any, index: int) -> np.ndarray:
        """Field `index` of `structure` from items' rows (`unpack_leaves`)."""
        return self.unpack_leaves(rows)[index]

    def unpack_tf(self, rows: Any) -> Any:
        """`unpack` of a `tf.uint8` tensor `[..., K - 1 + L, step_bytes]` (static rank and
        static K - 1 + L), in TF ops."""
        import tensorflow as tf

        k = self.frames.k
        n = int(rows.shape[-2])
        lead = tf.shape(rows)[:-2]
        flat = tf.reshape(rows, [-1, n, self.step_bytes])
        leaves = tf.nest.flatten(self.rows.unpack_tf(flat))
        marks = leaves.pop()
        frames = leaves[self.frames.field]  # [B, n, *frame]
        index, zero = self.sources(marks, _TF)
        gathered = tf.gather(frames, index, batch_dims=1)  # [B, L, K, *frame]
        zero = tf.reshape(zero, tf.concat([tf.shape(zero), [1] * len(self.frames.frame)], 0))
        # Zero frames are rare (an episode's padding): the batch is only rewritten for them.
        gathered = tf.cond(
            tf.reduce_any(zero),
            lambda: tf.where(zero, tf.zeros_like(gathered), gathered),
            lambda: gathered,
        )
        ndim = 3 + len(self.frames.frame)
        at = 2 + self.frames.axis
        perm = [0, 1, *range(3, at + 1), 2, *range(at + 1, ndim)]
        stacks = gathered if perm == sorted(perm) else tf.transpose(gathered, perm)
        out = []
        for i, leaf in enumerate(leaves):
            value = stacks if i == self.frames.field else leaf[:, k - 1 :]
            shape = self.stacks.fields[i].shape
            out.append(tf.reshape(value, tf.concat([lead, [n - k + 1], list(shape)], 0)))
        return tf.nest.pack_sequence_as(self.structure, out)

    def batch_reader(
        self, max_step_bytes: int, read_nest: BatchRead, rows_reader: Callable[[Any], BatchRead]
    ) -> tuple[BatchRead, bool]:
        """The reader rebuilds the stacks in numpy (`rows_reader(self)`, whatever the step's
        size: one gather of the batch's frames, where the pipeline's TF ops cost about
        twice the sampling itself), and the pipeline yields the rows."""
        return rows_reader(self), False

    # ---------------------------------------------------------------------------- signature

    def signature(self, sequence_length: int) -> Any:
        """`tf.TensorSpec([K - 1 + sequence_length, step_bytes], tf.uint8)`."""
        return super().signature(sequence_length + self.history)

    def describe(self, sequence_length: int) -> list[dict[str, Any]]:
        """`specs.describe_spec` of the signature, without TensorFlow."""
        return super().describe(sequence_length + self.history)


def _assemble(frames: np.ndarray, stack: FrameStack) -> np.ndarray:
    """numpy `[B, L, K, *frame]` -> `[B, L, *stacked]` (`FrameStack.assemble`)."""
    moved = np.moveaxis(frames, 2, 2 + stack.axis)
    return np.ascontiguousarray(moved).reshape(*frames.shape[:2], *stack.stacked)


class _SourceTable:
    """`FramedLayout.sources` of every item of `n` steps, looked up by its marks: a mark is
    one of 3 values, so an item's marks are a number below `3 ** n` (marks above `ZERO` read
    as `RESET`, as `_NumpyOps` reads them)."""

    # Items of up to this many steps are looked up (3 ** 8 = 6561 entries of L * K each).
    MAX_STEPS = 8

    def __init__(self, layout: FramedLayout, n: int) -> None:
        codes = np.arange(3**n)
        marks = (codes[:, None] // 3 ** np.arange(n)[None, :]) % 3
        self.index, self.zero = layout._sources(marks.astype(np.uint8), _NumpyOps)
        self.index = self.index.astype(np.intp)
        self.weights = (3 ** np.arange(n)).astype(np.int32)

    def lookup(self, marks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        code = np.dot(_CANONICAL[np.asarray(marks)], self.weights)
        return self.index[code], self.zero[code]


# A mark as `_SourceTable` numbers it: CONTINUES 0, ZERO 2, every other value 1 (RESET).
_CANONICAL = np.ones(256, np.uint8)
_CANONICAL[CONTINUES], _CANONICAL[ZERO] = 0, 2
# The `_SourceTable` of items of n steps of stacks of K frames, per (K, n): they depend on
# nothing else.
_SOURCE_TABLES: dict[tuple[int, int], _SourceTable] = {}


class _NumpyOps:
    @staticmethod
    def sources(marks: Any, upto: np.ndarray, q: np.ndarray, p: np.ndarray) -> tuple[Any, Any]:
        n = marks.shape[-1]
        marked = np.where(marks != CONTINUES, np.arange(n)[None, :], -1)  # [B, n]
        start = np.where(upto[None], marked[:, None, :], -1).max(axis=2)  # [B, n]
        kind = np.take_along_axis(marks, np.maximum(start, 0), 1)
        first = start[:, p][:, :, None]  # [B, L, 1]
        before = q[None] < first
        index = np.where(before, first, q[None])
        zero = before & (kind[:, p][:, :, None] == ZERO)
        return index, zero


class _TFOps:
    @staticmethod
    def sources(marks: Any, upto: np.ndarray, q: np.ndarray, p: np.ndarray) -> tuple[Any, Any]:
        import tensorflow as tf

        n = int(marks.shape[-1])
        position = tf.range(n, dtype=tf.int32)[None, :]
        marked = tf.where(marks != CONTINUES, position, -1)  # [B, n]
        start = tf.reduce_max(tf.where(upto[None], marked[:, None, :], -1), axis=2)
        kind = tf.gather(marks, tf.maximum(start, 0), batch_dims=1)
        first = tf.gather(start, p, axis=1)[:, :, None]
        before = tf.constant(q, tf.int32)[None] < first
        index = tf.where(before, first, tf.constant(q, tf.int32)[None])
        zero = before & (tf.gather(kind, p, axis=1)[:, :, None] == ZERO)
        return index, zero


_TF = _TFOps


_LAYOUTS: dict[tuple[str, int, int], FramedLayout] = {}


def framed_layout_of(stored_spec: Any, frame_stack: int, frame_axis: int) -> FramedLayout:
    """A (cached) `FramedLayout` of `stored_spec`."""
    key = (repr(stored_spec), int(frame_stack), int(frame_axis))
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = _LAYOUTS[key] = FramedLayout(stored_spec, frame_stack, frame_axis)
    return layout

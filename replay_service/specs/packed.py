"""The packed storage layout: every field of a step in one `uint8` row.

A table of the default "nested" layout stores one Reverb column per field of the step (its
signature is the data spec with a leading time dimension). A "packed" table stores one column:
each step is the bytes of all its fields, in `tree.flatten` order of the stored step (the
`Trajectory` fields; for a padded table `Masked(step, mask)`, the mask last), each field's
values in C order and native byte order. The table signature is `uint8[sequence_length,
step_bytes]`.

Why: Reverb's cost per stored step is mostly per column and per chunk, not per byte. One column
written in chunks of up to `MAX_CHUNK_LENGTH` steps (instead of the StructuredWriter's
auto-tuned chunks, which never grow beyond the sequence length) cuts the server's memory per
CartPole step several times and makes inserts cheaper (one cell per step).

Reading: `unpack(array, data_spec)` turns a `uint8[..., step_bytes]` array (numpy) back into
the nest; `PackedLayout.unpack_tf` does the same in a tf.data pipeline (a slice, `tf.bitcast`
and reshape per field). Every reader of this project (`get_dataset`, `as_dataset`, torch,
export, checkpoints) unpacks, so their items are the same in both layouts.

`PackedLayout` is the packed implementation of `replay_service.specs.layouts.Layout`. The
Reverb writers of packed rows live in `replay_service.backends.reverb.packed_writers`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tree

from replay_service.specs.layouts import PACKED, BatchRead, Layout, steps_of
from replay_service.specs.nests import flatten_with_paths, numpy_dtype

# Constant chunk length of a packed column, bounded so that a chunk holds about
# `CHUNK_BYTES` (a sample transfers whole chunks: long chunks of big steps cost bandwidth).
MAX_CHUNK_LENGTH = 64
CHUNK_BYTES = 8192


def chunk_length(step_bytes: int) -> int:
    """The constant chunk length of a packed column of `step_bytes` per step: as many steps
    as fit in `CHUNK_BYTES`, between 1 and `MAX_CHUNK_LENGTH` (a window may span several
    chunks)."""
    return max(1, min(MAX_CHUNK_LENGTH, CHUNK_BYTES // max(1, step_bytes)))


_NUMPY = (np.ndarray, np.generic)


class _Field:
    __slots__ = ("dtype", "nbytes", "path", "shape", "size", "start", "stop")

    def __init__(self, path: str, spec: Any, start: int) -> None:
        self.path = path
        self.dtype = np.dtype(numpy_dtype(spec)).newbyteorder("=")
        self.shape = tuple(int(d) for d in spec.shape)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self.nbytes = self.size * self.dtype.itemsize
        self.start = start
        self.stop = start + self.nbytes


class PackedLayout(Layout):
    """How the steps of a packed table are laid out: the "packed" `Layout`.

    Args:
      stored_spec: The per-step spec the table stores (`data_spec`, or `Masked(data_spec,
        mask)` for padded tables); TF specs or `ArraySpec`.

    Attributes:
      structure: `stored_spec`.
      fields: Per leaf (`tree.flatten` order): path, dtype, shape and byte range in a row.
      step_bytes: Bytes of one packed step.
      steps_apart: Each step's row decodes alone (`leaf(rows[:, i], index)`).
    """

    name = PACKED
    reverb_only = True
    steps_apart = True

    def __init__(self, stored_spec: Any) -> None:
        super().__init__(stored_spec)
        self.fields: list[_Field] = []
        offset = 0
        for path, leaf in flatten_with_paths(stored_spec):
            field = _Field(path, leaf, offset)
            self.fields.append(field)
            offset = field.stop
        self.step_bytes = offset
        self._dtypes = [f.dtype for f in self.fields]
        self._shapes = [f.shape for f in self.fields]

    def mismatch_notes(self) -> list[str]:
        """The layout, and how this spec's fields fill a row (a packed signature names only
        the row's bytes)."""
        fields = ", ".join(
            f"{f.path!r} {f.dtype.name}{list(f.shape)} {f.nbytes} B" for f in self.fields
        )
        return [
            f"this manager's layout is 'packed': its data_spec packs a step into "
            f"{self.step_bytes} bytes ({fields})"
        ]

    # ------------------------------------------------------------------------------ writing

    def pack(self, leaves: Sequence[Any]) -> np.ndarray:
        """One step's leaves (`tree.flatten` order of the stored step) as a `uint8` row.

        Raises:
          ValueError: If the number of leaves, a leaf's dtype or its shape differs from the
            spec (naming the field).
        """
        return self.encode_step(leaves if type(leaves) is list else list(leaves))

    def encode_step(self, step: Any) -> np.ndarray:
        """One step, given as a nest shaped like the stored spec or as its flat leaves in a
        list (`tree.flatten` order), as a `uint8` row: what a packed writer appends.

        Raises:
          ValueError: If the number of leaves, a leaf's dtype or its shape differs from the
            spec (naming the field).
        """
        leaves = step if type(step) is list else tree.flatten(step)
        if len(leaves) != len(self.fields):
            raise ValueError(
                f"a step of this table has {len(self.fields)} fields, got {len(leaves)}"
            )
        parts = []
        for leaf, dtype, shape in zip(leaves, self._dtypes, self._shapes, strict=True):
            if not isinstance(leaf, _NUMPY):
                leaf = np.asarray(leaf)
            if leaf.dtype != dtype or leaf.shape != shape:
                self._raise(leaves)
            parts.append(leaf.tobytes())
        return np.frombuffer(b"".join(parts), np.uint8)

    def pack_items(self, columns: Sequence[np.ndarray]) -> np.ndarray:
        """Items given as one array per field (`[num_items, sequence_length, *shape]`, in
        `tree.flatten` order) as packed rows `uint8[num_items, sequence_length, step_bytes]`."""
        parts = []
        for column, field in zip(columns, self.fields, strict=True):
            array = np.ascontiguousarray(column, dtype=field.dtype)
            lead = array.shape[: array.ndim - len(field.shape)]
            parts.append(array.view(np.uint8).reshape(*lead, field.nbytes))
        return np.concatenate(parts, axis=-1)

    def pack_nest(self, step: Any) -> np.ndarray:
        """`pack` of a step given as a nest shaped like the stored spec."""
        return self.pack(tree.flatten(step))

    def encode_columns(self, columns: Sequence[np.ndarray]) -> list[np.ndarray]:
        """`[pack_items(columns)]`: the one packed column."""
        return [self.pack_items(columns)]

    def writer_chunking(self, sequence_length: int) -> tuple[int, int]:
        """Constant chunks of `chunk_length(step_bytes)` steps, as the packed writers write,
        and at least one item's steps kept alive."""
        chunk = chunk_length(self.step_bytes)
        return max(chunk, sequence_length), chunk

    def _raise(self, leaves: Sequence[Any]) -> None:
        for leaf, field in zip(leaves, self.fields, strict=True):
            array = np.asarray(leaf)
            if array.dtype != field.dtype or array.shape != field.shape:
                raise ValueError(
                    f"field {field.path!r}: expected {field.dtype.name}{list(field.shape)}, "
                    f"got {array.dtype.name}{list(array.shape)}"
                )

    # ------------------------------------------------------------------------------ reading

    def unpack(self, rows: Any) -> Any:
        """numpy `uint8[..., step_bytes]` rows back into the stored nest of `[..., *shape]`
        arrays (views of `rows` where the alignment allows, else copies)."""
        return tree.unflatten_as(self.structure, self.unpack_leaves(rows))

    def decode_columns(self, columns: Sequence[np.ndarray], *, copy: bool = False) -> list[Any]:
        """`unpack_leaves` of the one packed column.

        Raises:
          ValueError: If `columns` is not one `uint8[..., step_bytes]` array.
        """
        if len(columns) != 1:
            raise ValueError(f"a packed table stores one column, got {len(columns)}")
        return self.unpack_leaves(columns[0], copy=copy)

    def unpack_leaves(self, rows: Any, *, copy: bool = False) -> list[np.ndarray]:
        """`unpack`'s leaves, in `fields` order.

        Args:
          rows: numpy `uint8[..., step_bytes]`.
          copy: Whether every leaf is a contiguous array of its own (else views of `rows`
            where the alignment allows).

        Returns:
          One `[..., *shape]` array per field.

        Raises:
          ValueError: If `rows` is not `uint8[..., step_bytes]`.
        """
        rows = self._checked(rows)
        lead = rows.shape[:-1]
        flat = rows.reshape(-1, self.step_bytes)
        return [self._leaf(flat, field, copy).reshape(*lead, *field.shape) for field in self.fields]

    def leaf(self, rows: Any, index: int) -> np.ndarray:
        """Field `index` (`fields` order) of numpy rows `uint8[..., step_bytes]`, as a
        contiguous array `[..., *shape]` of its own: one copy of only that field's bytes (e.g.
        of one step of every item: `leaf(rows[:, 0], index)`).

        Raises:
          ValueError: If `rows` is not `uint8[..., step_bytes]`.
        """
        rows = self._checked(rows)
        field = self.fields[index]
        return self._leaf(rows, field, True).reshape(*rows.shape[:-1], *field.shape)

    def _checked(self, rows: Any) -> np.ndarray:
        rows = np.asarray(rows)
        if rows.dtype != np.uint8 or rows.shape[-1:] != (self.step_bytes,):
            raise ValueError(
                f"packed rows must be uint8[..., {self.step_bytes}], got "
                f"{rows.dtype.name}{list(rows.shape)}"
            )
        return rows

    @staticmethod
    def _leaf(rows: np.ndarray, field: _Field, copy: bool) -> np.ndarray:
        """`field`'s bytes of `rows` viewed as its dtype (`[..., size]`); a copy if `copy` or
        where the alignment asks for one."""
        part = rows[..., field.start : field.stop]
        if copy:
            part = part.copy()
        elif field.dtype.itemsize > 1:
            part = np.ascontiguousarray(part)
        return part.view(field.dtype)

    def unpack_tf(self, rows: Any) -> Any:
        """`unpack` of a `tf.uint8` tensor `[..., step_bytes]` (static rank), in TF ops."""
        import tensorflow as tf

        lead = tf.shape(rows)[:-1]
        leaves = []
        for field in self.fields:
            part = rows[..., field.start : field.stop]
            size = field.dtype.itemsize
            if field.dtype == np.bool_:
                value = tf.cast(part, tf.bool)
            elif size == 1:
                value = tf.bitcast(part, tf.as_dtype(field.dtype))
            else:
                grouped = tf.reshape(part, tf.concat([lead, [field.size, size]], 0))
                value = tf.bitcast(grouped, tf.as_dtype(field.dtype))
            value = tf.reshape(value, tf.concat([lead, list(field.shape)], 0))
            leaves.append(value)
        return tf.nest.pack_sequence_as(self.structure, leaves)

    def batch_reader(
        self, max_step_bytes: int, read_nest: BatchRead, rows_reader: Callable[[Any], BatchRead]
    ) -> tuple[BatchRead, bool]:
        """The reader unpacks steps of up to `max_step_bytes` itself (`rows_reader(self)`, and
        the pipeline yields the rows); larger ones are unpacked by the pipeline."""
        if self.step_bytes > max_step_bytes:
            return read_nest, True
        return rows_reader(self), False

    # ---------------------------------------------------------------------------- signature

    def step_spec(self) -> Any:
        """`tf.TensorSpec([step_bytes], tf.uint8)`: one stored step."""
        import tensorflow as tf

        return tf.TensorSpec([self.step_bytes], tf.uint8, "packed")

    def signature(self, sequence_length: int) -> Any:
        """The table signature: `tf.TensorSpec([sequence_length, step_bytes], tf.uint8)`."""
        import tensorflow as tf

        return tf.TensorSpec([sequence_length, self.step_bytes], tf.uint8, "packed")

    def item_signature(self, sequence_length: int) -> Any:
        """`signature(sequence_length)`."""
        return self.signature(sequence_length)

    def describe(self, sequence_length: int) -> list[dict[str, Any]]:
        """`specs.describe_spec` of the signature, without TensorFlow."""
        return [{"path": "", "dtype": "uint8", "shape": [sequence_length, self.step_bytes]}]


def step_layout(signature: Any) -> PackedLayout:
    """The `PackedLayout` of a table's (nested) item signature: its steps without the leading
    time dimension."""
    return layout_of(steps_of(signature))


_LAYOUTS: dict[str, PackedLayout] = {}


def layout_of(stored_spec: Any) -> PackedLayout:
    """A (cached) `PackedLayout` of `stored_spec`."""
    key = repr(stored_spec)
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = _LAYOUTS[key] = PackedLayout(stored_spec)
    return layout


def unpack(array: Any, data_spec: Any, *, pad_end_of_episode: bool = False) -> Any:
    """Turns packed rows read from a packed table back into the step nest.

    For a plain `reverb.Client`: `client.sample(table)` (or a `reverb.TrajectoryDataset` built
    from the table signature, then `.numpy()`) yields `uint8[sequence_length, step_bytes]`
    per item; `unpack(item, data_spec)` returns the `Trajectory` of `[sequence_length, ...]`
    arrays (`Masked(Trajectory, mask)` with `pad_end_of_episode=True`). Leading dimensions
    (batch, time) are kept.

    Args:
      array: numpy `uint8[..., step_bytes]`.
      data_spec: The per-step data spec the buffer was created with.
      pad_end_of_episode: Whether the table is padded (its steps are `Masked`).

    Returns:
      The nest of numpy arrays.

    Raises:
      ValueError: If `array` is not `uint8` with `step_bytes` in its last dimension.
    """
    from replay_service.specs.windows import stored_spec

    return layout_of(stored_spec(data_spec, pad_end_of_episode)).unpack(array)

"""How a table stores steps: the `Layout` interface and the nested layout.

A layout is every decision about how a step is stored that does not depend on a backend: the
table signature, what a writer appends per step, how items read back become the step nest
again, and how an import chunks what it writes. Two implementations:

- `NestedLayout` ("nested", the default): one Reverb column per field of the step; what is
  stored is the nest itself, so reading unpacks nothing.
- `PackedLayout` ("packed", in `replay_service.specs.packed`): every field of a step in one
  `uint8` row.

The layout's name is the public spelling (`TableConfig.layout`, config files, checkpoint and
export metadata); `specs.layout_registry.resolve_layout` turns it into the object once, where a
table's configuration becomes a running table (the manager, `make_table`, a collector built on
its own), and the object is what writers, readers and export receive. The Reverb writers and
tf.data steps of each layout live in `replay_service.backends.reverb` (`layout_writers`,
`layout_datasets`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np
import tree

from replay_service.errors import ConfigError

NESTED = "nested"
PACKED = "packed"
LAYOUTS = (NESTED, PACKED)
# The manager's default: the layout of what exists (newest checkpoint, remote server), else
# packed for a new Reverb buffer (`backends.resolve_auto_layout`).
AUTO = "auto"
# Reads one sampled batch into what a reader yields (see `Layout.batch_reader`).
BatchRead = Callable[[Any], Any]


def check_layout(layout: Any, where: str = "layout") -> str:
    """Returns `layout` if it is a known layout name.

    Raises:
      ConfigError: Otherwise, listing the layouts.
    """
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ConfigError(f"{where} must be one of {list(LAYOUTS)}, got {layout!r}")
    return layout


class Layout(abc.ABC):
    """How the steps of a table are stored (see the module docstring).

    Args:
      stored_spec: The per-step spec the table stores (`data_spec`, or `Masked(data_spec,
        mask)` for padded tables); TF specs or `ArraySpec`.

    Attributes:
      structure: `stored_spec`.
    """

    name: ClassVar[str]
    """The public spelling: `TableConfig.layout`, and what checkpoint and export metadata store."""

    reverb_only: ClassVar[bool]
    """Whether only Reverb tables store steps this way (`Capability.PACKED_LAYOUT`)."""

    def __init__(self, stored_spec: Any) -> None:
        self.structure = stored_spec

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.structure!r})"

    # ---------------------------------------------------------------------------- the table

    @abc.abstractmethod
    def item_signature(self, sequence_length: int) -> Any:
        """The table signature of items of `sequence_length` steps. Imports TensorFlow."""

    @abc.abstractmethod
    def describe(self, sequence_length: int) -> list[dict[str, Any]]:
        """`specs.describe_spec` of `item_signature(sequence_length)`, without TensorFlow."""

    @abc.abstractmethod
    def step_spec(self) -> Any:
        """The spec of one stored step, as TF-Agents' `ReverbReplayBuffer` reads it."""

    def mismatch_notes(self) -> list[str]:
        """What a message about a table whose signature differs says first about the layout."""
        return [f"this manager's layout is {self.name!r}"]

    # ------------------------------------------------------------------------------ writing

    @abc.abstractmethod
    def encode_step(self, step: Any) -> Any:
        """What a writer appends for one step (a nest shaped like `structure`, or its
        `tree.flatten` leaves as a list).

        Raises:
          ValueError: If the step does not match `structure` (where the layout checks it).
        """

    @abc.abstractmethod
    def encode_columns(self, columns: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Items given as one array per field (`[num_items, sequence_length, *shape]`, in
        `tree.flatten` order) as the columns the table stores, the inverse of
        `decode_columns`."""

    @abc.abstractmethod
    def writer_chunking(self, sequence_length: int) -> tuple[int, int | None]:
        """`(num_keep_alive_refs, max_chunk_length)` of a `TrajectoryWriter` that writes whole
        items of `sequence_length` steps (an import); a max_chunk_length of None leaves the
        chunks to Reverb."""

    # ------------------------------------------------------------------------------ reading

    @abc.abstractmethod
    def unpack(self, rows: Any) -> Any:
        """A read item or batch (numpy, as the table stores it) back into the nest of
        `structure` with the same leading dimensions.

        Raises:
          ValueError: If `rows` is not what the layout stores.
        """

    @abc.abstractmethod
    def decode_columns(self, columns: Sequence[np.ndarray], *, copy: bool = False) -> list[Any]:
        """The stored columns of items or a batch (numpy) as one array per field of the nest,
        in `tree.flatten` order.

        Args:
          columns: What the table stores, one array per stored column.
          copy: Whether every field is a contiguous array of its own (else views where the
            layout allows).

        Raises:
          ValueError: If `columns` is not what the layout stores.
        """

    @abc.abstractmethod
    def batch_reader(
        self, max_step_bytes: int, read_nest: BatchRead, rows_reader: Callable[[Any], BatchRead]
    ) -> tuple[BatchRead, bool]:
        """Chooses, once per stream, who unpacks the batches of a reader that can unpack
        packed rows itself (in numpy).

        Args:
          max_step_bytes: The largest packed step the reader unpacks itself.
          read_nest: Reads a batch whose data the pipeline yields as the nest's leaves.
          rows_reader: Returns the reader of batches whose data is the packed rows of the
            layout it is given.

        Returns:
          `(read, unpack)`: the reader of every batch, and whether the pipeline unpacks the
          batches (`datasets.read_pipeline`'s `unpack`).
        """


class NestedLayout(Layout):
    """The default layout: one Reverb column per field; what is stored is the step nest."""

    name = NESTED
    reverb_only = False

    def item_signature(self, sequence_length: int) -> Any:
        """`specs.table_signature(structure, sequence_length)`."""
        from replay_service.specs.nests import table_signature

        return table_signature(self.structure, sequence_length)

    def describe(self, sequence_length: int) -> list[dict[str, Any]]:
        """Each field of `structure` with a leading dimension of `sequence_length`."""
        from replay_service.specs.nests import describe_spec

        return [
            {**field, "shape": [sequence_length, *field["shape"]]}
            for field in describe_spec(self.structure)
        ]

    def step_spec(self) -> Any:
        """`structure`."""
        return self.structure

    def encode_step(self, step: Any) -> Any:
        """`step` itself."""
        return step

    def encode_columns(self, columns: Sequence[np.ndarray]) -> list[np.ndarray]:
        """`columns` themselves."""
        return list(columns)

    def writer_chunking(self, sequence_length: int) -> tuple[int, None]:
        """The item's steps kept alive; Reverb's own chunks."""
        return sequence_length, None

    def unpack(self, rows: Any) -> Any:
        """`rows` itself: a nested table stores the nest."""
        return rows

    def decode_columns(self, columns: Sequence[np.ndarray], *, copy: bool = False) -> list[Any]:
        """`columns` themselves (copies if `copy`)."""
        if copy:
            return [np.array(column) for column in columns]
        return list(columns)

    def batch_reader(
        self, max_step_bytes: int, read_nest: BatchRead, rows_reader: Callable[[Any], BatchRead]
    ) -> tuple[BatchRead, bool]:
        """`(read_nest, True)`: the pipeline yields the nest."""
        return read_nest, True


def steps_of(signature: Any) -> Any:
    """The per-step spec of an item signature: each leaf as an `ArraySpec` without its leading
    (time) dimension."""
    from replay_service.specs.arrays import ArraySpec
    from replay_service.specs.nests import numpy_dtype

    return tree.map_structure(
        lambda s: ArraySpec(tuple(int(d) for d in s.shape[1:]), numpy_dtype(s), "step"),
        signature,
    )


def signature_layout(signature: Any) -> str | None:
    """The layout of a Reverb table from its signature: "packed" for one `uint8[sequence_length,
    step_bytes]` tensor (a packed table's), "nested" for any other signature, None for a table
    without one.

    Args:
      signature: A table's `signature` (its `TableInfo.signature`): a nest of `tf.TensorSpec`s.
    """
    if signature is None:
        return None
    dtype = getattr(signature, "dtype", None)
    shape = getattr(signature, "shape", None)
    if getattr(dtype, "name", None) == "uint8" and shape is not None and len(shape) == 2:
        return PACKED
    return NESTED

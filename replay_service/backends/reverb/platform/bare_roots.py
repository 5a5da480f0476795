"""Bare Reverb checkpoint roots, as `DefaultCheckpointer(path)` writes them, and their tables.

Reverb's `DefaultCheckpointer(path)` (as used by TF-Agents and sbsim) writes checkpoints into
time-named subdirectories of `path`. `bare_checkpoints` lists the complete ones,
`bare_checkpoint_dirs` also those a save left without `DONE`, `read_stored_tables` reads each
table's name, capacity, signature, item count and the items' sequence length from the files,
`read_column_types` the dtype and per-step shape of each column from the stored chunks (a table
without a signature, as sbsim's, says nothing else about what it holds), and
`copy_with_signature` copies one with a new table signature (TF-Agents stores `[None, ...]`;
replay_service's tables have the sequence length).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from typing import Any

from replay_service.backends.reverb.platform.checkpoint_files import (
    CHUNKS_FILE,
    COMPRESSION,
    ITEMS_FILE,
    TABLES_FILE,
    is_reverb_checkpoint,
    iter_records,
    read_records,
)
from replay_service.backends.reverb.platform.version import require_supported_reverb
from replay_service.errors import CheckpointError
from replay_service.storage.files import DONE_FILE

# How `DefaultCheckpointer` names a checkpoint: `absl::FormatTime(absl::Now())`, RFC 3339 with
# nanoseconds and the local UTC offset, e.g. `2024-01-31T12:00:00.123456789+00:00`.
_CHECKPOINT_NAME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?([+-]\d{2}:\d{2}|Z)")


@dataclasses.dataclass(frozen=True)
class StoredTable:
    """One table of a Reverb checkpoint, as read from its files.

    Attributes:
      name: Table name.
      max_size: Capacity.
      num_items: Items stored.
      sequence_length: Steps per item, from the items' trajectories; None for an empty table.
      signature: The decoded table signature (a nest of `tf.TensorSpec`), or None.
    """

    name: str
    max_size: int
    num_items: int
    sequence_length: int | None
    signature: Any


def bare_checkpoints(root: str) -> list[str]:
    """The complete Reverb checkpoints of a root written by Reverb's `DefaultCheckpointer`.

    `DefaultCheckpointer(path)` writes each checkpoint into a subdirectory of `path` named by
    its UTC time (e.g. `2024-01-31T12:00:00.000000000+00:00`) and loads the one whose name is
    the largest; the same order is used here.

    Args:
      root: A directory.

    Returns:
      The paths of the subdirectories holding `DONE`, oldest (smallest name) first; empty if
      `root` is not a directory.
    """
    if not os.path.isdir(root):
        return []
    found = [os.path.join(root, name) for name in sorted(os.listdir(root))]
    return [path for path in found if os.path.isdir(path) and is_reverb_checkpoint(path)]


def bare_checkpoint_dirs(root: str) -> list[str]:
    """The checkpoint directories of a bare Reverb checkpoint root, complete or not.

    A directory counts if it holds `DONE` or is named as `DefaultCheckpointer` names
    checkpoints (a save that has not finished, or died, leaves such a directory without
    `DONE`). Reverb loads the largest name among those with `DONE`.

    Args:
      root: A directory.

    Returns:
      Their paths, oldest (smallest name) first; empty if `root` is not a directory.
    """
    if not os.path.isdir(root):
        return []
    found = [os.path.join(root, name) for name in sorted(os.listdir(root))]
    return [
        path
        for path in found
        if os.path.isdir(path)
        and not os.path.islink(path)
        and (is_reverb_checkpoint(path) or _CHECKPOINT_NAME.fullmatch(os.path.basename(path)))
    ]


@dataclasses.dataclass(frozen=True)
class ColumnType:
    """What one column of a table's items holds, as read from the stored chunks.

    Attributes:
      dtype: The dtype's name, e.g. "float32".
      shape: The shape of one step.
    """

    dtype: str
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


def read_column_types(checkpoint_path: str, table_name: str) -> list[ColumnType]:
    """The dtype and per-step shape of every column of a table's items, from the stored chunks.

    Each item is a list of columns (the flattened data spec, in `tf.nest` order), each made of
    slices of chunks; a chunk stores each of its tensors with its dtype and shape
    `[chunk length, *step shape]`. Only those headers are read, not the (compressed) data.

    Args:
      checkpoint_path: A complete Reverb checkpoint directory.
      table_name: The table whose items to describe.

    Returns:
      One `ColumnType` per column; empty if the table holds no items.

    Raises:
      CheckpointError: If a file cannot be read, items differ in their number of columns, a
        chunk an item refers to is missing, or a column's chunks differ in dtype or shape.
    """
    import tensorflow as tf
    from reverb.cc import schema_pb2

    require_supported_reverb()
    widths: set[int] = set()
    wanted: dict[int, set[tuple[int, int]]] = {}  # chunk key -> (column, tensor index)
    for record in iter_records(checkpoint_path, ITEMS_FILE):
        item = schema_pb2.PrioritizedItem.FromString(record)
        if item.table != table_name:
            continue
        widths.add(len(item.flat_trajectory.columns))
        for column, data in enumerate(item.flat_trajectory.columns):
            for piece in data.chunk_slices:
                wanted.setdefault(piece.chunk_key, set()).add((column, piece.index))
    if not widths:
        return []
    if len(widths) > 1:
        raise CheckpointError(
            f"table {table_name!r} of {checkpoint_path!r} holds items of {sorted(widths)} "
            "columns; replay_service stores items of one data spec"
        )
    found: list[set[ColumnType]] = [set() for _ in range(widths.pop())]
    for record in iter_records(checkpoint_path, CHUNKS_FILE):
        chunk = schema_pb2.ChunkData.FromString(record)
        uses = wanted.pop(chunk.chunk_key, None)
        if uses is None:
            continue
        tensors = chunk.data.tensors or chunk.deprecated_data
        for column, index in uses:
            if index >= len(tensors):
                raise CheckpointError(
                    f"{os.path.join(checkpoint_path, CHUNKS_FILE)!r}: chunk {chunk.chunk_key} has "
                    f"{len(tensors)} tensors; an item of table {table_name!r} reads tensor {index}"
                )
            tensor = tensors[index]
            shape = tuple(int(d.size) for d in tensor.tensor_shape.dim)[1:]
            found[column].add(ColumnType(tf.as_dtype(tensor.dtype).name, shape))
    if wanted:
        raise CheckpointError(
            f"{os.path.join(checkpoint_path, CHUNKS_FILE)!r} lacks {len(wanted)} chunks that items "
            f"of table {table_name!r} refer to; the checkpoint is damaged"
        )
    for column, types in enumerate(found):
        if len(types) != 1:
            raise CheckpointError(
                f"column {column} of the items of table {table_name!r} in {checkpoint_path!r} is "
                f"stored as {sorted(map(str, types))}; replay_service stores one data spec"
            )
    return [types.pop() for types in found]


def read_stored_tables(checkpoint_path: str) -> list[StoredTable]:
    """Reads the tables of a complete Reverb checkpoint: names, sizes, signatures, item lengths.

    Args:
      checkpoint_path: A Reverb checkpoint directory (with `DONE`).

    Returns:
      One `StoredTable` per table, in the checkpoint's order.

    Raises:
      CheckpointError: If a file cannot be read, or a table's items differ in length.
    """
    from reverb.cc import schema_pb2
    from reverb.cc.checkpointing import checkpoint_pb2
    from tensorflow.python.saved_model import nested_structure_coder

    require_supported_reverb()
    tables = [
        checkpoint_pb2.PriorityTableCheckpoint.FromString(record)
        for record in read_records(checkpoint_path, TABLES_FILE)
    ]
    counts: dict[str, int] = {}
    lengths: dict[str, set[int]] = {}
    for record in read_records(checkpoint_path, ITEMS_FILE):
        item = schema_pb2.PrioritizedItem.FromString(record)
        counts[item.table] = counts.get(item.table, 0) + 1
        for column in item.flat_trajectory.columns:
            length = sum(s.length for s in column.chunk_slices)
            lengths.setdefault(item.table, set()).add(1 if column.squeeze else length)
    result = []
    for table in tables:
        found = lengths.get(table.table_name, set())
        if len(found) > 1:
            raise CheckpointError(
                f"table {table.table_name!r} of {checkpoint_path!r} holds items of different "
                f"lengths {sorted(found)}; replay_service stores items of one sequence length"
            )
        signature = (
            nested_structure_coder.decode_proto(table.signature)
            if table.HasField("signature")
            else None
        )
        result.append(
            StoredTable(
                name=table.table_name,
                max_size=int(table.max_size),
                num_items=counts.get(table.table_name, 0),
                sequence_length=next(iter(found)) if found else None,
                signature=signature,
            )
        )
    return result


def copy_with_signature(checkpoint_path: str, table_name: str, signature: Any, dest: str) -> None:
    """Copies a Reverb checkpoint into `dest` (created) with a new signature for one table.

    Reverb restores a table's signature from the checkpoint; TF-Agents stores an unknown
    leading dimension (`[None, ...]`), replay_service the sequence length. Items and chunks are
    copied as they are; only `tables.tfrecord` is rewritten.

    Args:
      checkpoint_path: A complete Reverb checkpoint directory.
      table_name: The table whose signature to replace.
      signature: A nest of `tf.TensorSpec` (leading dimension: the sequence length).
      dest: The directory to create.

    Raises:
      CheckpointError: If the checkpoint cannot be read or the copy written.
    """
    import tensorflow as tf
    from reverb.cc.checkpointing import checkpoint_pb2
    from tensorflow.python.saved_model import nested_structure_coder

    encoded = nested_structure_coder.encode_structure(signature).SerializeToString()
    tables = [
        checkpoint_pb2.PriorityTableCheckpoint.FromString(record)
        for record in read_records(checkpoint_path, TABLES_FILE)
    ]
    try:
        os.makedirs(dest)
        for name in (CHUNKS_FILE, ITEMS_FILE):
            shutil.copy2(os.path.join(checkpoint_path, name), os.path.join(dest, name))
        options = tf.io.TFRecordOptions(compression_type=COMPRESSION)
        with tf.io.TFRecordWriter(os.path.join(dest, TABLES_FILE), options) as writer:
            for table in tables:
                if table.table_name == table_name:
                    table.signature.ParseFromString(encoded)
                writer.write(table.SerializeToString())
        with open(os.path.join(dest, DONE_FILE), "w", encoding="utf-8"):
            pass
    except (OSError, tf.errors.OpError) as e:
        raise CheckpointError(f"cannot copy {checkpoint_path!r} to {dest!r}: {e}") from e

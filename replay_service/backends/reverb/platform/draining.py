"""Reading every item of a checkpoint's table once, decoded, as the export needs them.

`read_checkpoint_items` restores a copy of the checkpoint (the table made FIFO, each item
sampleable once) into a throw-away Reverb server and samples it dry, then puts the decoded items
back into the checkpoint's order, with their priorities and sample counts.
"""

from __future__ import annotations

import logging
import os
import tempfile
import warnings
from typing import Any

import numpy as np

from replay_service.backends.reverb.platform.checkpoint_files import (
    CHUNKS_FILE,
    COMPRESSION,
    ITEMS_FILE,
    TABLES_FILE,
    read_records,
)
from replay_service.backends.reverb.platform.version import require_supported_reverb
from replay_service.errors import CheckpointError
from replay_service.storage.files import DONE_FILE, link_or_copy

_log = logging.getLogger(__name__)

# Items decoded per batch while draining a checkpoint copy.
_READ_BATCH = 256
_UNLIMITED_DIFF = float(np.finfo(np.float64).max)


def read_checkpoint_items(
    checkpoint_path: str, table_name: str, signature: Any, timeout: float | None
) -> tuple[list[Any], Any, Any]:
    """Reads every item of `table_name` from a complete Reverb checkpoint (see module docs).

    Args:
      checkpoint_path: Directory holding `tables.tfrecord`, `items.tfrecord`,
        `chunks.tfrecord` and `DONE`.
      table_name: Table to read.
      signature: The table signature (nest of `tf.TensorSpec`, leading `sequence_length`).
      timeout: Seconds to wait for the throw-away server's items; None waits forever.

    Returns:
      `(data, priorities, times_sampled)`, oldest item first: one numpy array per flattened
      signature field (`[num_items, sequence_length, ...]`), float64 and int32 arrays.

    Raises:
      CheckpointError: If the checkpoint is unreadable here, lacks the table, or its items
        cannot all be decoded exactly once.
    """
    require_supported_reverb()
    if not os.path.isfile(os.path.join(checkpoint_path, DONE_FILE)):
        raise CheckpointError(
            f"checkpoint {checkpoint_path!r} is not readable from this machine or incomplete; "
            "export needs the checkpoint files (run it where the server writes them)"
        )
    table = _read_table(checkpoint_path, table_name)
    records = _skip_foreign_items(
        checkpoint_path, table_name, signature, _read_items(checkpoint_path, table_name)
    )
    keys = np.array([r.key for r in records], dtype=np.uint64)
    priorities = np.array([r.priority for r in records], dtype=np.float64)
    times_sampled = np.array([r.times_sampled for r in records], dtype=np.int32)
    with tempfile.TemporaryDirectory(prefix="replay_service_export_") as tmp:
        copy = _drainable_copy(checkpoint_path, table, records, tmp)
        data, sampled_keys = _drain(copy, table_name, signature, len(records), tmp, timeout)
    order = _positions(keys, sampled_keys, checkpoint_path)
    return [np.ascontiguousarray(a[order]) for a in data], priorities, times_sampled


def _skip_foreign_items(
    checkpoint_path: str, table_name: str, signature: Any, records: list[Any]
) -> list[Any]:
    """The item records whose number of columns is the signature's, warning about the others.

    Reverb stores what a writer sends without checking it against the table signature when the
    writer does not (TF-Agents' observers pass `validate_items=False`): a nested `Trajectory`
    in a packed table, say. Such an item cannot be decoded with the signature; leaving it out
    keeps the others readable.

    Args:
      checkpoint_path: The checkpoint, for the warning.
      table_name: The table, for the warning.
      signature: The table signature.
      records: The table's item records.

    Returns:
      The records of the items that have the signature's number of columns, in their order.
    """
    import tensorflow as tf

    expected = len(tf.nest.flatten(signature))
    kept = [r for r in records if len(r.flat_trajectory.columns) == expected]
    if len(kept) != len(records):
        foreign = [r for r in records if len(r.flat_trajectory.columns) != expected]
        counts = sorted({len(r.flat_trajectory.columns) for r in foreign})
        message = (
            f"checkpoint {checkpoint_path!r}: table {table_name!r} holds {len(foreign)} of "
            f"{len(records)} items with {counts} columns where its signature has {expected} "
            f"(keys {[r.key for r in foreign[:5]]}{', ...' if len(foreign) > 5 else ''}); they "
            "were written without a check against the table signature (such as TF-Agents' "
            "ReverbAddTrajectoryObserver on a layout='packed' table), cannot be decoded and "
            f"are left out: {len(kept)} items are read"
        )
        _log.warning("%s", message)
        warnings.warn(message, stacklevel=3)
    return kept


def _read_table(checkpoint_path: str, table_name: str) -> Any:
    from reverb.cc.checkpointing import checkpoint_pb2

    records = read_records(checkpoint_path, TABLES_FILE)
    tables = [checkpoint_pb2.PriorityTableCheckpoint.FromString(r) for r in records]
    for table in tables:
        if table.table_name == table_name:
            return table
    raise CheckpointError(
        f"checkpoint {checkpoint_path!r} has no table {table_name!r}; it has "
        f"{sorted(t.table_name for t in tables)}"
    )


def _read_items(checkpoint_path: str, table_name: str) -> list[Any]:
    from reverb.cc import schema_pb2

    records = [
        schema_pb2.PrioritizedItem.FromString(r) for r in read_records(checkpoint_path, ITEMS_FILE)
    ]
    records = [r for r in records if r.table == table_name]
    return sorted(records, key=lambda r: (r.inserted_at.seconds, r.inserted_at.nanos))


def _drainable_copy(checkpoint_path: str, table: Any, records: list[Any], tmp: str) -> str:
    import tensorflow as tf

    copy = os.path.join(tmp, "checkpoint")
    os.makedirs(copy)
    drained = type(table)()
    drained.CopyFrom(table)
    drained.sampler.Clear()
    drained.sampler.fifo = True
    drained.sampler.is_deterministic = True
    drained.max_times_sampled = 1
    drained.max_size = max(drained.max_size, len(records), 1)
    limiter = drained.rate_limiter
    limiter.samples_per_insert = 1.0
    limiter.min_diff = -_UNLIMITED_DIFF
    limiter.max_diff = _UNLIMITED_DIFF
    limiter.min_size_to_sample = 1
    options = tf.io.TFRecordOptions(compression_type=COMPRESSION)
    with tf.io.TFRecordWriter(os.path.join(copy, TABLES_FILE), options) as writer:
        writer.write(drained.SerializeToString())
    with tf.io.TFRecordWriter(os.path.join(copy, ITEMS_FILE), options) as writer:
        for record in records:
            fresh = type(record)()
            fresh.CopyFrom(record)
            fresh.times_sampled = 0
            writer.write(fresh.SerializeToString())
    link_or_copy(os.path.join(checkpoint_path, CHUNKS_FILE), os.path.join(copy, CHUNKS_FILE))
    with open(os.path.join(copy, DONE_FILE), "w", encoding="utf-8"):
        pass
    return copy


def _drain(
    copy: str, table_name: str, signature: Any, count: int, tmp: str, timeout: float | None
) -> tuple[list[np.ndarray], np.ndarray]:
    import reverb
    import tensorflow as tf

    from replay_service.backends.reverb.connection import pick_free_port
    from replay_service.config.options import to_ms

    flat = tf.nest.flatten(signature)
    if count == 0:
        return [np.zeros([0, *s.shape], s.dtype.as_numpy_dtype) for s in flat], np.zeros(
            [0], np.uint64
        )
    placeholder = reverb.Table(
        name=table_name,
        sampler=reverb.selectors.Fifo(),
        remover=reverb.selectors.Fifo(),
        max_size=count,
        rate_limiter=reverb.rate_limiters.MinSize(1),
        max_times_sampled=1,
        signature=signature,
    )
    checkpointer = reverb.checkpointers.DefaultCheckpointer(
        os.path.join(tmp, "root"), fallback_checkpoint_path=copy
    )
    try:
        server = reverb.Server([placeholder], port=pick_free_port(), checkpointer=checkpointer)
    except (RuntimeError, ValueError) as e:
        raise CheckpointError(f"Reverb cannot restore a copy of the checkpoint: {e}") from e
    try:
        timeout_ms = to_ms(timeout)
        dataset = reverb.TrajectoryDataset(
            server_address=server.localhost_client().server_address,
            table=table_name,
            dtypes=tf.nest.map_structure(lambda s: s.dtype, signature),
            shapes=tf.nest.map_structure(lambda s: s.shape, signature),
            max_in_flight_samples_per_worker=min(count, _READ_BATCH),
            num_workers_per_iterator=1,
            max_samples=count,
            rate_limiter_timeout_ms=-1 if timeout_ms is None else timeout_ms,
        ).batch(_READ_BATCH)
        batches = list(dataset)
    finally:
        server.stop()
    keys = np.concatenate([b.info.key.numpy() for b in batches]) if batches else np.zeros([0])
    data = [
        np.concatenate([leaf.numpy() for leaf in column])
        for column in zip(*(tf.nest.flatten(b.data) for b in batches), strict=True)
    ]
    return data, keys.astype(np.uint64)


def _positions(keys: np.ndarray, sampled: np.ndarray, checkpoint_path: str) -> np.ndarray:
    """Returns `order` such that `sampled[order]` follows `keys`."""
    if len(sampled) != len(keys) or len(np.unique(sampled)) != len(sampled):
        raise CheckpointError(
            f"checkpoint {checkpoint_path!r}: read {len(sampled)} items "
            f"({len(np.unique(sampled))} distinct) of {len(keys)}; the checkpoint is corrupt"
        )
    sorter = np.argsort(sampled)
    found = np.searchsorted(sampled, keys, sorter=sorter)
    index = sorter[np.minimum(found, len(sampled) - 1)]
    if not np.array_equal(sampled[index], keys):
        raise CheckpointError(
            f"checkpoint {checkpoint_path!r}: the decoded items do not match its item records"
        )
    return index

"""Restoring a checkpoint with the table options configured now, not the stored ones.

Reverb restores each table's sampler, remover, `max_times_sampled` and rate limiter from the
checkpoint, together with the limiter's insert and sample counters, and ignores the table it is
given. Two surprises follow: a changed sampler or rate limiter is silently not applied, and a
`SampleToInsertRatio` table can stall right after restore, because its counters describe
another run (a starter buffer filled without sampling, say, holds N inserts and 0 samples, so
inserts block until about `samples_per_insert * N` samples are drawn).

`restore_view` therefore hands Reverb a view of the checkpoint: the same chunks and items (hard
links, nothing copied) and a rewritten `tables.tfrecord` in which every table takes the options
of the table configured now, and its counters are rebased to the middle of the limiter's band,
as for a table that has just reached `min_size_to_sample`: sampling can start at once (given
enough items) and the next inserts are not blocked. Items, priorities and capacity are kept.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from typing import Any

import reverb

from replay_service.errors import CheckpointError

TABLES_FILE = "tables.tfrecord"
_COMPRESSION = "ZLIB"


def restore_view(checkpoint_path: str, tables: Sequence[reverb.Table], view_dir: str) -> str:
    """Writes a view of `checkpoint_path` in which each table has the options of `tables`.

    Args:
      checkpoint_path: A complete Reverb checkpoint directory (with `DONE`).
      tables: The tables configured now; a stored table with another name keeps its options.
      view_dir: Directory to create (replaced if it exists); delete it once the server runs.

    Returns:
      `view_dir`, to pass to Reverb as the checkpoint to load.

    Raises:
      CheckpointError: If the checkpoint cannot be read or the view cannot be written.
    """
    import tensorflow as tf
    from reverb.cc.checkpointing import checkpoint_pb2

    wanted = {table.name: table.info for table in tables}
    try:
        records = [
            record.numpy()
            for record in tf.data.TFRecordDataset(
                os.path.join(checkpoint_path, TABLES_FILE), compression_type=_COMPRESSION
            )
        ]
    except (tf.errors.OpError, OSError) as e:
        raise CheckpointError(f"cannot read the tables of {checkpoint_path!r}: {e}") from e
    try:
        if os.path.isdir(view_dir):
            shutil.rmtree(view_dir)
        os.makedirs(view_dir)
        for name in os.listdir(checkpoint_path):
            if name != TABLES_FILE:
                _link_or_copy(os.path.join(checkpoint_path, name), os.path.join(view_dir, name))
        options = tf.io.TFRecordOptions(compression_type=_COMPRESSION)
        with tf.io.TFRecordWriter(os.path.join(view_dir, TABLES_FILE), options) as writer:
            for record in records:
                table = checkpoint_pb2.PriorityTableCheckpoint()
                table.ParseFromString(record)
                if table.table_name in wanted:
                    apply_options(table, wanted[table.table_name])
                writer.write(table.SerializeToString())
    except (OSError, tf.errors.OpError) as e:
        raise CheckpointError(f"cannot prepare {checkpoint_path!r} for restore: {e}") from e
    return view_dir


def apply_options(table: Any, info: Any) -> None:
    """Gives a stored `PriorityTableCheckpoint` the options of `info` and rebased counters.

    Args:
      table: The stored table (modified in place).
      info: `reverb.Table.info` of the table configured now.
    """
    table.sampler.CopyFrom(info.sampler_options)
    table.remover.CopyFrom(info.remover_options)
    table.max_times_sampled = info.max_times_sampled
    limiter, configured = table.rate_limiter, info.rate_limiter_info
    limiter.samples_per_insert = configured.samples_per_insert
    limiter.min_diff = configured.min_diff
    limiter.max_diff = configured.max_diff
    limiter.min_size_to_sample = configured.min_size_to_sample
    limiter.sample_count = rebased_sample_count(
        limiter.insert_count,
        configured.samples_per_insert,
        configured.min_diff,
        configured.max_diff,
    )


def rebased_sample_count(
    inserts: int, samples_per_insert: float, min_diff: float, max_diff: float
) -> int:
    """The sample count that puts `inserts * samples_per_insert - samples` mid-band.

    Reverb lets a sample through while that difference stays >= `min_diff` and an insert while
    it stays <= `max_diff`; the middle of the band is `samples_per_insert * min_size_to_sample`
    for a `SampleToInsertRatio` limiter. An unbounded band (`MinSize`) centres on 0.

    Returns:
      The rebased sample count, never negative.
    """
    centre = 0.0 if max_diff - min_diff > 1e300 else (min_diff + max_diff) / 2.0
    return max(0, round(inserts * samples_per_insert - centre))


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)

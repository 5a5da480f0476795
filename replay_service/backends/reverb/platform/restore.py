"""Restoring a checkpoint with the table options configured now: the restore view.

Reverb restores each table's sampler, remover, `max_times_sampled` and rate limiter from the
checkpoint, together with the limiter's insert and sample counters, and ignores the table it is
given. `restore_view` hands Reverb a view of the checkpoint (hard links) with a rewritten
`tables.tfrecord`: the options configured now, counters rebased to the middle of the limiter's
band (see `rebased_sample_count`). Reverb applies `max_times_sampled` only when an item is
sampled, so items already sampled as often as a lower limit configured now allows are left out of
the view (the limiter counts them as deleted).
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Sequence
from typing import Any

from replay_service.backends.reverb.platform.checkpoint_files import (
    COMPRESSION,
    ITEMS_FILE,
    TABLES_FILE,
    read_records,
)
from replay_service.backends.reverb.platform.version import require_supported_reverb
from replay_service.errors import CheckpointError
from replay_service.storage.files import link_or_copy


def restore_view(checkpoint_path: str, tables: Sequence[Any], view_dir: str) -> tuple[str, int]:
    """Writes a view of `checkpoint_path` in which each table has the options of `tables`.

    Args:
      checkpoint_path: A complete Reverb checkpoint directory (with `DONE`).
      tables: The tables configured now; a stored table with another name keeps its options.
      view_dir: Directory to create (replaced if it exists); delete it once the server runs.

    Returns:
      `(view_dir, dropped)`: the directory to pass to Reverb as the checkpoint to load, and
      the number of items left out because a lower `max_times_sampled` is configured now.

    Raises:
      CheckpointError: If the checkpoint cannot be read or the view cannot be written.
    """
    import tensorflow as tf
    from reverb.cc.checkpointing import checkpoint_pb2

    require_supported_reverb()
    wanted = {table.name: table.info for table in tables}
    stored = [
        checkpoint_pb2.PriorityTableCheckpoint.FromString(record)
        for record in read_records(checkpoint_path, TABLES_FILE)
    ]
    limits = {
        table.table_name: wanted[table.table_name].max_times_sampled
        for table in stored
        if table.table_name in wanted
        and lowers_max_times_sampled(
            table.max_times_sampled, wanted[table.table_name].max_times_sampled
        )
    }
    items = None
    if limits:
        items, dropped = _items_within_limits(checkpoint_path, limits)
        for table in stored:
            table.rate_limiter.delete_count += dropped.get(table.table_name, 0)
    try:
        if os.path.isdir(view_dir):
            shutil.rmtree(view_dir)
        os.makedirs(view_dir)
        rewritten = {TABLES_FILE} if items is None else {TABLES_FILE, ITEMS_FILE}
        for name in os.listdir(checkpoint_path):
            # Reverb reads only its own files, which are regular (verified before); anything
            # else there (a named pipe...) is foreign and left out of the view, never opened.
            source_mode = os.lstat(os.path.join(checkpoint_path, name)).st_mode
            if name not in rewritten and stat.S_ISREG(source_mode):
                link_or_copy(os.path.join(checkpoint_path, name), os.path.join(view_dir, name))
        options = tf.io.TFRecordOptions(compression_type=COMPRESSION)
        with tf.io.TFRecordWriter(os.path.join(view_dir, TABLES_FILE), options) as writer:
            for table in stored:
                if table.table_name in wanted:
                    apply_options(table, wanted[table.table_name])
                writer.write(table.SerializeToString())
        if items is not None:
            with tf.io.TFRecordWriter(os.path.join(view_dir, ITEMS_FILE), options) as writer:
                for record in items:
                    writer.write(record)
    except (OSError, tf.errors.OpError) as e:
        raise CheckpointError(f"cannot prepare {checkpoint_path!r} for restore: {e}") from e
    return view_dir, sum(dropped.values()) if items is not None else 0


def lowers_max_times_sampled(stored: int, configured: int) -> bool:
    """Whether items of a table stored with `max_times_sampled=stored` may have been sampled
    `configured` times or more (0 means unlimited), so a restore must drop them.

    Returns:
      True if `configured` is a limit and `stored` was none or a higher one.
    """
    return configured > 0 and (stored == 0 or stored > configured)


def _items_within_limits(
    checkpoint_path: str, limits: dict[str, int]
) -> tuple[list[bytes], dict[str, int]]:
    """The serialized item records of a checkpoint without those sampled as often as their
    table's limit allows.

    Args:
      checkpoint_path: The checkpoint directory.
      limits: Table name -> the `max_times_sampled` configured now (> 0).

    Returns:
      `(records kept, in stored order; table name -> items dropped)`.

    Raises:
      CheckpointError: If `items.tfrecord` cannot be read or parsed.
    """
    from google.protobuf.message import DecodeError
    from reverb.cc import schema_pb2

    kept: list[bytes] = []
    dropped: dict[str, int] = {}
    for record in read_records(checkpoint_path, ITEMS_FILE):
        try:
            item = schema_pb2.PrioritizedItem.FromString(record)
        except DecodeError as e:
            raise CheckpointError(
                f"cannot parse an item of {os.path.join(checkpoint_path, ITEMS_FILE)!r}: {e}"
            ) from e
        limit = limits.get(item.table)
        if limit is not None and item.times_sampled >= limit:
            dropped[item.table] = dropped.get(item.table, 0) + 1
        else:
            kept.append(record)
    return kept, dropped


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

"""Everything replay_service knows about Reverb's private formats and behaviour, in one place.

Reverb does not document its checkpoint files or offer a way to stop a server from confirming
writes while it still answers its own process. replay_service relies on both, so this module
holds that knowledge and checks the installed version against the versions it was verified on
(`require_supported_reverb`):

- Checkpoint files. Reverb's `DefaultCheckpointer` writes a directory with `tables.tfrecord`,
  `chunks.tfrecord` and `items.tfrecord` (TFRecord files, each one ZLIB stream; one record per
  table, chunk and item) and then an empty `DONE` file. `DONE` only says that Reverb finished:
  on a full disk it still writes `DONE` after a truncated file. `verify_files` therefore reads
  every file to its end (the ZLIB stream carries an Adler-32 checksum; every record's length
  must fit), counts the items and hashes each file. After `DONE`, a save lists the root and
  deletes every older entry (it keeps only the newest): a directory moved away in that moment
  makes the save fail with "<path> not found", and two saves at once can delete each other's
  directory. `is_settled_checkpoint` therefore waits `SAVE_SETTLE_S` after `DONE` before a
  checkpoint that a client requested may be moved, and `is_concurrent_save_error` recognizes
  the failure so that a client can ask again.
- Restoring with today's table options. Reverb restores each table's sampler, remover,
  `max_times_sampled` and rate limiter from the checkpoint, together with the limiter's insert
  and sample counters, and ignores the table it is given. `restore_view` hands Reverb a view of
  the checkpoint (hard links) with a rewritten `tables.tfrecord`: the options configured now,
  counters rebased to the middle of the limiter's band (see `rebased_sample_count`). Reverb
  applies `max_times_sampled` only when an item is sampled, so items already sampled as often
  as a lower limit configured now allows are left out of the view (the limiter counts them as
  deleted).
- Stopping confirmations. Reverb offers no way to refuse inserts on a running server, and
  `Server.stop()` also stops answering the process's own client. `close_foreign_connections`
  shuts down (at the socket level) every connection to the server's port except this process's
  own client, and the listening socket: writers then get an error for anything not yet
  confirmed, and a final checkpoint taken after it holds every confirmed item.
- Bare checkpoint roots. Reverb's `DefaultCheckpointer(path)` (as used by TF-Agents and
  sbsim) writes checkpoints into time-named subdirectories of `path`. `bare_checkpoints` lists
  the complete ones, `bare_checkpoint_dirs` also those a save left without `DONE`,
  `read_stored_tables` reads each table's name, capacity, signature, item count and the items'
  sequence length from the files, `read_column_types` the dtype and per-step shape of each
  column from the stored chunks (a table without a signature, as sbsim's, says nothing else
  about what it holds), and `copy_with_signature` copies one with a new table signature
  (TF-Agents stores `[None, ...]`; replay_service's tables have the sequence length).
- Writers. A Reverb writer's destructor waits without a timeout for its pending items
  (`abandon_writer`).
- TensorFlow's iterators. `flat_getter` reads a dataset's next element as its flat tensor list
  through the iterator's resource (skipping the per-element nest rebuild and shape checks of
  `next()`), and `numpy_view` takes an eager tensor's numpy view without a copy; both fall back
  to the public calls where TensorFlow's private names are missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import importlib.metadata
import logging
import os
import re
import shutil
import socket
import struct
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from replay_service.errors import CheckpointError, ServerError

_log = logging.getLogger(__name__)

TABLES_FILE = "tables.tfrecord"
CHUNKS_FILE = "chunks.tfrecord"
ITEMS_FILE = "items.tfrecord"
DONE_FILE = "DONE"
DATA_FILES = (TABLES_FILE, CHUNKS_FILE, ITEMS_FILE)
# The Reverb releases whose checkpoint layout, table protos and server sockets this module was
# verified against.
SUPPORTED_REVERB = ("0.13.", "0.14.")
# Seconds after `DONE` until a save that a client requested is surely past its cleanup (a listing
# and deletes that take milliseconds; seconds on a machine stalled by load).
SAVE_SETTLE_S = 2.0
_COMPRESSION = "ZLIB"
_READ_BLOCK = 1 << 20
# A TFRecord record: uint64 length, uint32 CRC of the length, data, uint32 CRC of the data.
_RECORD_OVERHEAD = 16
# How `DefaultCheckpointer` names a checkpoint: `absl::FormatTime(absl::Now())`, RFC 3339 with
# nanoseconds and the local UTC offset, e.g. `2024-01-31T12:00:00.123456789+00:00`.
_CHECKPOINT_NAME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?([+-]\d{2}:\d{2}|Z)")


def require_supported_reverb() -> None:
    """Raises `ServerError` if the installed dm-reverb is not one this module was verified on."""
    try:
        version = importlib.metadata.version("dm-reverb")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    if not version.startswith(SUPPORTED_REVERB):
        raise ServerError(
            f"dm-reverb {version} is installed, but replay_service reads Reverb checkpoints and "
            f"server sockets as dm-reverb {' / '.join(v + 'x' for v in SUPPORTED_REVERB)} "
            "write them; install dm-reverb==0.13.0"
        )


# ------------------------------------------------------------------------ checkpoint files


def is_reverb_checkpoint(path: str) -> bool:
    """Whether `path` is a directory that Reverb finished writing (it holds `DONE`)."""
    return os.path.isfile(os.path.join(path, DONE_FILE))


def is_settled_checkpoint(path: str, settle_s: float = SAVE_SETTLE_S) -> bool:
    """Whether Reverb finished `path` at least `settle_s` seconds ago, so moving it cannot fail
    the save that wrote it (which still lists and cleans the root after writing `DONE`).

    Args:
      path: A directory in a Reverb checkpoint root.
      settle_s: Seconds that must have passed since `DONE` was written.

    Returns:
      False while `DONE` is missing or younger than `settle_s`.
    """
    try:
        done_at = os.stat(os.path.join(path, DONE_FILE)).st_mtime
    except OSError:
        return False
    return time.time() - done_at >= settle_s


def retry_concurrent_save(save: Callable[[], str]) -> str:
    """Runs `save` (a `Client.checkpoint()` call) and, if it lost a race with another save or an
    adoption (`is_concurrent_save_error`), runs it once more.

    Returns:
      What `save` returned: where Reverb wrote the checkpoint.

    Raises:
      Whatever the last call raised.
    """
    try:
        return save()
    except RuntimeError as e:
        if not is_concurrent_save_error(e):
            raise
        _log.warning("checkpoint raced with another save (%s); asking again", e)
        return save()


def is_concurrent_save_error(error: BaseException) -> bool:
    """Whether a failed `Client.checkpoint()` lost a race with another save or an adoption: a
    directory of the root vanished between Reverb listing it and deleting it. Asking again
    succeeds unless it races again."""
    return isinstance(error, RuntimeError) and str(error).rstrip().endswith(" not found")


def verify_files(path: str) -> tuple[int, dict[str, dict[str, Any]]]:
    """Reads every data file of a Reverb checkpoint to its end.

    Args:
      path: A Reverb checkpoint directory.

    Returns:
      `(num_items, files)`: the number of items (records of `items.tfrecord`, every table), and
      per data file its size, SHA-256 and record count.

    Raises:
      CheckpointError: If `DONE` or a file is missing, or a file is truncated or damaged; the
        message names the file.
    """
    if not is_reverb_checkpoint(path):
        raise CheckpointError(f"Reverb checkpoint {path!r} is incomplete (no {DONE_FILE} file)")
    files = {name: _verify_file(os.path.join(path, name)) for name in DATA_FILES}
    return files[ITEMS_FILE]["records"], files


def check_recorded_files(
    path: str, recorded: dict[str, dict[str, Any]], names: Sequence[str] = DATA_FILES
) -> None:
    """Checks the data files of `path` against the sizes and digests recorded at checkpoint.

    Args:
      path: The checkpoint directory.
      recorded: Per file name, its recorded "size" and "sha256".
      names: The files that must be there (Reverb's data files by default).

    Raises:
      CheckpointError: If a file is missing, or its size or SHA-256 differs; names the file.
    """
    for name in names:
        file_path = os.path.join(path, name)
        want = recorded.get(name)
        if not isinstance(want, dict):
            raise CheckpointError(f"{path!r} records no checksum of {name}")
        try:
            size = os.path.getsize(file_path)
        except OSError as e:
            raise CheckpointError(f"cannot read {file_path!r}: {e}") from e
        if size != want.get("size"):
            raise CheckpointError(
                f"{file_path!r} has {size} bytes, but {want.get('size')} were recorded when the "
                "checkpoint was taken"
            )
        try:
            digest = file_sha256(file_path)
        except OSError as e:
            raise CheckpointError(f"cannot read {file_path!r}: {e}") from e
        if digest != want.get("sha256"):
            raise CheckpointError(
                f"{file_path!r} is damaged: SHA-256 {digest}, recorded {want.get('sha256')}"
            )


def file_sha256(path: str) -> str:
    """Returns the hex SHA-256 digest of a file, read in blocks.

    Raises:
      OSError: If the file cannot be read.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_READ_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _verify_file(path: str) -> dict[str, Any]:
    digest = hashlib.sha256()
    inflate = zlib.decompressobj()
    pending = b""
    records = size = 0
    try:
        with open(path, "rb") as f:
            while block := f.read(_READ_BLOCK):
                size += len(block)
                digest.update(block)
                if inflate.eof:
                    raise CheckpointError(f"{path!r} has data after the end of its ZLIB stream")
                pending += inflate.decompress(block)
                count, used = _count_records(pending)
                records += count
                pending = pending[used:]
    except OSError as e:
        raise CheckpointError(f"cannot read {path!r}: {e}") from e
    except zlib.error as e:
        raise CheckpointError(f"{path!r} is damaged ({e})") from e
    if not inflate.eof or pending:
        raise CheckpointError(
            f"{path!r} is truncated ({size} bytes; its ZLIB stream or last record is incomplete)"
        )
    return {"size": size, "sha256": digest.hexdigest(), "records": records}


def _count_records(data: bytes) -> tuple[int, int]:
    """Counts the whole TFRecord records at the start of `data`; returns (count, bytes used)."""
    count = offset = 0
    while offset + 8 <= len(data):
        (length,) = struct.unpack_from("<Q", data, offset)
        end = offset + _RECORD_OVERHEAD + length
        if end > len(data):
            break
        count, offset = count + 1, end
    return count, offset


# ------------------------------------------------------------------ restore with options now


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
        for record in _read_records(checkpoint_path, TABLES_FILE)
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
            if name not in rewritten:
                _link_or_copy(os.path.join(checkpoint_path, name), os.path.join(view_dir, name))
        options = tf.io.TFRecordOptions(compression_type=_COMPRESSION)
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
    for record in _read_records(checkpoint_path, ITEMS_FILE):
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


def _iter_records(checkpoint_path: str, name: str) -> Iterator[bytes]:
    """Every record of one of the checkpoint's compressed TFRecord files, read as a stream.

    Raises:
      CheckpointError: If the file cannot be read.
    """
    import tensorflow as tf

    path = os.path.join(checkpoint_path, name)
    try:
        dataset = tf.data.TFRecordDataset(path, compression_type=_COMPRESSION)
        for batch in dataset.batch(256).as_numpy_iterator():
            yield from batch
    except (tf.errors.OpError, OSError) as e:
        raise CheckpointError(f"cannot read {path!r} of {checkpoint_path!r}: {e}") from e


def _read_records(checkpoint_path: str, name: str) -> list[bytes]:
    """Every record of one of the checkpoint's compressed TFRecord files.

    Raises:
      CheckpointError: If the file cannot be read.
    """
    import tensorflow as tf

    path = os.path.join(checkpoint_path, name)
    try:
        dataset = tf.data.TFRecordDataset(path, compression_type=_COMPRESSION)
        return [r for batch in dataset.batch(4096).as_numpy_iterator() for r in batch]
    except (tf.errors.OpError, OSError) as e:
        raise CheckpointError(f"cannot read {path!r} of {checkpoint_path!r}: {e}") from e


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


# ------------------------------------------------------------- reading every item once


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

    records = _read_records(checkpoint_path, TABLES_FILE)
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
        schema_pb2.PrioritizedItem.FromString(r) for r in _read_records(checkpoint_path, ITEMS_FILE)
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
    options = tf.io.TFRecordOptions(compression_type=_COMPRESSION)
    with tf.io.TFRecordWriter(os.path.join(copy, TABLES_FILE), options) as writer:
        writer.write(drained.SerializeToString())
    with tf.io.TFRecordWriter(os.path.join(copy, ITEMS_FILE), options) as writer:
        for record in records:
            fresh = type(record)()
            fresh.CopyFrom(record)
            fresh.times_sampled = 0
            writer.write(fresh.SerializeToString())
    _link_or_copy(os.path.join(checkpoint_path, CHUNKS_FILE), os.path.join(copy, CHUNKS_FILE))
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


# ----------------------------------------------------------------------- writers


def abandon_writer(writer: Any) -> None:
    """Keeps a Reverb writer alive until the process exits, so its destructor never runs.

    Reverb's writer destructor waits, without a timeout, until every pending item is confirmed
    (reverb#4, #144); when the server died (or restarted on the same port) that wait never ends
    and whatever drops the last reference hangs. A writer that failed to flush within the write
    timeout is therefore leaked on purpose: its pending items are lost either way.
    """
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(writer))


# --------------------------------------------------------------------- stopping confirmations


def close_foreign_connections(port: int, own_clients: Iterable[int] = ()) -> int:
    """Stops a Reverb server in this process from receiving or confirming anything more.

    Shuts down (both directions) the listening socket of `port` and every connection accepted
    on it, except those whose peer is one of this process's own client sockets (local ports
    `own_clients`, e.g. the client that takes the final checkpoint). Reverb keeps its tables and
    answers the remaining client; remote writers see their streams fail, so an item is either
    confirmed before this call or never confirmed.

    Args:
      port: The server's port.
      own_clients: Local ports of this process's client connections to keep.

    Returns:
      The number of sockets shut down.

    Raises:
      ServerError: If this platform does not expose its sockets under /proc (Linux only), or
        the installed dm-reverb is not one this was verified on.
    """
    require_supported_reverb()
    keep = set(own_clients)
    closed = 0
    for fd, local_port, remote_port, listening in _tcp_sockets():
        if local_port != port or (not listening and remote_port in keep):
            continue
        with contextlib.suppress(OSError):
            duplicate = socket.socket(fileno=os.dup(fd))
            try:
                duplicate.shutdown(socket.SHUT_RDWR)
                closed += 1
            finally:
                duplicate.close()  # closes the duplicate only; the server's descriptor stays
    return closed


def own_client_ports(port: int) -> list[int]:
    """Local ports of this process's client connections to `port`."""
    return [
        local for _, local, remote, listening in _tcp_sockets() if remote == port and not listening
    ]


def _tcp_sockets() -> list[tuple[int, int, int, bool]]:
    """This process's TCP sockets: (fd, local port, remote port, is listening)."""
    inodes: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError as e:
        raise ServerError(f"cannot list this process's sockets (/proc/self/fd): {e}") from e
    for name in names:
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{name}")
            if link.startswith("socket:["):
                inodes[int(link[8:-1])] = int(name)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table, encoding="ascii") as f:
            next(f, None)
            for line in f:
                fields = line.split()
                inode = int(fields[9])
                if inode in inodes:
                    local = int(fields[1].rsplit(":", 1)[1], 16)
                    remote = int(fields[2].rsplit(":", 1)[1], 16)
                    found.append((inodes[inode], local, remote, fields[3] == "0A"))
    return found


# ------------------------------------------------------------- bare Reverb checkpoint roots


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
    for record in _iter_records(checkpoint_path, ITEMS_FILE):
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
    for record in _iter_records(checkpoint_path, CHUNKS_FILE):
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
        for record in _read_records(checkpoint_path, TABLES_FILE)
    ]
    counts: dict[str, int] = {}
    lengths: dict[str, set[int]] = {}
    for record in _read_records(checkpoint_path, ITEMS_FILE):
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
        for record in _read_records(checkpoint_path, TABLES_FILE)
    ]
    try:
        os.makedirs(dest)
        for name in (CHUNKS_FILE, ITEMS_FILE):
            shutil.copy2(os.path.join(checkpoint_path, name), os.path.join(dest, name))
        options = tf.io.TFRecordOptions(compression_type=_COMPRESSION)
        with tf.io.TFRecordWriter(os.path.join(dest, TABLES_FILE), options) as writer:
            for table in tables:
                if table.table_name == table_name:
                    table.signature.ParseFromString(encoded)
                writer.write(table.SerializeToString())
        with open(os.path.join(dest, DONE_FILE), "w", encoding="utf-8"):
            pass
    except (OSError, tf.errors.OpError) as e:
        raise CheckpointError(f"cannot copy {checkpoint_path!r} to {dest!r}: {e}") from e


# ---------------------------------------------------------------------- TensorFlow iterators


def flat_getter(dataset: Any) -> Callable[[], list[Any]]:
    """Returns a call that gets the next element of `dataset` as its flat list of tensors.

    It skips what `next(iter(dataset))` does in Python for every element (rebuilding the nest
    and checking every component's shape against the element spec, about 0.3 ms a batch of
    `ReplaySample`), which a training loop sampling small batches felt. Raises
    `tf.errors.OutOfRangeError` at the end.
    """
    import tensorflow as tf

    iterator = iter(dataset)
    resource = getattr(iterator, "_iterator_resource", None)
    specs = tf.nest.flatten(dataset.element_spec)
    if resource is None or not all(isinstance(s, tf.TensorSpec) for s in specs):
        return lambda: tf.nest.flatten(next(iterator))
    from tensorflow.python.ops import gen_dataset_ops

    types = [s.dtype for s in specs]
    shapes = [s.shape for s in specs]

    def get_next(owner: Any = iterator) -> list[Any]:  # `owner` keeps the resource alive
        return gen_dataset_ops.iterator_get_next(resource, output_types=types, output_shapes=shapes)

    return get_next


def numpy_view(value: Any) -> np.ndarray:
    """An eager tensor's numpy array, sharing its buffer (a copy if it is not in host memory)."""
    try:
        return value._numpy()
    except AttributeError:  # not an EagerTensor
        return value.numpy()

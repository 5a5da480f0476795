"""Reverb's checkpoint files: their names, their records, and reading them to verify them.

Reverb's `DefaultCheckpointer` writes a directory with `tables.tfrecord`, `chunks.tfrecord` and
`items.tfrecord` (TFRecord files, each one ZLIB stream; one record per table, chunk and item) and
then an empty `DONE` file (`storage.files`). `DONE` only says that Reverb finished: on a full
disk it still writes `DONE` after a truncated file. `verify_files` therefore reads every file to
its end (the ZLIB stream carries an Adler-32 checksum; every record's length must fit), counts the
items and hashes each file; `storage.files.check_recorded_files` compares a checkpoint with the
sizes and digests recorded when it was taken.
"""

from __future__ import annotations

import hashlib
import os
import struct
import zlib
from collections.abc import Collection, Iterator
from typing import Any

from replay_service.backends.reverb.platform.saves import SAVE_SETTLE_S
from replay_service.errors import CheckpointError
from replay_service.storage.file_modes import open_regular, regular_file_exists
from replay_service.storage.files import DONE_FILE, is_done

TABLES_FILE = "tables.tfrecord"
CHUNKS_FILE = "chunks.tfrecord"
ITEMS_FILE = "items.tfrecord"
DATA_FILES = (TABLES_FILE, CHUNKS_FILE, ITEMS_FILE)
COMPRESSION = "ZLIB"
_READ_BLOCK = 1 << 20
# A TFRecord record: uint64 length, uint32 CRC of the length, data, uint32 CRC of the data.
_RECORD_OVERHEAD = 16


def is_reverb_checkpoint(path: str) -> bool:
    """Whether `path` is a directory that Reverb finished writing (it holds `DONE`).

    Raises:
      NotRegularFileError: If its `DONE` is not a regular file (a named pipe, a link...).
    """
    return is_done(path)


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


class ReverbCheckpointFormat:
    """Reverb's checkpoint files as the store knows them (`storage.checkpoint_format`): owned
    by their tfrecord files, verified by `verify_files`, and adopted from the staging root only
    `SAVE_SETTLE_S` after `DONE` (a client's save still cleans the root after writing it)."""

    backend = "reverb"
    settle_s = SAVE_SETTLE_S

    def owns(self, names: Collection[str]) -> bool:
        """Whether files named `names` include Reverb's tfrecord files."""
        return any(n.endswith(".tfrecord") for n in names)

    def verify(self, path: str) -> tuple[int, dict[str, dict[str, Any]]]:
        """`verify_files(path)`."""
        return verify_files(path)


CHECKPOINT_FORMAT = ReverbCheckpointFormat()


def _verify_file(path: str) -> dict[str, Any]:
    digest = hashlib.sha256()
    inflate = zlib.decompressobj()
    pending = b""
    records = size = 0
    try:
        with open_regular(path, "rb") as f:
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
    if inflate.unused_data:  # after the stream's end in the block that ended it
        raise CheckpointError(f"{path!r} has data after the end of its ZLIB stream")
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


def iter_records(checkpoint_path: str, name: str, batch_size: int = 256) -> Iterator[bytes]:
    """Every record of one of the checkpoint's compressed TFRecord files, read as a stream.

    Args:
      checkpoint_path: The Reverb checkpoint directory.
      name: The file's name in it.
      batch_size: Records read at a time.

    Raises:
      CheckpointError: If the file cannot be read.
      NotRegularFileError: If it is not a regular file (it is not opened).
    """
    import tensorflow as tf

    path = os.path.join(checkpoint_path, name)
    regular_file_exists(path)
    try:
        dataset = tf.data.TFRecordDataset(path, compression_type=COMPRESSION)
        for batch in dataset.batch(batch_size).as_numpy_iterator():
            yield from batch
    except (tf.errors.OpError, OSError) as e:
        raise CheckpointError(f"cannot read {path!r} of {checkpoint_path!r}: {e}") from e


def read_records(checkpoint_path: str, name: str) -> list[bytes]:
    """Every record of one of the checkpoint's compressed TFRecord files (`iter_records`).

    Raises:
      CheckpointError: If the file cannot be read.
      NotRegularFileError: If it is not a regular file (it is not opened).
    """
    return list(iter_records(checkpoint_path, name, batch_size=4096))

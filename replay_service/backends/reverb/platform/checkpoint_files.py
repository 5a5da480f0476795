"""Reverb's checkpoint files: their names, their records, and reading them to verify them.

Reverb's `DefaultCheckpointer` writes a directory with `tables.tfrecord`, `chunks.tfrecord` and
`items.tfrecord` (TFRecord files, each one ZLIB stream; one record per table, chunk and item) and
then an empty `DONE` file. `DONE` only says that Reverb finished: on a full disk it still writes
`DONE` after a truncated file. `verify_files` therefore reads every file to its end (the ZLIB
stream carries an Adler-32 checksum; every record's length must fit), counts the items and hashes
each file; `check_recorded_files` compares a checkpoint with the sizes and digests recorded when
it was taken.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

from replay_service.errors import CheckpointError
from replay_service.storage.file_modes import open_regular, regular_file_exists

TABLES_FILE = "tables.tfrecord"
CHUNKS_FILE = "chunks.tfrecord"
ITEMS_FILE = "items.tfrecord"
DONE_FILE = "DONE"
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
    return regular_file_exists(os.path.join(path, DONE_FILE))


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
      NotRegularFileError: If one is not a regular file (a named pipe...): it is not opened.
    """
    for name in names:
        file_path = os.path.join(path, name)
        want = recorded.get(name)
        if not isinstance(want, dict):
            raise CheckpointError(f"{path!r} records no checksum of {name}")
        try:
            if not regular_file_exists(file_path):
                raise FileNotFoundError(2, "No such file or directory", file_path)
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
      NotRegularFileError: If `path` is not a regular file (it is not opened).
      OSError: If the file cannot be read.
    """
    digest = hashlib.sha256()
    with open_regular(path, "rb") as f:
        while block := f.read(_READ_BLOCK):
            digest.update(block)
    return digest.hexdigest()


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


def iter_records(checkpoint_path: str, name: str) -> Iterator[bytes]:
    """Every record of one of the checkpoint's compressed TFRecord files, read as a stream.

    Raises:
      CheckpointError: If the file cannot be read.
      NotRegularFileError: If it is not a regular file (it is not opened).
    """
    import tensorflow as tf

    path = os.path.join(checkpoint_path, name)
    regular_file_exists(path)
    try:
        dataset = tf.data.TFRecordDataset(path, compression_type=COMPRESSION)
        for batch in dataset.batch(256).as_numpy_iterator():
            yield from batch
    except (tf.errors.OpError, OSError) as e:
        raise CheckpointError(f"cannot read {path!r} of {checkpoint_path!r}: {e}") from e


def read_records(checkpoint_path: str, name: str) -> list[bytes]:
    """Every record of one of the checkpoint's compressed TFRecord files.

    Raises:
      CheckpointError: If the file cannot be read.
      NotRegularFileError: If it is not a regular file (it is not opened).
    """
    import tensorflow as tf

    path = os.path.join(checkpoint_path, name)
    regular_file_exists(path)
    try:
        dataset = tf.data.TFRecordDataset(path, compression_type=COMPRESSION)
        return [r for batch in dataset.batch(4096).as_numpy_iterator() for r in batch]
    except (tf.errors.OpError, OSError) as e:
        raise CheckpointError(f"cannot read {path!r} of {checkpoint_path!r}: {e}") from e


def link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)

"""The files of a checkpoint as the store sees them, whatever backend wrote it.

A checkpoint directory is complete once its writer wrote the empty `DONE` file last (Reverb's
checkpointer does, and so does the local backend): `is_done` and `is_settled` read that.
`DONE` only says that the writer finished, not that what it wrote is whole, so each data file
is recorded by size and SHA-256 when the checkpoint is adopted (`file_digest`, `file_sha256`)
and checked against that record before it is loaded (`check_recorded_files`). `list_dir` and
`remove_path` list and delete what the store owns.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import time
from collections.abc import Sequence
from typing import Any

from replay_service.errors import CheckpointError
from replay_service.storage.file_modes import open_regular, regular_file_exists

DONE_FILE = "DONE"
_READ_BLOCK = 1 << 20


def is_done(path: str) -> bool:
    """Whether `path` is a checkpoint directory its writer finished (it holds `DONE`).

    Raises:
      NotRegularFileError: If its `DONE` is not a regular file (a named pipe, a link...).
    """
    return regular_file_exists(os.path.join(path, DONE_FILE))


def is_settled(path: str, settle_s: float) -> bool:
    """Whether `path` was finished (`DONE` written) at least `settle_s` seconds ago.

    Args:
      path: A checkpoint directory.
      settle_s: Seconds that must have passed since `DONE` was written.

    Returns:
      False while `DONE` is missing or younger than `settle_s`.
    """
    try:
        done_at = os.stat(os.path.join(path, DONE_FILE)).st_mtime
    except OSError:
        return False
    return time.time() - done_at >= settle_s


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


def file_digest(path: str) -> dict[str, Any]:
    """The size and SHA-256 of a file, as a checkpoint records them.

    Returns:
      `{"size": bytes, "sha256": hex digest}`.

    Raises:
      CheckpointError: If the file cannot be read; names it.
    """
    try:
        return {"size": os.path.getsize(path), "sha256": file_sha256(path)}
    except OSError as e:
        raise CheckpointError(f"cannot read {path!r}: {e}") from e


def check_recorded_files(
    path: str, recorded: dict[str, dict[str, Any]], names: Sequence[str]
) -> None:
    """Checks files of `path` against the sizes and digests recorded at checkpoint.

    Args:
      path: The checkpoint directory.
      recorded: Per file name, its recorded "size" and "sha256".
      names: The files that must be there.

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


def link_or_copy(source: str, target: str) -> None:
    """Hard-links `source` to `target`, or copies it (with its times) where links fail.

    Raises:
      OSError: If it can be neither linked nor copied.
    """
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def list_dir(path: str) -> list[str]:
    """The entries of directory `path`; none if it does not exist or is not a directory.

    Raises:
      CheckpointError: If it exists but cannot be listed (a looping symbolic link, no
        permission), naming the path.
    """
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:
        raise CheckpointError(f"cannot list {path!r}: {e.strerror or e}") from e


def remove_path(path: str) -> None:
    """Deletes a file or directory tree if it exists (a symbolic link itself, never its target)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)

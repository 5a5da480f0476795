"""Explicit permissions of the files and directories replay_service writes, and durable writes.

Checkpoints, their metadata, the store file, the lock and exports are created owner read/write,
group read (`FILE_MODE`), and the directories replay_service creates owner rwx, group rx
(`DIR_MODE`), whatever the process umask is (under umask 000 they would otherwise be
world-writable), as a database does with its data directory.

What must survive a crash once written is synced here too: a file's contents (`sync_file`,
`write_synced`), a JSON file replaced in one step (`write_json_atomic`), a directory's entries
(`fsync_dir`) and a whole tree (`fsync_tree`).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import IO, Any

FILE_MODE = 0o640
DIR_MODE = 0o750


def open_private(path: str, mode: str = "w", **kwargs: Any) -> IO[Any]:
    """Opens `path` for writing (created or truncated) with permissions `FILE_MODE`.

    Args:
      path: The file to write.
      mode: "w" (text) or "wb" (binary).
      **kwargs: Passed to `os.fdopen` (e.g. `encoding`).

    Returns:
      The open file object.

    Raises:
      OSError: If it cannot be created.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)  # an existing file keeps its mode through O_CREAT
        return os.fdopen(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


def make_dirs(path: str) -> None:
    """Creates `path` and any missing parents with permissions `DIR_MODE`; an existing
    directory keeps its mode.

    Raises:
      OSError: If a component cannot be created (or exists and is not a directory).
    """
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent != path:
        make_dirs(parent)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not os.path.isdir(path):
            raise
        return
    os.chmod(path, DIR_MODE)


def restrict_tree(path: str) -> None:
    """Gives every file under `path` `FILE_MODE` and every directory `DIR_MODE` (`path`
    included), for files another writer created (Reverb's checkpoint files). Symbolic links
    are neither followed nor changed.

    Raises:
      OSError: If a mode cannot be changed.
    """
    if os.path.islink(path):
        return
    os.chmod(path, DIR_MODE)
    for directory, dirs, files in os.walk(path):
        for name in dirs:
            entry = os.path.join(directory, name)
            if not os.path.islink(entry):
                os.chmod(entry, DIR_MODE)
        for name in files:
            entry = os.path.join(directory, name)
            if not os.path.islink(entry):
                os.chmod(entry, FILE_MODE)


def sync_file(f: IO[Any]) -> None:
    """Flushes the open file `f` and makes its contents durable (`os.fsync`).

    Raises:
      OSError: If it cannot be flushed or synced (e.g. the disk is full).
    """
    f.flush()
    os.fsync(f.fileno())


def write_synced(path: str, text: str) -> None:
    """Writes `text` to `path` (created or truncated, `FILE_MODE`) and syncs it.

    Raises:
      OSError: If it cannot be written or synced.
    """
    with open_private(path, "w", encoding="utf-8") as f:
        f.write(text)
        sync_file(f)


def write_json_atomic(path: str, data: dict[str, Any]) -> None:
    """Replaces `path` with `data` as JSON in one step that survives a crash.

    The JSON goes into the synced sibling `<path>.tmp` (`FILE_MODE`), which is renamed over
    `path`; then the directory is synced. A reader sees the old file or the new one, never a
    part of either.

    Args:
      path: The file to write.
      data: What it holds (written with sorted keys, indented by 2).

    Raises:
      OSError: If a step fails; `<path>.tmp` is removed and `path` is left as it was (or, if
        only the directory sync failed, already replaced).
    """
    tmp = f"{path}.tmp"
    try:
        with open_private(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            sync_file(f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync_dir(os.path.dirname(path))


def fsync_dir(path: str) -> None:
    """Makes the entries of directory `path` durable (a rename or a new file in it).

    Raises:
      OSError: If it cannot be opened or synced.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """Makes every file under the directory `root` and every directory's entries durable.

    Raises:
      OSError: If a file or directory cannot be opened or synced.
    """
    for directory, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(directory)

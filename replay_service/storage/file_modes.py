"""Explicit permissions of the files and directories replay_service writes.

Checkpoints, their metadata, the store file, the lock and exports are created owner read/write,
group read (`FILE_MODE`), and the directories replay_service creates owner rwx, group rx
(`DIR_MODE`), whatever the process umask is (under umask 000 they would otherwise be
world-writable), as a database does with its data directory.
"""

from __future__ import annotations

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

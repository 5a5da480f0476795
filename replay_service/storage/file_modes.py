"""Explicit permissions of the files and directories replay_service writes, and durable writes.

Checkpoints, their metadata, the store file, the lock and exports are created owner read/write,
group read (`FILE_MODE`), and the directories replay_service creates owner rwx, group rx
(`DIR_MODE`), whatever the process umask is (under umask 000 they would otherwise be
world-writable), as a database does with its data directory.

What must survive a crash once written is synced here too: a file's contents (`sync_file`,
`write_synced`), a JSON file replaced in one step (`write_json_atomic`), a directory's entries
(`fsync_dir`) and a whole tree (`fsync_tree`).

Only regular files are ever opened in a checkpoint, store or export directory (`open_regular`,
`regular_file_exists`, and `open_private` for writes): opening a named pipe blocks until
another process opens its other end (forever, for a pipe nobody writes), and a device or a
symbolic link would read or write something outside the directory. Such an entry where one of
replay_service's files belongs raises `NotRegularFileError` naming it and its kind, and is
never opened, moved or deleted; elsewhere in the directory it is left alone like any foreign
file.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from typing import IO, Any

from replay_service.errors import NotRegularFileError

FILE_MODE = 0o640
DIR_MODE = 0o750
# Opening a named pipe with O_NONBLOCK returns at once instead of waiting for a writer (read)
# or fails with ENXIO (write); O_NOFOLLOW refuses a symbolic link as the last component. Both
# are 0 where the platform lacks them (the lstat/fstat checks still refuse those entries).
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_KINDS = (
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISLNK, "a symbolic link"),
)


def file_kind(mode: int) -> str:
    """What `mode` (an `st_mode`) is, in words: "a regular file", "a named pipe (FIFO)"..."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((kind for test, kind in _KINDS if test(mode)), f"a special file (mode {mode:o})")


def _not_regular(path: str, mode: int) -> NotRegularFileError:
    return NotRegularFileError(
        f"{path!r} is {file_kind(mode)}, not a regular file; replay_service reads and writes "
        "only regular files in its directories and never opens, moves or deletes anything "
        "else. Nothing was changed: move it out of "
        f"{os.path.dirname(path) or '.'!r} (or replace it with the file it stands for)"
    )


def regular_file_exists(path: str) -> bool:
    """Whether `path` is a regular file, without opening it or following a symbolic link.

    Args:
      path: The file.

    Returns:
      True for a regular file; False if nothing is there (or a parent is not a directory).

    Raises:
      NotRegularFileError: If something else is there (a named pipe, socket, device,
        directory or symbolic link), naming it and its kind.
      OSError: If it cannot be examined for another reason (no permission).
    """
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return False
    if not stat.S_ISREG(mode):
        raise _not_regular(path, mode)
    return True


def open_regular(path: str, mode: str = "rb", **kwargs: Any) -> IO[Any]:
    """Opens the regular file `path` for reading; never opens anything else.

    The entry is examined first (`os.lstat`), opened without following a symbolic link and
    without waiting (a named pipe swapped in meanwhile returns at once), and examined again
    through the open descriptor.

    Args:
      path: The file to read.
      mode: "rb" or "r".
      **kwargs: Passed to `os.fdopen` (e.g. `encoding`).

    Returns:
      The open file object (blocking reads, as `open` gives).

    Raises:
      NotRegularFileError: If `path` is not a regular file (a named pipe, socket, device,
        directory or symbolic link), naming it and its kind; it was not opened.
      OSError: If it does not exist or cannot be opened (FileNotFoundError...).
    """
    if mode not in ("r", "rb"):
        raise ValueError(f"open_regular reads only ('r' or 'rb'), got mode {mode!r}")
    if not regular_file_exists(path):
        raise FileNotFoundError(2, "No such file or directory", path)
    fd = os.open(path, os.O_RDONLY | _NONBLOCK | _NOFOLLOW | _CLOEXEC)
    try:
        _require_regular_fd(fd, path)
        return os.fdopen(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


def _require_regular_fd(fd: int, path: str) -> None:
    """Raises `NotRegularFileError` unless `fd` is a regular file; clears O_NONBLOCK."""
    st_mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(st_mode):
        raise _not_regular(path, st_mode)
    if _NONBLOCK:
        os.set_blocking(fd, True)


def open_private(path: str, mode: str = "w", **kwargs: Any) -> IO[Any]:
    """Opens `path` for writing (created or truncated) with permissions `FILE_MODE`.

    Args:
      path: The file to write.
      mode: "w" (text) or "wb" (binary).
      **kwargs: Passed to `os.fdopen` (e.g. `encoding`).

    Returns:
      The open file object.

    Raises:
      NotRegularFileError: If `path` holds something other than a regular file (a named pipe,
        a symbolic link...): it is neither opened nor changed.
      OSError: If it cannot be created.
    """
    regular_file_exists(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NONBLOCK | _NOFOLLOW, FILE_MODE)
    try:
        _require_regular_fd(fd, path)
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
      NotRegularFileError: If `path` or `<path>.tmp` holds something other than a regular file
        (both are left as they are).
      OSError: If a step fails; `<path>.tmp` is removed and `path` is left as it was (or, if
        only the directory sync failed, already replaced).
    """
    tmp = f"{path}.tmp"
    regular_file_exists(path)  # os.replace would delete what is there
    regular_file_exists(tmp)  # never removed below if it is not a regular file
    try:
        with open_private(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            sync_file(f)
        os.replace(tmp, path)
    except BaseException as e:
        if not isinstance(e, NotRegularFileError):
            with contextlib.suppress(OSError):
                os.remove(tmp)
        raise
    fsync_dir(os.path.dirname(path))


def fsync_dir(path: str) -> None:
    """Makes the entries of directory `path` durable (a rename or a new file in it).

    Raises:
      OSError: If it cannot be opened or synced.
    """
    fd = os.open(path, os.O_RDONLY | _NONBLOCK)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """Makes every regular file under the directory `root` and every directory's entries
    durable; anything else (a named pipe, a symbolic link) is neither opened nor followed.

    Raises:
      OSError: If a file or directory cannot be opened or synced.
    """
    for directory, _, files in os.walk(root):
        for name in files:
            path = os.path.join(directory, name)
            if not stat.S_ISREG(os.lstat(path).st_mode):
                continue
            fd = os.open(path, os.O_RDONLY | _NONBLOCK | _NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(directory)

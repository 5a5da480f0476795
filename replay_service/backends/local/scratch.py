"""The memory-mapped storage's files: their directory, checked and emptied, and their disk space.

A "memmap" table keeps its step ring in files `field<N>.memmap` under a scratch directory of its
own (`<checkpoint_dir>/.memmap/<table name>`, or a temporary one); a ring that grows moves into
`field<N>.grow.memmap` files, renamed over its own once its steps are copied (`spare_file`).
Those files are the only entries this module ever deletes: a directory that is a symbolic link,
sits under one, or holds anything else is refused before anything changes
(`check_scratch_dir`). The files' whole size is reserved on disk when they are created
(`reserve_files`), so a full disk is a `ConfigError` then, never a SIGBUS at a later write
through the mapping.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Sequence
from typing import Any

from replay_service.errors import CheckpointError, ConfigError
from replay_service.specs import sizes
from replay_service.storage.file_modes import DIR_MODE, make_dirs

# The files of a table's memory-mapped storage (`scratch_file`, `spare_file`): the only ones it
# ever deletes.
_SCRATCH_FILE = re.compile(r"field[0-9]+(\.grow)?\.memmap")


def scratch_file(directory: str, index: int) -> str:
    """The path of the memory-mapped file of field `index` in `directory`."""
    return os.path.join(directory, f"field{index}.memmap")


def spare_file(directory: str, index: int) -> str:
    """The path of the file a growing ring moves field `index` into, in `directory`: renamed
    over `scratch_file` once the ring's steps are copied there."""
    return os.path.join(directory, f"field{index}.grow.memmap")


def remove_files(paths: Sequence[str]) -> None:
    """Deletes the files `paths` that exist (a symbolic link itself, never its target): only
    files this process created (`reserve_files`)."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def check_scratch_dir(directory: str) -> None:
    """Checks, without changing anything, that `directory` can hold a table's memory-mapped
    files (see `prepare_scratch_dir`): run it before anything is deleted or restored.

    Args:
      directory: The table's scratch directory, `<checkpoint_dir>/.memmap/<table name>`.

    Raises:
      CheckpointError: If the directory's name is not a plain file name, if it or its parent
        is a symbolic link or not a directory, or if it holds anything but the files of an
        earlier buffer (`field<N>.memmap`, `field<N>.grow.memmap` regular files); the message
        names the path.
    """
    name, parent = os.path.basename(directory), os.path.dirname(directory)
    if name in ("", ".", ".."):
        raise CheckpointError(
            f"{directory!r} is not a directory of its own for memory-mapped files: its last "
            f"component {name!r} is not a plain file name"
        )
    try:
        for path in (parent, directory):
            if os.path.islink(path):
                raise CheckpointError(
                    f"{path!r} is a symbolic link (to {_link_target(path)!r}); the memory-mapped "
                    "storage writes and deletes there and never follows links. Nothing was "
                    "changed: remove the link"
                )
            if os.path.lexists(path) and not stat.S_ISDIR(os.lstat(path).st_mode):
                raise CheckpointError(
                    f"{path!r} exists and is not a directory; the memory-mapped storage needs a "
                    "directory there. Nothing was changed: move it aside"
                )
        if not os.path.lexists(directory):
            return
        foreign = [
            entry
            for entry in sorted(os.listdir(directory))
            if not _SCRATCH_FILE.fullmatch(entry)
            or not stat.S_ISREG(os.lstat(os.path.join(directory, entry)).st_mode)
        ]
    except OSError as e:
        raise CheckpointError(
            f"cannot use {directory!r} for memory-mapped files: {e.strerror or e}"
        ) from e
    if foreign:
        raise CheckpointError(
            f"{directory!r} holds entries the memory-mapped storage did not create "
            f"({', '.join(repr(e) for e in foreign[:5])}); nothing was deleted: move them aside"
        )


def prepare_scratch_dir(directory: str) -> None:
    """Makes `directory` an empty, real directory (mode `DIR_MODE`) for memory-mapped files.

    Its parent (`<checkpoint_dir>/.memmap`) is created (mode `DIR_MODE`) if missing. Files that
    an earlier buffer of this directory left there (`field<N>.memmap`, `field<N>.grow.memmap`
    regular files: a closed buffer, a failed restore, a crash; their items live in the
    checkpoints) are deleted;
    nothing else is ever deleted, and no symbolic link is followed.

    Args:
      directory: The table's scratch directory, `<checkpoint_dir>/.memmap/<table name>`.

    Raises:
      CheckpointError: If `check_scratch_dir` refuses it (nothing was deleted then), or it
        cannot be created or emptied; the message names the path.
    """
    check_scratch_dir(directory)
    try:
        make_dirs(os.path.dirname(directory))
        with contextlib.suppress(FileExistsError):  # checked above: a real directory
            os.mkdir(directory, DIR_MODE)
        os.chmod(directory, DIR_MODE)
        for entry in os.listdir(directory):  # an earlier buffer's files (checked above)
            if _SCRATCH_FILE.fullmatch(entry):
                os.unlink(os.path.join(directory, entry))
    except OSError as e:
        raise CheckpointError(
            f"cannot use {directory!r} for memory-mapped files: {e.strerror or e}"
        ) from e


def _link_target(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def reserve_files(
    files: Sequence[tuple[str, int]], what: str, fields: Sequence[dict[str, Any]]
) -> None:
    """Creates each file of `files` with its whole size allocated on disk (`posix_fallocate`).

    A memory-mapped file whose blocks are not allocated takes them when a page is first
    written; on a full disk that write kills the process with SIGBUS. Reserved blocks are the
    file's until it is deleted, so writes through the mapping never need new ones.

    Args:
      files: `(path, bytes)` of each file to create; none of them may exist.
      what: What the files hold, for the error.
      fields: The step's fields (`specs.describe_spec`), named in the error.

    Raises:
      ConfigError: If a file cannot be created or its space cannot be reserved (a full disk, a
        quota); it names the file, the bytes needed and those free. Files that need more than
        the disk has free are refused before any is created; the files this call created are
        removed again.
    """
    needed = sum(n for _, n in files)
    # Refused before any block is taken: a reservation that fails part way holds the disk
    # full meanwhile, for every other writer on it too.
    check_free(files, what, fields)
    created: list[str] = []
    path, size = "", 0
    try:
        for path, size in files:
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(path, flags, 0o600)
            created.append(path)
            try:
                if size:
                    os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
    except OSError as e:
        with contextlib.suppress(OSError):
            remove_files(created)
        left = free_bytes(os.path.dirname(path) or ".")
        free = "free space unknown" if left is None else f"{left} bytes free there"
        raise ConfigError(
            f"cannot reserve {needed} bytes on disk for {what} in "
            f"{os.path.dirname(path)!r} ({free}): {path!r} ({size} bytes): {e.strerror or e}; "
            "free disk space, lower the capacity or use storage='memory'"
        ) from e


def free_bytes(directory: str) -> int | None:
    """Bytes an unprivileged process may still write on the disk of `directory` (or of its
    nearest existing parent, for one not made yet).

    Args:
      directory: Any path on the disk (a tmpfs such as /dev/shm included).

    Returns:
      The bytes free to unprivileged writers; None if the disk cannot be queried.
    """
    while not os.path.isdir(directory) and os.path.dirname(directory) != directory:
        directory = os.path.dirname(directory)
    try:
        stats = os.statvfs(directory)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def check_free(
    files: Sequence[tuple[str, int]],
    what: str,
    fields: Sequence[dict[str, Any]],
    directory: str | None = None,
    reclaimable: int = 0,
) -> None:
    """Refuses `files` (`(path, bytes)`) that need more than the disk of `directory` (their
    first one's directory by default; the nearest existing parent is measured) has free, plus
    `reclaimable` bytes that are deleted before they are made.

    Raises:
      ConfigError: Naming the bytes needed and free, the files, the bytes per step and the
        largest fields per step with their shapes.
    """
    needed = sum(n for _, n in files)
    directory = directory or (os.path.dirname(files[0][0]) if files else ".")
    free = free_bytes(directory)
    if free is None or needed <= free + reclaimable:
        return
    shown = sorted({os.path.basename(p) for p, _ in files})
    raise ConfigError(
        f"cannot reserve {needed} bytes ({sizes.human(needed)}) on disk for {what} in "
        f"{directory!r} ({free} bytes free there): files {shown} need more than is free "
        f"({sizes.step_bytes(fields)} bytes per step; the largest fields per step: "
        f"{sizes.largest_fields(fields)}); free disk space, lower the capacity or the field's "
        "shape, or use storage='memory'"
    )


def scratch_file_bytes(directory: str) -> int:
    """Bytes of the memory-mapped regular files an earlier buffer left in `directory`
    (which `prepare_scratch_dir` deletes); 0 where there are none or it cannot be listed."""
    total = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            if _SCRATCH_FILE.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    return total

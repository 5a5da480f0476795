"""Putting a complete buffer directory in place: hidden siblings, locks, the swap.

A buffer is written in a hidden sibling of its final path (`.<name>.<tag>-<pid>`) and renamed
into place only when it is complete; a directory is replaced only when it holds nothing but
replay_service's own files, and only when it is not in use.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

from replay_service.errors import CheckpointError, CheckpointExistsError
from replay_service.storage.directory import CHECKPOINTS_DIR, LOCK_FILE, REVERB_DIR, STORE_FILE
from replay_service.storage.file_modes import fsync_dir, fsync_tree, make_dirs, restrict_tree
from replay_service.storage.files import remove_path
from replay_service.storage.store import CheckpointStore

PARTIAL_TAG = "partial"
COPY_TAG = "copy"
OLD_TAG = "old"
STORE_ENTRIES = frozenset({STORE_FILE, f"{STORE_FILE}.tmp", CHECKPOINTS_DIR, REVERB_DIR, LOCK_FILE})


def hidden_sibling(path: str, tag: str) -> str:
    """A hidden sibling of `path` owned by this process, e.g. `.name.partial-1234`."""
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.{tag}-{os.getpid()}")


@contextlib.contextmanager
def locked_if_store(path: str, is_store: bool) -> Iterator[None]:
    """Holds the lock of an existing buffer, so one in use is never replaced."""
    if not is_store:
        yield
        return
    with CheckpointStore(path).locked():
        yield


def check_distinct(source: str, target: str) -> None:
    """Refuses a copy whose source and target are one directory or one holds the other.

    Raises:
      CheckpointError: If they overlap (links resolved).
    """
    real_source, real_target = os.path.realpath(source), os.path.realpath(target)
    for a, b in ((real_source, real_target), (real_target, real_source)):
        if a == b or a.startswith(b.rstrip(os.sep) + os.sep):
            raise CheckpointError(
                f"cannot copy {source!r} to {target!r}: the source and target overlap"
            )


def check_copy_target(target: str, overwrite: bool) -> bool:
    """Returns whether an existing buffer at `target` will be replaced.

    Raises:
      CheckpointError: If `target` is a symbolic link (it is never written through or
        replaced), exists and is not a directory, or holds foreign files.
      CheckpointExistsError: If it is not empty and `overwrite` is False.
    """
    if not os.path.lexists(target):
        return False
    if os.path.islink(target):
        raise CheckpointError(
            f"copy target {target!r} is a symbolic link (to {os.readlink(target)!r}); a copy is "
            "renamed into place as a new directory and never writes through or replaces a link: "
            f"pass the directory itself ({os.path.realpath(target)!r}) or a new path"
        )
    if not os.path.isdir(target):
        raise CheckpointError(f"copy target {target!r} exists and is not a directory")
    if not os.listdir(target):
        return False
    if not overwrite:
        raise CheckpointExistsError(
            f"copy target {target!r} is not empty; choose a new or empty directory, or pass "
            "overwrite=True (--overwrite) to replace the buffer there"
        )
    check_own_entries(target)
    return True


def check_own_entries(path: str) -> None:
    """Refuses to replace a directory holding anything but replay_service's own files.

    Raises:
      CheckpointError: If `path` holds other entries or is not a replay_service checkpoint
        directory; the message names some of its entries.
    """
    entries = sorted(os.listdir(path))
    foreign = [e for e in entries if e not in STORE_ENTRIES]
    if foreign or not CheckpointStore(path).is_store():
        shown = ", ".join(foreign[:5] or entries[:5])
        raise CheckpointError(
            f"{path!r} is not only a replay_service checkpoint directory (it contains {shown}); "
            "it is never replaced or deleted: move it away or choose another name"
        )


def copy_into(source: str, target: str, overwrite: bool, write: Callable[[str], None]) -> str:
    """Writes a copy of `source` in a hidden sibling of `target` and renames it into place.

    The sibling is created with an empty `.reverb/` (and `target`'s missing parents), filled by
    `write`, given the modes of checkpoints written here whatever the umask, and synced; an
    existing buffer at `target` is replaced under its lock. The sibling never outlives the call.

    Args:
      source: What is copied (named in errors).
      target: The copy's path.
      overwrite: Replace a buffer at `target` (see `check_copy_target`).
      write: Writes the copy's store file and checkpoints into the directory it is given.

    Returns:
      `target`.

    Raises:
      CheckpointError: If `target` may not be written (see `check_copy_target`), is in use, or
        writing or renaming the copy fails.
      CheckpointExistsError: If `target` is not empty and `overwrite` is False.
    """
    replacing = check_copy_target(target, overwrite)
    staging = hidden_sibling(target, COPY_TAG)
    try:
        with locked_if_store(target, replacing):
            remove_path(staging)
            make_dirs(os.path.join(staging, REVERB_DIR))  # missing parents too: DIR_MODE
            write(staging)
            restrict_tree(staging)
            fsync_tree(staging)
            install(staging, target)
    except OSError as e:
        raise CheckpointError(f"cannot copy {source!r} to {target!r}: {e}") from e
    finally:
        remove_path(staging)
    return target


def install(staging: str, target: str) -> None:
    """Renames the complete `staging` to `target`; an existing `target` is removed afterwards.

    Raises:
      CheckpointError: If `target` is a non-empty directory that appeared meanwhile, or a rename
        fails.
    """
    old = hidden_sibling(target, OLD_TAG)
    replace = os.path.isdir(target) and bool(os.listdir(target))
    try:
        if replace:
            remove_path(old)
            os.rename(target, old)
        try:
            os.rename(staging, target)
        except OSError:
            if replace:
                os.rename(old, target)
            raise
        fsync_dir(os.path.dirname(target))
    except OSError as e:
        raise CheckpointError(f"cannot move {staging!r} to {target!r}: {e}") from e
    remove_path(old)

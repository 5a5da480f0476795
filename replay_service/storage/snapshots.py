"""The snapshots a store writes to read its items once: their directories, and stale ones.

`CheckpointStore.snapshot` writes a checkpoint, renames it out of the staging root into its own
`.snapshots/snapshot-<pid>-<32 hex>/` (next to a marker file written before anything else),
reads it and deletes it. Nothing that lists checkpoints looks under `.snapshots/`. A snapshot
left by a process that was killed while reading it is deleted on the next start
(`remove_stale`), and only what is provably a snapshot (`is_own_snapshot`).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shutil
import stat
import uuid
from collections.abc import Callable

from replay_service.errors import CheckpointError
from replay_service.storage.file_modes import DIR_MODE, fsync_dir, make_dirs, write_json_atomic
from replay_service.storage.files import list_dir, remove_path

FORMAT = "replay_service.snapshot/1"
PREFIX = "snapshot-"
MARKER_FILE = "replay_service_snapshot.json"
DATA_DIR = "checkpoint"
"""The checkpoint of a snapshot directory, once written."""
WRITES = 3
"""Writes of one snapshot before giving up, when a client's save deletes each one first."""

_log = logging.getLogger(__name__)


def new_snapshot_dir(snapshots_dir: str) -> str:
    """Creates an empty `<snapshots_dir>/snapshot-<pid>-<hex>/` with its marker file.

    Args:
      snapshots_dir: The store's `.snapshots/` (created if missing).

    Returns:
      The new snapshot directory.

    Raises:
      CheckpointError: If it cannot be created.
    """
    name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
    holder = os.path.join(snapshots_dir, name)
    marker = {
        "format": FORMAT,
        "pid": os.getpid(),
        "created_at": datetime.datetime.now(datetime.UTC).isoformat(),
    }
    try:
        make_dirs(snapshots_dir)
        os.mkdir(holder, DIR_MODE)
        os.chmod(holder, DIR_MODE)
        write_json_atomic(os.path.join(holder, MARKER_FILE), marker)
    except OSError as e:
        shutil.rmtree(holder, ignore_errors=True)
        raise CheckpointError(f"cannot create snapshot directory {holder!r}: {e}") from e
    return holder


def write_into(holder: str, staging_root: str, write_staged: Callable[[], str]) -> str:
    """Writes a checkpoint into the staging root and renames it to `<holder>/checkpoint`.

    Args:
      holder: A snapshot directory (`new_snapshot_dir`).
      staging_root: Where `write_staged` writes (the store's `.reverb/`).
      write_staged: Writes the checkpoint into the staging root; returns its directory.

    Returns:
      The snapshot's checkpoint directory.

    Raises:
      CheckpointError: If writing fails, or each of `WRITES` writes was deleted before it could
        be moved (by clients' saves), or it cannot be moved.
    """
    target = os.path.join(holder, DATA_DIR)
    for attempt in range(1, WRITES + 1):
        path = write_staged()
        try:
            os.rename(path, target)
        except FileNotFoundError:
            # A client's save that finished after this one deleted it (Reverb keeps only
            # the newest entry of its root): its checkpoint is newer, write again.
            _log.warning(
                "snapshot %s was deleted by another save before it was moved (write %d of %d)",
                path,
                attempt,
                WRITES,
            )
            continue
        except OSError as e:
            remove_path(path)
            raise CheckpointError(f"cannot move snapshot {path!r} to {target!r}: {e}") from e
        with contextlib.suppress(OSError):  # the staging root no longer lists it
            fsync_dir(staging_root)
        return target
    raise CheckpointError(
        f"snapshot into {staging_root!r} failed: each of {WRITES} snapshots was deleted by "
        "another save (py_client.checkpoint()) before it could be moved; try again when "
        "clients checkpoint less often"
    )


def remove_stale(snapshots_dir: str) -> list[str]:
    """Deletes every snapshot directory of `snapshots_dir` (`is_own_snapshot`); anything else
    there is left alone with a warning.

    Returns:
      The snapshot directories deleted.

    Raises:
      CheckpointError: If `snapshots_dir` cannot be listed.
    """
    removed = []
    for name in sorted(list_dir(snapshots_dir)):
        path = os.path.join(snapshots_dir, name)
        if is_own_snapshot(path, name):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            _log.warning("deleted snapshot %s left by a process that stopped reading it", path)
        else:
            _log.warning(
                "%s is not a replay_service snapshot; leaving it in place (remove it if it "
                "is not needed)",
                path,
            )
    return removed


def is_own_snapshot(path: str, name: str) -> bool:
    """Whether `path` (an entry `name` of `.snapshots/`) is provably a snapshot directory that
    `new_snapshot_dir` created: see `CheckpointStore.clean_snapshots`."""
    middle = name.removeprefix(PREFIX)
    pid, _, token = middle.partition("-")
    if not (
        name.startswith(PREFIX)
        and pid.isascii()
        and pid.isdigit()
        and len(token) == 32
        and all(c in "0123456789abcdef" for c in token)
    ):
        return False
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        entries = set(os.listdir(path))
        marker = os.path.join(path, MARKER_FILE)
        if MARKER_FILE not in entries:
            # Killed between creating the directory and its marker: only its partial write.
            partial = f"{MARKER_FILE}.tmp"
            return entries <= {partial} and all(
                stat.S_ISREG(os.lstat(os.path.join(path, e)).st_mode) for e in entries
            )
        if not stat.S_ISREG(os.lstat(marker).st_mode):
            return False
        fd = os.open(marker, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT

"""The on-disk layout of a checkpoint directory, and reading it: `CheckpointDirectory`.

    <checkpoint_dir>/
      replay_service.json          what the store holds: table name, sequence length, capacity,
                                   data spec, extra tables, variable tables and their specs
                                   (written when a new buffer starts)
      checkpoints/
        ckpt-00000001/             one complete checkpoint of a backend's format (Reverb's
        ckpt-00000002/             tables/chunks/items.tfrecord, or the local backend's
                                   safetensors tables; DONE written last) plus
                                   replay_service_checkpoint.json, which records the backend,
                                   the item count and each file's size and SHA-256; newest =
                                   highest
      .reverb/                     the staging root: Reverb's own checkpointer root (only
                                   Reverb writes here), where every checkpoint is written
      .restore/                    while a server starts: the checkpoint being restored, with
                                   the table options configured now (see
                                   `reverb_internals.restore_view`)
      .lock                        held by the one process serving this directory
      corrupt/                     checkpoints that failed to restore, moved aside
      .memmap/                     the local backend's memory-mapped tables (storage="memmap")
      .snapshots/                  snapshots being read (`CheckpointStore.snapshot`): never
        snapshot-<pid>-<hex>/      checkpoints, each marked by replay_service_snapshot.json

Every directory replay_service writes or deletes in (`OWN_DIRS`) must be a real directory: a
symbolic link there is refused when the directory is locked, before anything is written, so no
write or delete ever reaches outside `checkpoint_dir` (a `ckpt-*` entry that is a link is not a
checkpoint and is never touched).

Each checkpoint records the backend that wrote it ("reverb" or "local"); checkpoints written
before that field existed are recognised by their files, as the backends' checkpoint formats
(`storage.checkpoint_format`) tell. Loading a checkpoint of the other
backend raises `BackendMismatchError` and moves nothing (it is not damaged).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Callable, Sequence

from replay_service.config.options import validate_path
from replay_service.errors import (
    BackendMismatchError,
    CheckpointError,
    NoCheckpointError,
    ReplayServiceError,
)
from replay_service.storage import formats
from replay_service.storage.checkpoint_format import CheckpointFormat, registered
from replay_service.storage.file_modes import open_regular, regular_file_exists
from replay_service.storage.files import DONE_FILE, is_done, is_settled, list_dir
from replay_service.storage.metadata import Checkpoint, StoreMetadata

STORE_FILE = "replay_service.json"
CHECKPOINTS_DIR = "checkpoints"
REVERB_DIR = ".reverb"
RESTORE_DIR = ".restore"
LOCK_FILE = ".lock"
CORRUPT_DIR = "corrupt"
MEMMAP_DIR = ".memmap"
SNAPSHOTS_DIR = ".snapshots"
# The directories of a store that replay_service writes and deletes in: never symbolic links.
OWN_DIRS = (CHECKPOINTS_DIR, REVERB_DIR, RESTORE_DIR, CORRUPT_DIR, MEMMAP_DIR, SNAPSHOTS_DIR)
CHECKPOINT_META_FILE = "replay_service_checkpoint.json"
CHECKPOINT_PREFIX = "ckpt-"


class CheckpointDirectory:
    """Reads one checkpoint directory, changing nothing (see module docstring).

    Args:
      root: The user's `checkpoint_dir`.
      formats: The checkpoint formats to know checkpoints by, in the order a directory is
        matched (see `storage.checkpoint_format`); None (the default): the registered ones,
        every backend's. They tell which backend wrote a checkpoint where that is not
        recorded (`Checkpoint.backend`).
    """

    def __init__(
        self, root: str | os.PathLike[str], formats: Sequence[CheckpointFormat] | None = None
    ) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self._formats = None if formats is None else tuple(formats)

    @property
    def formats(self) -> tuple[CheckpointFormat, ...]:
        """The checkpoint formats this directory knows (given, or the registered ones)."""
        return registered() if self._formats is None else self._formats

    @property
    def reverb_root(self) -> str:
        """The directory handed to Reverb's checkpointer."""
        return os.path.join(self.root, REVERB_DIR)

    @property
    def restore_dir(self) -> str:
        """Where the view of a checkpoint being restored is written.

        See `reverb_internals.restore_view`.
        """
        return os.path.join(self.root, RESTORE_DIR)

    @property
    def checkpoints_dir(self) -> str:
        """The directory holding complete checkpoints."""
        return os.path.join(self.root, CHECKPOINTS_DIR)

    @property
    def store_file(self) -> str:
        """Path of the store metadata file."""
        return os.path.join(self.root, STORE_FILE)

    # ----------------------------------------------------------------------------- inspection

    def is_store(self) -> bool:
        """Whether the directory holds a replay_service store file.

        Raises:
          NotRegularFileError: If something other than a regular file is in its place (a
            named pipe, a symbolic link...), naming it; it is not opened.
        """
        return regular_file_exists(self.store_file)

    def stored_layout(self) -> str | None:
        """The layout the store file records (what a load compares), for `layout="auto"`;
        None where there is no store or its file cannot be read (the load names why)."""
        if not self.is_store():
            return None
        try:
            return self.read_metadata().layout
        except ReplayServiceError:
            return None

    def read_metadata(self) -> StoreMetadata:
        """Reads the store metadata of an existing directory.

        Raises:
          NoCheckpointError: If the directory does not exist or is empty.
          CheckpointError: If it is not a directory, or holds something other than a store.
        """
        self._check_is_store()
        try:
            with open_regular(self.store_file, "r", encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"cannot read {self.store_file!r}: {e}") from e
        return StoreMetadata.from_json(data, self.store_file)

    def entries(self) -> list[tuple[int, str]]:
        """Every `ckpt-NNNNNNNN` directory under `checkpoints/`, complete or not, oldest first."""
        found = []
        for name in list_dir(self.checkpoints_dir):
            sequence = parse_sequence(name)
            path = os.path.join(self.checkpoints_dir, name)
            if sequence is not None and os.path.isdir(path) and not os.path.islink(path):
                found.append((sequence, path))
        return sorted(found)

    def read_checkpoint(self, sequence: int, path: str) -> Checkpoint:
        """Reads the metadata of the checkpoint directory `path`.

        Raises:
          UnknownFormatError: If the metadata file's format is unknown or newer (not damage).
          CheckpointError: If `DONE` or the metadata file is missing or unreadable.
          NotRegularFileError: If one of them is not a regular file (a named pipe...).
        """
        if not is_done(path):
            raise CheckpointError(f"checkpoint {path!r} has no {DONE_FILE} file")
        meta_path = os.path.join(path, CHECKPOINT_META_FILE)
        try:
            with open_regular(meta_path, "r", encoding="utf-8") as f:
                info = json.load(f)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {meta_path!r}: {e}") from e
        if not isinstance(info, dict):
            raise CheckpointError(f"{meta_path!r} is malformed: {type(info).__name__}")
        formats.STORE.check(info.get("format"), repr(meta_path))
        return Checkpoint(path=path, sequence=sequence, info=info, formats=self.formats)

    def checkpoints(self) -> list[Checkpoint]:
        """Returns the checkpoints whose `DONE` and metadata file read, oldest first."""
        found = []
        for sequence, path in self.entries():
            with contextlib.suppress(CheckpointError):
                found.append(self.read_checkpoint(sequence, path))
        return found

    def latest(self) -> Checkpoint | None:
        """Returns the newest checkpoint whose `DONE` and metadata file read, or None."""
        checkpoints = self.checkpoints()
        return checkpoints[-1] if checkpoints else None

    def check_backend(self, backend: str) -> None:
        """Refuses a directory whose newest readable checkpoint another backend wrote, before
        its configuration is compared with this one (a Reverb buffer's packed layout is no
        mistake of a local one's configuration).

        Raises:
          BackendMismatchError: If so (nothing is moved).
        """
        latest = self.latest()
        if latest is not None:
            check_backend_of(latest, backend)

    def has_checkpoints(self) -> bool:
        """Whether a replay_service store here holds any checkpoint, complete or damaged.

        A damaged checkpoint counts: a directory that held items must never be mistaken for an
        empty one (`replay-server --restore_if_exists` then refuses instead of starting empty).
        """
        return self.is_store() and bool(self.entries() or self.staged() or self.quarantined())

    def quarantined(self) -> list[str]:
        """Checkpoints moved to `corrupt/`, while `checkpoints/` holds none.

        They still count as data: a directory whose only checkpoints failed to restore must not
        look empty (a new buffer there needs overwrite, which keeps `corrupt/`). Once a new
        checkpoint exists, the new buffer was started deliberately and they no longer count.
        """
        if self.entries():
            return []
        corrupt = os.path.join(self.root, CORRUPT_DIR)
        return [
            os.path.join(corrupt, name)
            for name in sorted(list_dir(corrupt))
            if name.startswith(CHECKPOINT_PREFIX)
        ]

    def staged(self, settled_only: bool = False) -> list[str]:
        """Complete checkpoints still in the staging root (e.g. from `py_client.checkpoint()`).

        Args:
          settled_only: Only those finished long enough ago that their writer is surely done
            with the staging root (the longest `settle_s` of the store's formats), so a
            running server may move them without failing a client's save.
        """
        settle_s = max((f.settle_s for f in self.formats), default=0.0)
        return [
            os.path.join(self.reverb_root, name)
            for name in sorted(list_dir(self.reverb_root))
            if (
                is_settled(os.path.join(self.reverb_root, name), settle_s)
                if settled_only
                else is_done(os.path.join(self.reverb_root, name))
            )
        ]

    @property
    def snapshots_dir(self) -> str:
        """Where snapshots are read (`snapshot`); never a place checkpoints are listed from."""
        return os.path.join(self.root, SNAPSHOTS_DIR)

    def check_own_dirs(self) -> None:
        """Refuses a store whose own directories (`OWN_DIRS`) or checkpoints include a symbolic
        link (`serving.check_own_dirs`); nothing is changed.

        Raises:
          CheckpointError: Naming the link and where it points.
        """
        check_own_dirs(self.root, OWN_DIRS)
        self.check_checkpoint_links()

    def check_checkpoint_links(self) -> None:
        """Refuses a `ckpt-NNNNNNNN` entry of `checkpoints/` that is a symbolic link
        (`serving.check_checkpoint_links`).

        Raises:
          CheckpointError: Naming the link and where it points.
        """
        check_checkpoint_links(self.checkpoints_dir, lambda name: parse_sequence(name) is not None)

    def check_root(self) -> None:
        """Checks that `checkpoint_dir` resolves (it need not exist yet; `serving.check_root`).

        Raises:
          CheckpointError: If resolving it fails for another reason than its absence, e.g. a
            symbolic link that points to itself (ELOOP), naming the path.
          ConfigError: If the path holds a NUL character, naming it.
        """
        check_root(self.root)

    def _check_is_store(self) -> None:
        self.check_root()
        if not os.path.exists(self.root):
            raise NoCheckpointError(f"checkpoint_dir {self.root!r} does not exist")
        if not os.path.isdir(self.root):
            raise CheckpointError(f"checkpoint_dir {self.root!r} is not a directory")
        if self.is_store():
            return
        entries = [e for e in list_dir(self.root) if e != LOCK_FILE]
        if not entries:
            raise NoCheckpointError(
                f"checkpoint_dir {self.root!r} is empty: there is nothing to load; "
                "use create_replay_buffer() to start a new buffer"
            )
        raise CheckpointError(foreign_message(self.root, entries, STORE_FILE))


def parse_sequence(name: str) -> int | None:
    digits = name.removeprefix(CHECKPOINT_PREFIX)
    # ASCII digits only: str.isdigit() also takes superscripts ("²"), which int() refuses.
    if name.startswith(CHECKPOINT_PREFIX) and digits.isascii() and digits.isdigit():
        return int(digits)
    return None


def check_backend_of(checkpoint: Checkpoint, backend: str) -> None:
    """Raises `BackendMismatchError` if `checkpoint` was written by another backend than
    `backend` (one of unknown origin goes on to be verified by the loader)."""
    written = checkpoint.backend
    if written is None or written == backend:
        return
    raise BackendMismatchError(
        f"checkpoint {checkpoint.path!r} was written by the {written!r} backend, but this buffer "
        f"uses backend={backend!r}, which cannot read it; nothing was moved or changed. Load it "
        f"with backend={written!r}; to move the buffer to the {backend!r} backend, load it with "
        f"backend={written!r}, export() it, and import_buffer() the export into a new buffer "
        f"with backend={backend!r}"
    )


def check_root(root: str) -> None:
    """Checks that the checkpoint directory `root` resolves (it need not exist yet).

    Raises:
      CheckpointError: If resolving it fails for another reason than its absence, e.g. a
        symbolic link that points to itself (ELOOP), or it is a symbolic link to nothing,
        naming the path.
      ConfigError: If the path holds a NUL character, naming it.
    """
    validate_path(root, "checkpoint_dir")
    try:
        os.stat(root)
    except FileNotFoundError:
        if os.path.islink(root):  # a link to nothing: no directory can be made through it
            raise CheckpointError(
                f"checkpoint_dir {root!r} is a symbolic link to {os.readlink(root)!r}, which "
                "does not exist; create the directory it points to, or choose another "
                "checkpoint_dir"
            ) from None
        return
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(
                f"checkpoint_dir {root!r} cannot be resolved: a symbolic link on that "
                "path loops (points to itself, directly or through other links); fix or "
                "remove the link, or choose another checkpoint_dir"
            ) from e
        raise CheckpointError(f"cannot use checkpoint_dir {root!r}: {e}") from e


def check_own_dirs(root: str, names: Sequence[str]) -> None:
    """Refuses a checkpoint directory where one of its own directories `names` is a symbolic
    link.

    replay_service writes into and deletes inside these directories (Reverb itself deletes
    every entry of `.reverb/` but the newest), so a link there would let those writes and
    deletes reach outside `checkpoint_dir`. Nothing is changed.

    Raises:
      CheckpointError: Naming the link and where it points.
    """
    for name in names:
        path = os.path.join(root, name)
        if os.path.islink(path):
            raise CheckpointError(
                f"{path!r} is a symbolic link (to {_points_to(path)!r}); replay_service writes "
                f"and deletes inside {name}/ and never follows links, so that nothing outside "
                f"checkpoint_dir {root!r} is touched. Nothing was changed: replace the "
                "link with a real directory (move what it points to aside first if you "
                "need it)"
            )


def check_checkpoint_links(checkpoints_dir: str, is_checkpoint: Callable[[str], bool]) -> None:
    """Refuses a checkpoint entry of `checkpoints_dir` (a name `is_checkpoint` accepts) that is
    a symbolic link: it is neither followed nor deleted, so reading the newest checkpoint (a
    load, a copy) would skip it and take an older one without a word.

    Raises:
      CheckpointError: Naming the link and where it points.
    """
    for name in list_dir(checkpoints_dir):
        path = os.path.join(checkpoints_dir, name)
        if is_checkpoint(name) and os.path.islink(path):
            raise CheckpointError(
                f"checkpoint {path!r} is a symbolic link (to {_points_to(path)!r}); checkpoints "
                "are directories of checkpoint_dir, and a link is neither followed nor "
                "deleted, so loading would skip it and restore an older checkpoint without "
                "a word. Nothing was changed: replace the link with the directory it points "
                "to (or remove it)"
            )


def _points_to(link: str) -> str:
    try:
        return os.readlink(link)
    except OSError:
        return "?"


def foreign_message(root: str, entries: list[str], store_file: str) -> str:
    """Why `root`, which holds `entries` but no `store_file`, is refused, and the way out."""
    shown = ", ".join(sorted(entries)[:5]) + (", ..." if len(entries) > 5 else "")
    hint = ""
    if any(os.path.isfile(os.path.join(root, e, DONE_FILE)) for e in entries):
        hint = (
            " It is a bare Reverb checkpoint root (as Reverb's DefaultCheckpointer writes, e.g. "
            "an sbsim starter buffer); adopt it into a new replay_service checkpoint directory "
            f"with `replay-populate --buffer-name {os.path.basename(root)} --output-dir "
            f"{os.path.dirname(root)} --copy-to NEW_DIR --data-spec MODULE:FUNCTION` (the "
            "data spec is needed when the table has no signature, as sbsim's has not) or "
            f"`replay_service.copy_buffer({root!r}, NEW_DIR, data_spec=...)`, then load that."
        )
    return (
        f"checkpoint_dir {root!r} is not a replay_service checkpoint directory (no {store_file}); "
        f"it contains: {shown}.{hint} Use an empty or new directory; files that are not "
        "replay_service's are never deleted."
    )

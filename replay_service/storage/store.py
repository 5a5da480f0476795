"""The on-disk layout of a checkpoint directory, owned by replay_service.

    <checkpoint_dir>/
      replay_service.json          what the store holds: table name, sequence length, capacity,
                                   data spec, extra tables, variable tables and their specs
                                   (written when a new buffer starts)
      checkpoints/
        ckpt-00000001/             one complete Reverb checkpoint (tables/chunks/items.tfrecord,
        ckpt-00000002/             DONE) plus replay_service_checkpoint.json, which records
                                   the item count and each file's size and SHA-256; newest =
                                   highest
      .reverb/                     Reverb's own checkpointer root: only Reverb writes here
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
checkpoint and is never touched). Files are written with `file_modes.FILE_MODE` and directories
with `file_modes.DIR_MODE`, whatever the umask.

Each checkpoint records the backend that wrote it ("reverb" or "local"); checkpoints written
before that field existed are recognised by their files. Loading a checkpoint of the other
backend raises `BackendMismatchError` and moves nothing (it is not damaged).

Reverb keeps only the lexicographically largest entry of its checkpoint root and deletes the
rest, so any foreign file there can make it delete the checkpoint it just wrote. Reverb therefore
writes into `.reverb/`, which holds nothing else, and each finished checkpoint is moved (one
atomic rename) into `checkpoints/` under an increasing sequence number, where retention is ours.
A directory under `checkpoints/` is verified by construction: it appears only after Reverb wrote
`DONE`, every file was read back to its end (the item count and checksums are recorded) and the
metadata file was synced. Reverb writes `DONE` even after a truncated file (a full disk), so
`DONE` alone proves nothing.

A checkpoint directory that later fails a check (damaged or missing metadata, a file whose
digest changed, fewer items restored than recorded) is moved to `corrupt/`, never deleted, and
the previous checkpoint is used. A file whose format tag is unknown or of a newer version
(`storage.formats`) is not damage: the load is refused with `UnknownFormatError` and nothing is
moved. While `checkpoints/` holds no checkpoint, those in `corrupt/`
still count as data: a new buffer there needs overwrite, and `replay-server --restore_if_exists`
keeps refusing to start empty. Retention deletes a checkpoint only when at least `keep` newer
verified ones exist.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import json
import logging
import os
import shutil
import stat
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import filelock

from replay_service.backends.reverb.internals import (
    DONE_FILE,
    is_reverb_checkpoint,
    is_settled_checkpoint,
    verify_files,
)
from replay_service.config.options import DEFAULT_KEEP, validate_path
from replay_service.errors import (
    BackendMismatchError,
    CheckpointError,
    CheckpointExistsError,
    ConfigError,
    NoCheckpointError,
    NotRegularFileError,
    ReplayServiceError,
    SpecMismatchError,
    UnknownFormatError,
)
from replay_service.specs.nests import FieldDescription, describe_spec, diff_descriptions
from replay_service.storage import formats
from replay_service.storage.file_modes import (
    DIR_MODE,
    FILE_MODE,
    fsync_dir,
    make_dirs,
    open_regular,
    regular_file_exists,
    restrict_tree,
    write_json_atomic,
)

_T = TypeVar("_T")

if TYPE_CHECKING:
    from replay_service.config.options import TableConfig, VariableTableConfig

FORMAT = formats.STORE.tag
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
BACKENDS = ("reverb", "local")
CHECKPOINT_META_FILE = "replay_service_checkpoint.json"
REVERB_DONE_FILE = DONE_FILE
CHECKPOINT_PREFIX = "ckpt-"
# A snapshot (`CheckpointStore.snapshot`): `.snapshots/snapshot-<pid>-<32 hex>/`, holding the
# marker file (written before anything else) and, once written, the checkpoint read.
SNAPSHOT_FORMAT = "replay_service.snapshot/1"
SNAPSHOT_PREFIX = "snapshot-"
SNAPSHOT_MARKER_FILE = "replay_service_snapshot.json"
SNAPSHOT_DATA_DIR = "checkpoint"
# Writes of one snapshot before giving up, when a client's save deletes each one first.
SNAPSHOT_WRITES = 3

_log = logging.getLogger(__name__)

# What a checkpoint's writer returns: the directory it wrote, and `(num_items, files)` if it
# already read the files back (see `CheckpointStore.commit`).
Verified = tuple[int, dict[str, dict[str, Any]]]
WriteCheckpoint = Callable[[str], tuple[str, Verified | None]]


@dataclasses.dataclass(frozen=True)
class TableSummary:
    """What is recorded of a table served next to the primary one.

    Attributes:
      name: Table name.
      sequence_length: Steps per item.
      capacity: Maximum number of items.
    """

    name: str
    sequence_length: int
    capacity: int


@dataclasses.dataclass(frozen=True)
class VariableTableSummary:
    """What is recorded of a variable-container table (see `config.VariableTableConfig`).

    Attributes:
      name: Table name.
      spec: Field descriptions of its signature, from `specs.describe_spec`.
    """

    name: str
    spec: list[FieldDescription]


@dataclasses.dataclass(frozen=True)
class StoreMetadata:
    """What a checkpoint directory holds, checked on every restore.

    Attributes:
      table_name: Name of the primary Reverb table.
      sequence_length: Steps per item of the primary table.
      capacity: Maximum number of items of the primary table that was checkpointed.
      data_spec: Field descriptions from `specs.describe_spec` (shared by every table).
      extra_tables: The other tables of the same server, in order. Files written before
        several tables were supported have no such field: they hold none.
      pad_end_of_episode: Whether items are padded `Masked` sequences (`sequences.py`), for
        every table.
      variable_tables: The variable-container tables of the same server, each with its own
        spec. Files written before they were supported have no such field: they hold none.
      layout: The storage layout of every replay table ("nested" or "packed", see
        `config.TableConfig`); files without the field hold nested tables.
    """

    table_name: str
    sequence_length: int
    capacity: int
    data_spec: list[FieldDescription]
    extra_tables: tuple[TableSummary, ...] = ()
    pad_end_of_episode: bool = False
    variable_tables: tuple[VariableTableSummary, ...] = ()
    layout: str = "nested"

    @classmethod
    def for_tables(
        cls,
        table: TableConfig,
        data_spec: Any,
        extra_tables: Sequence[TableConfig] = (),
        variable_tables: Sequence[VariableTableConfig] = (),
    ) -> StoreMetadata:
        """The metadata of a server holding `table` (primary), `extra_tables` and
        `variable_tables`.

        Args:
          table: The primary table.
          data_spec: Per-step data spec of every replay table.
          extra_tables: The other replay tables, in order.
          variable_tables: The variable-container tables, in order.

        Returns:
          The metadata to record and compare on restore.
        """
        return cls(
            table_name=table.name,
            sequence_length=table.sequence_length,
            capacity=table.capacity,
            data_spec=describe_spec(data_spec),
            extra_tables=tuple(
                TableSummary(name=t.name, sequence_length=t.sequence_length, capacity=t.capacity)
                for t in extra_tables
            ),
            pad_end_of_episode=table.pad_end_of_episode,
            variable_tables=tuple(
                VariableTableSummary(name=v.name, spec=describe_spec(v.spec))
                for v in variable_tables
            ),
            layout=table.layout,
        )

    def to_json(self) -> dict[str, Any]:
        """Returns the JSON form, tagged with the layout format."""
        data = dataclasses.asdict(self)
        data["extra_tables"] = [dataclasses.asdict(t) for t in self.extra_tables]
        data["variable_tables"] = [dataclasses.asdict(t) for t in self.variable_tables]
        return {"format": FORMAT, **data}

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str) -> StoreMetadata:
        """Parses `to_json` output; a missing `extra_tables` or `variable_tables` field means
        no such tables.

        Raises:
          UnknownFormatError: If the format tag is unknown or of a newer version (not damage).
          CheckpointError: If the format tag or a field is missing or wrong.
        """
        if not isinstance(data, dict):
            raise CheckpointError(f"{source} is not a {FORMAT} file: {type(data).__name__}")
        formats.STORE.check(data.get("format"), source)
        try:
            return cls(
                table_name=str(data["table_name"]),
                sequence_length=int(data["sequence_length"]),
                capacity=int(data["capacity"]),
                data_spec=list(data["data_spec"]),
                extra_tables=tuple(
                    TableSummary(
                        name=str(t["name"]),
                        sequence_length=int(t["sequence_length"]),
                        capacity=int(t["capacity"]),
                    )
                    for t in data.get("extra_tables", [])
                ),
                pad_end_of_episode=bool(data.get("pad_end_of_episode", False)),
                variable_tables=tuple(
                    VariableTableSummary(name=str(t["name"]), spec=list(t["spec"]))
                    for t in data.get("variable_tables", [])
                ),
                layout=str(data.get("layout", "nested")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{source} is malformed: {e!r}") from e

    def differences(self, requested: StoreMetadata) -> list[str]:
        """Names every field where `requested` (the caller's) differs from this (stored) one.

        Capacity counts as a difference: Reverb restores the stored capacity and ignores the
        table it is given, so a restore with another capacity would silently keep the old one.
        The extra tables must be the same set of names with the same capacity and sequence
        length each; the variable tables the same set of names with the same spec each.
        """
        problems = [
            f"{name}: requested {getattr(requested, name)!r}, stored {getattr(self, name)!r}"
            for name in ("table_name", "sequence_length", "pad_end_of_episode", "capacity")
            if getattr(requested, name) != getattr(self, name)
        ]
        if requested.capacity != self.capacity:
            problems[-1] += (
                f" (Reverb restores the stored capacity; use capacity={self.capacity}, or "
                "export and import the buffer to resize it)"
            )
        if requested.layout != self.layout:
            problems.append(
                f"layout: requested {requested.layout!r}, stored {self.layout!r} (the stored "
                f"items are {self.layout}; use layout={self.layout!r}, or export the buffer and "
                "import it into one of the other layout)"
            )
        problems += _extra_table_differences(requested.extra_tables, self.extra_tables)
        problems += [
            f"data_spec {p}" for p in diff_descriptions(requested.data_spec, self.data_spec)
        ]
        problems += _variable_table_differences(requested.variable_tables, self.variable_tables)
        return problems

    def check_matches(self, requested: StoreMetadata, where: str) -> None:
        """Refuses to load this (stored) metadata into a buffer configured as `requested`.

        Args:
          requested: The metadata of the configured tables and data spec.
          where: The file or checkpoint this metadata was read from (named in the error).

        Raises:
          SpecMismatchError: If any field differs (`differences`), naming `where` and each
            difference.
        """
        problems = self.differences(requested)
        if problems:
            raise SpecMismatchError(
                f"{where} does not match the configured table: " + "; ".join(problems)
            )


def _by_name(
    kind: str, requested: Sequence[Any], stored: Sequence[Any]
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """Both lists of tables by name, and the difference of their name sets (if any)."""
    wanted = {t.name: t for t in requested}
    found = {t.name: t for t in stored}
    problems = []
    if wanted.keys() != found.keys():
        problems.append(
            f"{kind}: requested {sorted(wanted)}, stored {sorted(found)} (missing from the "
            f"checkpoint: {sorted(wanted.keys() - found.keys())}; not requested: "
            f"{sorted(found.keys() - wanted.keys())})"
        )
    return wanted, found, problems


def _extra_table_differences(
    requested: Sequence[TableSummary], stored: Sequence[TableSummary]
) -> list[str]:
    wanted, found, problems = _by_name("extra_tables", requested, stored)
    for name in sorted(wanted.keys() & found.keys()):
        for field in ("sequence_length", "capacity"):
            want, have = getattr(wanted[name], field), getattr(found[name], field)
            if want != have:
                problems.append(
                    f"extra table {name!r} {field}: requested {want!r}, stored {have!r}"
                )
    return problems


def _variable_table_differences(
    requested: Sequence[VariableTableSummary], stored: Sequence[VariableTableSummary]
) -> list[str]:
    wanted, found, problems = _by_name("variable_tables", requested, stored)
    for name in sorted(wanted.keys() & found.keys()):
        problems += [
            f"variable table {name!r} spec {p}"
            for p in diff_descriptions(wanted[name].spec, found[name].spec)
        ]
    return problems


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One complete checkpoint.

    Attributes:
      path: Directory holding the Reverb checkpoint files.
      sequence: Position in the store; higher is newer.
      info: Contents of its `replay_service_checkpoint.json`.
    """

    path: str
    sequence: int
    info: dict[str, Any]

    @property
    def metadata(self) -> StoreMetadata:
        """The store metadata recorded with this checkpoint."""
        return StoreMetadata.from_json(self.info.get("store", {}), self.path)

    @property
    def num_items(self) -> int | None:
        """Items recorded at checkpoint (every table), or None if unknown."""
        value = self.info.get("num_items")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def files(self) -> dict[str, Any] | None:
        """Size and SHA-256 of each data file, recorded at checkpoint; None for checkpoints
        written before files were verified (their files are read back in full on load)."""
        files = self.info.get("files")
        return files if isinstance(files, dict) else None

    @property
    def backend(self) -> str | None:
        """The backend that wrote it: "reverb" or "local" as recorded, else (checkpoints
        written before the field existed) as its recorded or present files show; None if
        neither kind of file is there."""
        recorded = self.info.get("backend")
        if recorded in BACKENDS:
            return recorded
        files = self.files
        return backend_of_files(list(files) if files is not None else _listdir(self.path))


class CheckpointStore:
    """Reads, validates and maintains one checkpoint directory (see module docstring).

    Args:
      root: The user's `checkpoint_dir`.
      keep: How many complete checkpoints to retain; older ones are deleted.

    Raises:
      ConfigError: If `keep` < 1.
    """

    def __init__(self, root: str | os.PathLike[str], keep: int = DEFAULT_KEEP) -> None:
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ConfigError(f"keep (checkpoints to retain) must be an integer >= 1, got {keep!r}")
        self.root = os.path.abspath(os.fspath(root))
        self.keep = keep
        self._lock: filelock.BaseFileLock | None = None
        self._lock_fd: int | None = None

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
        for name in _listdir(self.checkpoints_dir):
            sequence = _parse_sequence(name)
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
        if not is_reverb_checkpoint(path):
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
        return Checkpoint(path=path, sequence=sequence, info=info)

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
            _check_backend(latest, backend)

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
            for name in sorted(_listdir(corrupt))
            if name.startswith(CHECKPOINT_PREFIX)
        ]

    def staged(self, settled_only: bool = False) -> list[str]:
        """Complete checkpoints still in Reverb's root (e.g. from `py_client.checkpoint()`).

        Args:
          settled_only: Only those finished `SAVE_SETTLE_S` ago or earlier, which a running
            server may move without failing the client's save (see `is_settled_checkpoint`).
        """
        done = is_settled_checkpoint if settled_only else is_reverb_checkpoint
        return [
            os.path.join(self.reverb_root, name)
            for name in sorted(_listdir(self.reverb_root))
            if done(os.path.join(self.reverb_root, name))
        ]

    # ------------------------------------------------------------------------------- changes

    def check_new(self, overwrite: bool = False) -> None:
        """Checks, without writing anything, that a new buffer may start in this directory.

        Args:
          overwrite: Whether existing checkpoints of a replay_service store may be deleted.

        Raises:
          CheckpointExistsError: If checkpoints exist and `overwrite` is False.
          CheckpointError: If the path is not a directory, cannot be resolved (a looping
            symbolic link), holds foreign files, or one of its own directories (`OWN_DIRS`) is
            a symbolic link or cannot be listed.
        """
        self.check_root()
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise CheckpointError(f"checkpoint_dir {self.root!r} exists and is not a directory")
        self.check_own_dirs()  # before listing them: a looping link must not fail the listing
        entries = [e for e in _listdir(self.root) if e != LOCK_FILE]
        if entries and not self.is_store():
            raise CheckpointError(_foreign_message(self.root, entries))
        existing = len(self.entries()) + len(self.staged()) if self.is_store() else 0
        damaged = self.quarantined() if self.is_store() else []
        if (existing or damaged) and not overwrite:
            held = (
                f"{existing} checkpoint(s)"
                if existing
                else f"only checkpoints that failed to restore ({', '.join(damaged)})"
            )
            raise CheckpointExistsError(
                f"checkpoint_dir {self.root!r} already holds {held}. "
                "Continue from it (load_replay_buffer(), or replay-server --restore), delete "
                "them (create_replay_buffer(overwrite=True), or replay-server --overwrite), or "
                "choose another checkpoint_dir."
            )

    def prepare_new(self, metadata: StoreMetadata, overwrite: bool = False) -> None:
        """Makes the directory ready for a new, empty buffer and records its metadata.

        Args:
          metadata: What the new buffer holds.
          overwrite: Delete existing checkpoints of a replay_service store instead of refusing.
            Files that are not replay_service's (anything but `ckpt-NNNNNNNN` directories under
            `checkpoints/`) are never deleted; `corrupt/` is kept.

        Raises:
          CheckpointExistsError: If checkpoints exist and `overwrite` is False.
          CheckpointError: If the directory holds foreign files or cannot be written.
        """
        self.check_new(overwrite)
        self.check_own_dirs()
        self.clean_snapshots()
        try:
            make_dirs(self.root)
            remove_path(self.restore_dir)
            for _, path in self.entries():
                shutil.rmtree(path)
            if os.path.isdir(self.reverb_root):
                shutil.rmtree(self.reverb_root)
            self.ensure_dirs()
            write_json_atomic(self.store_file, metadata.to_json())
        except OSError as e:
            raise CheckpointError(f"cannot write checkpoint_dir {self.root!r}: {e}") from e

    def ensure_dirs(self) -> None:
        """Creates `checkpoints/` and `.reverb/` of an existing store if missing.

        Raises:
          CheckpointError: If they cannot be created.
        """
        try:
            for sub in (self.checkpoints_dir, self.reverb_root):
                make_dirs(sub)
        except OSError as e:
            raise CheckpointError(f"cannot write checkpoint_dir {self.root!r}: {e}") from e

    def clean_staging(self, metadata: StoreMetadata) -> list[Checkpoint]:
        """Adopts complete checkpoints from Reverb's root and clears it.

        Leaves Reverb's root empty, so its keep-only-the-largest rule cannot delete the next
        checkpoint because of an older, later-sorting entry (clock skew, a crash mid-write). A
        staged checkpoint that fails verification is moved to `corrupt/`; one without `DONE`
        (Reverb was stopped while writing it) holds nothing Reverb would load and is deleted.

        Returns:
          The checkpoints adopted, oldest first.

        Raises:
          CheckpointError: If the directory cannot be read or written.
        """
        adopted = []
        for path in self.staged():
            try:
                adopted.append(self.adopt(path, metadata))
            except UnknownFormatError:
                raise  # not damage: left in place
            except CheckpointError as e:
                if os.path.isdir(path) and not isinstance(e, NotRegularFileError):
                    moved = self.quarantine_path(path)
                    _log.warning(
                        "staged checkpoint %s is damaged (%s); moved it to %s", path, e, moved
                    )
                else:
                    raise
        self.discard_staging()
        return adopted

    def discard_staging(self) -> None:
        """Deletes everything in Reverb's root (partial or failed checkpoint writes)."""
        for name in _listdir(self.reverb_root):
            remove_path(os.path.join(self.reverb_root, name))

    def adopt_staged(self, metadata: StoreMetadata) -> list[Checkpoint]:
        """Adopts the complete checkpoints in Reverb's root, leaving partial ones alone.

        Safe while Reverb writes: a checkpoint is complete only once `DONE` exists, and it is
        moved only `SAVE_SETTLE_S` after that, once the save that wrote it has surely returned.
        One that fails verification is moved to `corrupt/` with a warning.
        """
        adopted = []
        for path in self.staged(settled_only=True):
            try:
                adopted.append(self.adopt(path, metadata))
            except UnknownFormatError:
                raise  # not damage: left in place
            except CheckpointError as e:
                if not os.path.isdir(path) or isinstance(e, NotRegularFileError):
                    raise
                moved = self.quarantine_path(path)
                _log.warning("staged checkpoint %s is damaged (%s); moved it to %s", path, e, moved)
        return adopted

    def next_sequence(self) -> int:
        """The sequence number of the next checkpoint: above every entry, damaged ones too."""
        entries = self.entries()
        return entries[-1][0] + 1 if entries else 1

    def adopt(
        self,
        reverb_path: str,
        metadata: StoreMetadata,
        verified: Verified | None = None,
    ) -> Checkpoint:
        """Verifies a finished Reverb checkpoint, moves it into `checkpoints/`, applies retention.

        Every data file is read to its end (see `reverb_internals.verify_files`); the item count
        and each file's size and SHA-256 are recorded in its metadata file, which is synced
        before the directory is renamed into place.

        Args:
          reverb_path: Directory Reverb wrote (must contain `DONE`).
          metadata: Store metadata recorded with the checkpoint.
          verified: `(num_items, files)` of a checkpoint its writer already read back and
            compared with what it meant to write (a local checkpoint); None reads it back here.

        Returns:
          The adopted checkpoint.

        Raises:
          CheckpointError: If `reverb_path` is incomplete or damaged (left where it is), or it
            cannot be moved (e.g. the disk is full); the message names the path.
        """
        num_items, files = verified or verify_checkpoint_files(reverb_path)
        sequence = self.next_sequence()
        info = {
            "format": FORMAT,
            "backend": backend_of_files(list(files)),
            "sequence": sequence,
            "created_at": datetime.datetime.now(datetime.UTC).isoformat(),
            "reverb_name": os.path.basename(reverb_path),
            "num_items": num_items,
            "files": {
                name: {"size": f["size"], "sha256": f["sha256"]} for name, f in files.items()
            },
            "store": metadata.to_json(),
        }
        target = os.path.join(self.checkpoints_dir, f"{CHECKPOINT_PREFIX}{sequence:08d}")
        meta_path = os.path.join(reverb_path, CHECKPOINT_META_FILE)
        try:
            with contextlib.suppress(PermissionError):  # files of another owner keep theirs
                restrict_tree(reverb_path)  # Reverb creates its files as the umask allows
            write_json_atomic(meta_path, info)
            make_dirs(self.checkpoints_dir)
            os.rename(reverb_path, target)
            fsync_dir(self.checkpoints_dir)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.remove(meta_path)
            raise CheckpointError(
                f"cannot move checkpoint {reverb_path!r} to {target!r}: {e}"
            ) from e
        self.prune()
        return Checkpoint(path=target, sequence=sequence, info=info)

    def commit(self, metadata: StoreMetadata, write: WriteCheckpoint) -> Checkpoint:
        """Takes one checkpoint: writes it into the staging root, verifies and adopts it.

        The steps every backend shares, in order: `ensure_intact`; `clean_staging` (so the
        staging root holds only what `write` writes); `write(staging_root)`; `adopt`. The
        caller holds its own checkpoint lock (writes into the buffer wait as it decides) and
        keeps the buffer's items whatever fails here.

        Args:
          metadata: Store metadata recorded with the checkpoint.
          write: Writes the checkpoint under the staging root it is given (`reverb_root`) and
            returns `(path, verified)`: the directory written, and `(num_items, files)` if the
            writer already read it back (None: `adopt` reads it back).

        Returns:
          The adopted checkpoint.

        Raises:
          CheckpointError: If the directory was replaced by another buffer's; if `write`
            raises (anything it raises is wrapped; the staging root is emptied, so nothing
            partial is left); or if adopting fails (the written checkpoint is deleted and the
            message says the buffer still holds its items). Each message names the path.
        """
        path, verified = self._write_staged(metadata, write, "checkpoint")
        try:
            return self.adopt(path, metadata, verified)
        except CheckpointError as e:
            remove_path(path)
            raise CheckpointError(
                f"{e}; the checkpoint was discarded and the buffer still holds its items"
            ) from e

    @property
    def snapshots_dir(self) -> str:
        """Where snapshots are read (`snapshot`); never a place checkpoints are listed from."""
        return os.path.join(self.root, SNAPSHOTS_DIR)

    def snapshot(
        self,
        metadata: StoreMetadata,
        write: WriteCheckpoint,
        read: Callable[[str], _T],
        *,
        guard: contextlib.AbstractContextManager[Any] | None = None,
    ) -> _T:
        """Writes a checkpoint, moves it out of the staging root, reads it with `read`, then
        deletes it.

        A read-only pass over the items (e.g. `epoch_batches`): the snapshot is never adopted,
        so it neither counts towards `keep` (no checkpoint of the user's is pruned for it) nor
        becomes the newest checkpoint. As soon as the write returns, it is renamed into its own
        `.snapshots/snapshot-<pid>-<hex>/` directory, whose marker file was written first:
        nothing that lists checkpoints (a load, `clean_staging`, retention) looks there, and a
        client's save (`py_client.checkpoint()`), which deletes the older entries of the
        staging root, cannot delete it while it is read. A write that such a save deleted
        before the move is written again (up to `SNAPSHOT_WRITES` times). The snapshot is
        deleted whatever `read` does; one left by a killed process is deleted on the next
        start (`clean_snapshots`).

        Args:
          metadata: Store metadata (the directory must still be this buffer's).
          write: As in `commit`.
          read: Reads the written checkpoint directory.
          guard: Held while the snapshot is written and moved (the caller's checkpoint lock:
            no other checkpoint cleans the staging root meanwhile), released before `read`,
            so checkpoints go on while it reads.

        Returns:
          What `read` returns.

        Raises:
          CheckpointError: If the directory was replaced, the snapshot cannot be written or
            moved (the staging root and the snapshot directory are emptied); whatever `read`
            raises.
        """
        holder = self._new_snapshot_dir()
        try:
            with guard if guard is not None else contextlib.nullcontext():
                path = self._write_snapshot(metadata, write, holder)
            return read(path)
        finally:
            shutil.rmtree(holder, ignore_errors=True)

    def _new_snapshot_dir(self) -> str:
        """Creates an empty `.snapshots/snapshot-<pid>-<hex>/` with its marker file.

        Raises:
          CheckpointError: If it cannot be created.
        """
        name = f"{SNAPSHOT_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        holder = os.path.join(self.snapshots_dir, name)
        marker = {
            "format": SNAPSHOT_FORMAT,
            "pid": os.getpid(),
            "created_at": datetime.datetime.now(datetime.UTC).isoformat(),
        }
        try:
            self.check_own_dirs()
            make_dirs(self.snapshots_dir)
            os.mkdir(holder, DIR_MODE)
            os.chmod(holder, DIR_MODE)
            write_json_atomic(os.path.join(holder, SNAPSHOT_MARKER_FILE), marker)
        except OSError as e:
            shutil.rmtree(holder, ignore_errors=True)
            raise CheckpointError(f"cannot create snapshot directory {holder!r}: {e}") from e
        return holder

    def _write_snapshot(self, metadata: StoreMetadata, write: WriteCheckpoint, holder: str) -> str:
        """Writes a checkpoint into the staging root and renames it to `<holder>/checkpoint`.

        Returns:
          The snapshot's checkpoint directory.

        Raises:
          CheckpointError: If writing fails, or each of `SNAPSHOT_WRITES` writes was deleted
            before it could be moved (by clients' saves), or it cannot be moved.
        """
        target = os.path.join(holder, SNAPSHOT_DATA_DIR)
        for attempt in range(1, SNAPSHOT_WRITES + 1):
            path, _ = self._write_staged(metadata, write, "snapshot")
            try:
                os.rename(path, target)
            except FileNotFoundError:
                # A client's save that finished after this one deleted it (Reverb keeps only
                # the newest entry of its root): its checkpoint is newer, write again.
                _log.warning(
                    "snapshot %s was deleted by another save before it was moved (write %d of %d)",
                    path,
                    attempt,
                    SNAPSHOT_WRITES,
                )
                continue
            except OSError as e:
                remove_path(path)
                raise CheckpointError(f"cannot move snapshot {path!r} to {target!r}: {e}") from e
            with contextlib.suppress(OSError):  # the staging root no longer lists it
                fsync_dir(self.reverb_root)
            return target
        raise CheckpointError(
            f"snapshot into {self.reverb_root!r} failed: each of {SNAPSHOT_WRITES} snapshots was "
            "deleted by another save (py_client.checkpoint()) before it could be moved; try "
            "again when clients checkpoint less often"
        )

    def clean_snapshots(self) -> list[str]:
        """Deletes the snapshots left by a process that was killed while it read one.

        Called with the directory locked, when a buffer starts in it: no snapshot of another
        process can be in use. Only what is provably a snapshot is deleted: an entry of
        `.snapshots/` named `snapshot-<pid>-<hex>` that is a real directory (not a link) and
        holds a regular `replay_service_snapshot.json` with the snapshot format tag, or holds
        nothing but that file's partial write (the process was killed while creating it).
        Anything else there is left alone with a warning. Links are never followed.

        Returns:
          The snapshot directories deleted.

        Raises:
          CheckpointError: If `.snapshots/` is a link or cannot be listed.
        """
        self.check_own_dirs()
        removed = []
        for name in sorted(_listdir(self.snapshots_dir)):
            path = os.path.join(self.snapshots_dir, name)
            if _is_own_snapshot(path, name):
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

    def _write_staged(
        self, metadata: StoreMetadata, write: WriteCheckpoint, what: str
    ) -> tuple[str, Verified | None]:
        """`write` into the staging root of this buffer's directory, once it is checked to be
        still in place and its staging root cleaned; a failed write empties the staging root.

        Raises:
          CheckpointError: If the directory was replaced, or `write` raises (wrapped, naming
            `what` and the staging root).
        """
        self.ensure_intact(metadata)
        self.clean_staging(metadata)
        try:
            return write(self.reverb_root)
        except Exception as e:  # Reverb raises RuntimeError; anything else is wrapped too
            self.discard_staging()
            raise CheckpointError(
                f"{what} into {self.reverb_root!r} failed: {type(e).__name__}: {e}"
            ) from e

    def restore_latest(
        self,
        metadata: StoreMetadata,
        load: Callable[[Checkpoint], None],
        discard: Callable[[], None],
        *,
        backend: str,
    ) -> Checkpoint:
        """Restores a buffer from the locked directory: the steps every backend shares.

        Creates `checkpoints/` and `.reverb/` if missing, deletes the snapshots a killed
        process left (`clean_snapshots`: never checkpoints), adopts or clears what the staging
        root holds (`clean_staging`), then loads the newest checkpoint that `load` accepts
        (`restore_newest`).

        Args:
          metadata: The configured buffer's metadata (recorded with adopted staged ones).
          load, discard, backend: As `restore_newest`.

        Returns:
          The checkpoint `restore_newest` loaded.

        Raises:
          As `ensure_dirs`, `clean_snapshots`, `clean_staging` and `restore_newest`.
        """
        self.ensure_dirs()
        self.clean_snapshots()
        self.clean_staging(metadata)
        return self.restore_newest(load, discard, backend=backend)

    def restore_newest(
        self, load: Callable[[Checkpoint], None], discard: Callable[[], None], *, backend: str
    ) -> Checkpoint:
        """Loads the newest checkpoint that `load` accepts, moving each one it refuses aside.

        Newest first: `load(checkpoint)` verifies and loads one; a `CheckpointError` from it
        (damage) calls `discard()` to drop what was half loaded, moves that checkpoint to
        `corrupt/` with a warning naming it and the one tried next, and tries the previous one.
        A `SpecMismatchError` (a configuration mistake, not damage) stops the search, and so
        does a checkpoint written by the other backend, before `load` sees it, one whose
        file format is unknown or newer (`UnknownFormatError`: written by a newer release; it is
        left in place and the load refused), and a `NotRegularFileError` (a named pipe or
        another kind of file where one of the checkpoint's files belongs: it is not the
        checkpoint's damage, and it is never moved).

        Args:
          load: Verifies and loads one checkpoint; raises `CheckpointError` for damage.
          discard: Drops what a failed `load` left half loaded.
          backend: The loading backend, "reverb" or "local".

        Returns:
          The checkpoint loaded.

        Raises:
          NoCheckpointError: If none is left that loads (naming those moved aside).
          BackendMismatchError: If the newest readable checkpoint was written by the other
            backend (nothing is moved).
          UnknownFormatError: If a file of the checkpoint tried has an unknown or newer format
            tag (nothing is moved).
          SpecMismatchError: From `load`.
          NotRegularFileError: If a file of a checkpoint is not a regular file (nothing is
            moved).
          CheckpointError: If a damaged checkpoint cannot be moved aside.
        """
        moved: list[str] = []
        for sequence, path in reversed(self.entries()):
            try:
                checkpoint = self.read_checkpoint(sequence, path)
                _check_backend(checkpoint, backend)
                load(checkpoint)
            except (SpecMismatchError, BackendMismatchError):
                raise
            except (UnknownFormatError, NotRegularFileError):
                discard()  # a newer release's format, or another kind of file: nothing moved
                raise
            except CheckpointError as e:
                discard()
                target = self.quarantine_path(path)
                moved.append(target)
                _log.warning(
                    "checkpoint %s cannot be restored (%s); moved it to %s and trying the "
                    "previous checkpoint",
                    path,
                    e,
                    target,
                )
                continue
            if moved:
                _log.warning(
                    "restored %s instead of the newer checkpoint(s) moved to %s",
                    checkpoint.path,
                    ", ".join(moved),
                )
            return checkpoint
        earlier = self.quarantined()
        aside = (
            f"; moved aside as damaged: {', '.join(moved)}"
            if moved
            else f"; checkpoints moved aside earlier as damaged: {', '.join(earlier)}"
            if earlier
            else ""
        )
        raise NoCheckpointError(
            f"checkpoint_dir {self.root!r} holds no complete checkpoint that verifies and "
            f"loads{aside}; "
            "start a new buffer (create_replay_buffer(overwrite=True), or replay-server "
            "--overwrite) only if that data may be lost"
        )

    def quarantine_path(self, path: str) -> str:
        """Moves the checkpoint directory `path` into `corrupt/`; returns its new path.

        Raises:
          CheckpointError: If it cannot be moved.
        """
        target_dir = os.path.join(self.root, CORRUPT_DIR)
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S%f")
        target = os.path.join(target_dir, f"{os.path.basename(path)}-{stamp}")
        try:
            make_dirs(target_dir)
            os.rename(path, target)
        except OSError as e:
            raise CheckpointError(f"cannot move {path!r} aside to {target_dir!r}: {e}") from e
        return target

    def prune(self) -> list[str]:
        """Deletes checkpoints older than the `keep` newest verified ones; returns their paths.

        Only checkpoints whose files were verified when taken count towards `keep`, so a
        damaged or unverified newest checkpoint never causes an older good one to go. With
        fewer than `keep` verified checkpoints nothing is deleted.
        """
        checkpoints = self.checkpoints()
        verified = [c for c in checkpoints if c.files is not None]
        if len(verified) < self.keep:
            return []
        oldest_kept = verified[-self.keep].sequence
        old = [c for c in checkpoints if c.sequence < oldest_kept]
        for checkpoint in old:
            shutil.rmtree(checkpoint.path, ignore_errors=True)
        return [c.path for c in old]

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Holds the directory's lock for the duration of the block (see `lock`)."""
        self.lock()
        try:
            yield
        finally:
            self.unlock()

    @contextlib.contextmanager
    def serving(self, on_error: Callable[[], None] | None = None) -> Iterator[None]:
        """Takes the directory's lock (see `lock`) for a buffer that starts in the block.

        The lock stays held when the block succeeds (the buffer's `unlock` releases it). If the
        block raises, `on_error()` (if given) runs first, to stop what started, then the lock is
        released and the error propagates.

        Args:
          on_error: Called while the lock is still held when the block fails.

        Raises:
          CheckpointError: If the directory cannot be locked (see `lock`).
        """
        self.lock()
        try:
            yield
        except BaseException:
            if on_error is not None:
                on_error()
            self.unlock()
            raise

    def lock(self) -> None:
        """Takes an exclusive, process-wide lock on the directory (a `filelock.FileLock` on
        `.lock`, which holds the holder's pid); it does not wait for another holder.

        Raises:
          CheckpointError: If another process (or manager) serves this directory, or `.lock`
            is not a regular file (a symbolic link is refused, never followed).
        """
        if self._lock is not None:
            return
        path = os.path.join(self.root, LOCK_FILE)
        self.check_root()
        try:
            make_dirs(self.root)
        except OSError as e:
            raise CheckpointError(f"cannot use checkpoint_dir {self.root!r}: {e}") from e
        _refuse_symlink(path)
        acquired: list[int] = []
        lock = filelock.FileLock(
            path,
            timeout=0,
            mode=FILE_MODE,
            thread_local=False,
            fallback_to_soft=False,
            preserve_lock_file=True,
            on_acquired=acquired.append,
        )
        try:
            lock.acquire()
        except filelock.Timeout:
            raise CheckpointError(
                f"checkpoint_dir {self.root!r} is in use by another buffer (lock held by pid "
                f"{_lock_holder(path)}); close it first or choose another checkpoint_dir"
            ) from None
        except OSError as e:
            if e.errno == errno.ELOOP or os.path.islink(path):
                _refuse_symlink(path)
            raise CheckpointError(f"cannot use checkpoint_dir {self.root!r}: {e}") from e
        fd = acquired[-1] if acquired else None
        try:
            if fd is not None:
                if not os.path.samestat(os.fstat(fd), os.lstat(path)):
                    raise CheckpointError(
                        f"{path!r} was replaced while it was being locked; try again"
                    )
                with contextlib.suppress(OSError):  # the pid is only for the message above
                    os.ftruncate(fd, 0)
                    os.lseek(fd, 0, os.SEEK_SET)
                    os.write(fd, str(os.getpid()).encode())
            self.check_own_dirs()
        except BaseException as e:
            lock.release(force=True)
            if isinstance(e, OSError):
                raise CheckpointError(f"cannot use checkpoint_dir {self.root!r}: {e}") from e
            raise
        self._lock = lock
        self._lock_fd = fd

    def check_own_dirs(self) -> None:
        """Refuses a store whose own directories (`OWN_DIRS`) or checkpoints include a symbolic
        link.

        replay_service writes into and deletes inside these directories (Reverb itself deletes
        every entry of `.reverb/` but the newest), so a link there would let those writes and
        deletes reach outside `checkpoint_dir`. Nothing is changed.

        A `ckpt-NNNNNNNN` link under `checkpoints/` is refused too: checkpoints are only ever
        read from real directories, so it would be skipped and a load would restore an older
        checkpoint without saying so.

        Raises:
          CheckpointError: Naming the link and where it points.
        """
        for name in OWN_DIRS:
            path = os.path.join(self.root, name)
            if os.path.islink(path):
                try:
                    points_to = os.readlink(path)
                except OSError:
                    points_to = "?"
                raise CheckpointError(
                    f"{path!r} is a symbolic link (to {points_to!r}); replay_service writes and "
                    f"deletes inside {name}/ and never follows links, so that nothing outside "
                    f"checkpoint_dir {self.root!r} is touched. Nothing was changed: replace the "
                    "link with a real directory (move what it points to aside first if you "
                    "need it)"
                )
        self.check_checkpoint_links()

    def check_checkpoint_links(self) -> None:
        """Refuses a `ckpt-NNNNNNNN` entry of `checkpoints/` that is a symbolic link: it is
        neither followed nor deleted, so reading the newest checkpoint (a load, a copy) would
        skip it and take an older one without a word.

        Raises:
          CheckpointError: Naming the link and where it points.
        """
        for name in _listdir(self.checkpoints_dir):
            path = os.path.join(self.checkpoints_dir, name)
            if _parse_sequence(name) is not None and os.path.islink(path):
                try:
                    points_to = os.readlink(path)
                except OSError:
                    points_to = "?"
                raise CheckpointError(
                    f"checkpoint {path!r} is a symbolic link (to {points_to!r}); checkpoints "
                    "are directories of checkpoint_dir, and a link is neither followed nor "
                    "deleted, so loading would skip it and restore an older checkpoint without "
                    "a word. Nothing was changed: replace the link with the directory it points "
                    "to (or remove it)"
                )

    def unlock(self) -> None:
        """Releases the lock taken by `lock` (no-op if not held)."""
        if self._lock is not None:
            with contextlib.suppress(OSError):
                self._lock.release(force=True)
            self._lock = None
            self._lock_fd = None

    def ensure_intact(self, metadata: StoreMetadata) -> None:
        """Checks that the locked directory is still in place before writing into it.

        If `checkpoint_dir` was removed (or replaced by an empty directory) while this process
        served it, it is created again with `metadata` and locked anew, with a warning, so the
        next checkpoint is a real one rather than a write into a deleted directory.

        Raises:
          CheckpointError: If the directory now holds another store, or cannot be recreated.
        """
        if self._lock is None:
            return
        try:
            same = self._lock_fd is None or os.path.samestat(
                os.fstat(self._lock_fd), os.lstat(os.path.join(self.root, LOCK_FILE))
            )
        except OSError:
            same = False
        if same and self.is_store():
            return
        if self.is_store():
            stored = self.read_metadata()
            if stored.differences(metadata):
                raise CheckpointError(
                    f"checkpoint_dir {self.root!r} was replaced while in use and now holds "
                    "another buffer; nothing was written"
                )
        _log.warning(
            "checkpoint_dir %s was removed or replaced while in use; recreating it", self.root
        )
        self.unlock()
        self.lock()
        self.ensure_dirs()
        if not self.is_store():
            try:
                write_json_atomic(self.store_file, metadata.to_json())
            except OSError as e:
                raise CheckpointError(f"cannot write {self.store_file!r}: {e}") from e

    # ------------------------------------------------------------------------------ helpers

    def check_root(self) -> None:
        """Checks that `checkpoint_dir` resolves (it need not exist yet).

        Raises:
          CheckpointError: If resolving it fails for another reason than its absence, e.g. a
            symbolic link that points to itself (ELOOP), naming the path.
          ConfigError: If the path holds a NUL character, naming it.
        """
        validate_path(self.root, "checkpoint_dir")
        try:
            os.stat(self.root)
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CheckpointError(
                    f"checkpoint_dir {self.root!r} cannot be resolved: a symbolic link on that "
                    "path loops (points to itself, directly or through other links); fix or "
                    "remove the link, or choose another checkpoint_dir"
                ) from e
            raise CheckpointError(f"cannot use checkpoint_dir {self.root!r}: {e}") from e

    def _check_is_store(self) -> None:
        self.check_root()
        if not os.path.exists(self.root):
            raise NoCheckpointError(f"checkpoint_dir {self.root!r} does not exist")
        if not os.path.isdir(self.root):
            raise CheckpointError(f"checkpoint_dir {self.root!r} is not a directory")
        if self.is_store():
            return
        entries = [e for e in _listdir(self.root) if e != LOCK_FILE]
        if not entries:
            raise NoCheckpointError(
                f"checkpoint_dir {self.root!r} is empty: there is nothing to load; "
                "use create_replay_buffer() to start a new buffer"
            )
        raise CheckpointError(_foreign_message(self.root, entries))


def _foreign_message(root: str, entries: list[str]) -> str:
    shown = ", ".join(sorted(entries)[:5]) + (", ..." if len(entries) > 5 else "")
    hint = ""
    if any(os.path.isfile(os.path.join(root, e, REVERB_DONE_FILE)) for e in entries):
        hint = (
            " It is a bare Reverb checkpoint root (as Reverb's DefaultCheckpointer writes, e.g. "
            "an sbsim starter buffer); adopt it into a new replay_service checkpoint directory "
            f"with `replay-populate --buffer-name {os.path.basename(root)} --output-dir "
            f"{os.path.dirname(root)} --copy-to NEW_DIR --data-spec MODULE:FUNCTION` (the "
            "data spec is needed when the table has no signature, as sbsim's has not) or "
            f"`replay_service.copy_buffer({root!r}, NEW_DIR, data_spec=...)`, then load that."
        )
    return (
        f"checkpoint_dir {root!r} is not a replay_service checkpoint directory (no {STORE_FILE}); "
        f"it contains: {shown}.{hint} Use an empty or new directory; files that are not "
        "replay_service's are never deleted."
    )


def remove_path(path: str) -> None:
    """Deletes a file or directory tree if it exists."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _is_own_snapshot(path: str, name: str) -> bool:
    """Whether `path` (an entry `name` of `.snapshots/`) is provably a snapshot directory that
    `CheckpointStore.snapshot` created: see `CheckpointStore.clean_snapshots`."""
    middle = name.removeprefix(SNAPSHOT_PREFIX)
    pid, _, token = middle.partition("-")
    if not (
        name.startswith(SNAPSHOT_PREFIX)
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
        marker = os.path.join(path, SNAPSHOT_MARKER_FILE)
        if SNAPSHOT_MARKER_FILE not in entries:
            # Killed between creating the directory and its marker: only its partial write.
            partial = f"{SNAPSHOT_MARKER_FILE}.tmp"
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
    return isinstance(data, dict) and data.get("format") == SNAPSHOT_FORMAT


def _parse_sequence(name: str) -> int | None:
    digits = name.removeprefix(CHECKPOINT_PREFIX)
    # ASCII digits only: str.isdigit() also takes superscripts ("²"), which int() refuses.
    if name.startswith(CHECKPOINT_PREFIX) and digits.isascii() and digits.isdigit():
        return int(digits)
    return None


def _listdir(path: str) -> list[str]:
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


def verify_checkpoint_files(path: str) -> tuple[int, dict[str, dict[str, Any]]]:
    """Reads a finished checkpoint back: a local-backend one (`local_checkpoint.verify`) or a
    Reverb one (`reverb_internals.verify_files`).

    Returns:
      `(num_items, files)`: items of every table, and per file its size and SHA-256.

    Raises:
      CheckpointError: If it is incomplete or damaged; the message names the file.
    """
    from replay_service.backends.local import checkpoint as local_checkpoint

    if local_checkpoint.is_local_checkpoint(path):
        return local_checkpoint.verify(path)
    return verify_files(path)


def backend_of_files(names: Sequence[str]) -> str | None:
    """The backend whose checkpoint holds files named `names`: "local" for a local checkpoint
    (its index or safetensors files), "reverb" for Reverb's tfrecord files, else None."""
    from replay_service.backends.local import checkpoint as local_checkpoint

    if any(n == local_checkpoint.INDEX_FILE or n.endswith(".safetensors") for n in names):
        return "local"
    if any(n.endswith(".tfrecord") for n in names):
        return "reverb"
    return None


def _check_backend(checkpoint: Checkpoint, backend: str) -> None:
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


def _refuse_symlink(path: str) -> None:
    """Raises `CheckpointError` if the lock file `path` is a symbolic link (never followed),
    and `NotRegularFileError` if it is another kind of file (a named pipe...)."""
    if os.path.islink(path):
        raise CheckpointError(
            f"{path!r} is a symbolic link; replay_service writes its lock there and "
            "never follows links: remove it"
        )
    regular_file_exists(path)


def _lock_holder(path: str) -> str:
    """The pid written in the lock file `path`, or "unknown"."""
    try:
        fd = os.open(
            path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        )
    except OSError:
        return "unknown"
    try:
        data = os.read(fd, 64)
    except OSError:
        data = b""
    finally:
        os.close(fd)
    return data.decode("utf-8", errors="replace").strip() or "unknown"

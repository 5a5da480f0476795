"""The on-disk layout of a checkpoint directory, owned by replay_service.

    <checkpoint_dir>/
      replay_service.json          what the store holds: table name, sequence length, capacity,
                                   data spec, extra tables (written by create_replay_buffer)
      checkpoints/
        ckpt-00000001/             one complete Reverb checkpoint (tables/chunks/items.tfrecord,
        ckpt-00000002/             DONE) plus replay_service_checkpoint.json; newest = highest
      .reverb/                     Reverb's own checkpointer root: only Reverb writes here
      .restore/                    while a server starts: the checkpoint being restored, with
                                   the table options configured now (see `restore.py`)
      .lock                        held by the one process serving this directory
      corrupt/                     checkpoints that failed to restore, moved aside

Reverb keeps only the lexicographically largest entry of its checkpoint root and deletes the
rest, so any foreign file there can make it delete the checkpoint it just wrote. Reverb therefore
writes into `.reverb/`, which holds nothing else, and each finished checkpoint is moved (one
atomic rename) into `checkpoints/` under an increasing sequence number, where retention is ours.
A directory under `checkpoints/` is complete by construction: it appears only after Reverb wrote
`DONE` and the metadata file was synced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from typing import IO, TYPE_CHECKING, Any

from replay_service.errors import (
    CheckpointError,
    CheckpointExistsError,
    ConfigError,
    NoCheckpointError,
)
from replay_service.specs import FieldDescription, describe_spec, diff_descriptions

if TYPE_CHECKING:
    from replay_service.config import TableConfig

FORMAT = "replay_service.checkpoint_dir/1"
STORE_FILE = "replay_service.json"
CHECKPOINTS_DIR = "checkpoints"
REVERB_DIR = ".reverb"
RESTORE_DIR = ".restore"
LOCK_FILE = ".lock"
CORRUPT_DIR = "corrupt"
CHECKPOINT_META_FILE = "replay_service_checkpoint.json"
REVERB_DONE_FILE = "DONE"
REVERB_ITEMS_FILE = "items.tfrecord"
CHECKPOINT_PREFIX = "ckpt-"
DEFAULT_KEEP = 3


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
    """

    table_name: str
    sequence_length: int
    capacity: int
    data_spec: list[FieldDescription]
    extra_tables: tuple[TableSummary, ...] = ()
    pad_end_of_episode: bool = False

    @classmethod
    def for_tables(
        cls, table: TableConfig, data_spec: Any, extra_tables: Sequence[TableConfig] = ()
    ) -> StoreMetadata:
        """The metadata of a server holding `table` (primary) and `extra_tables`.

        Args:
          table: The primary table.
          data_spec: Per-step data spec of every table.
          extra_tables: The other tables, in order.

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
        )

    def to_json(self) -> dict[str, Any]:
        """Returns the JSON form, tagged with the layout format."""
        data = dataclasses.asdict(self)
        data["extra_tables"] = [dataclasses.asdict(t) for t in self.extra_tables]
        return {"format": FORMAT, **data}

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str) -> StoreMetadata:
        """Parses `to_json` output; a missing `extra_tables` field means no extra tables.

        Raises:
          CheckpointError: If the format tag or a field is missing or wrong.
        """
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise CheckpointError(f"{source} is not a {FORMAT} file (format: {found!r})")
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
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{source} is malformed: {e!r}") from e

    def differences(self, requested: StoreMetadata) -> list[str]:
        """Names every field where `requested` (the caller's) differs from this (stored) one.

        Capacity counts as a difference: Reverb restores the stored capacity and ignores the
        table it is given, so a restore with another capacity would silently keep the old one.
        The extra tables must be the same set of names with the same capacity and sequence
        length each.
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
        problems += _extra_table_differences(requested.extra_tables, self.extra_tables)
        problems += [
            f"data_spec {p}" for p in diff_descriptions(requested.data_spec, self.data_spec)
        ]
        return problems


def _extra_table_differences(
    requested: Sequence[TableSummary], stored: Sequence[TableSummary]
) -> list[str]:
    wanted = {t.name: t for t in requested}
    found = {t.name: t for t in stored}
    problems = []
    if wanted.keys() != found.keys():
        problems.append(
            f"extra_tables: requested {sorted(wanted)}, stored {sorted(found)} (missing from the "
            f"checkpoint: {sorted(wanted.keys() - found.keys())}; not requested: "
            f"{sorted(found.keys() - wanted.keys())})"
        )
    for name in sorted(wanted.keys() & found.keys()):
        for field in ("sequence_length", "capacity"):
            want, have = getattr(wanted[name], field), getattr(found[name], field)
            if want != have:
                problems.append(
                    f"extra table {name!r} {field}: requested {want!r}, stored {have!r}"
                )
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


class CheckpointStore:
    """Reads, validates and maintains one checkpoint directory (see module docstring).

    Args:
      root: The user's `checkpoint_dir`.
      keep: How many complete checkpoints to retain; older ones are deleted.

    Raises:
      ConfigError: If `keep` < 1.
    """

    def __init__(self, root: str | os.PathLike[str], keep: int = DEFAULT_KEEP) -> None:
        if not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"keep (checkpoints to retain) must be an integer >= 1, got {keep!r}")
        self.root = os.path.abspath(os.fspath(root))
        self.keep = keep
        self._lock_file: IO[str] | None = None

    @property
    def reverb_root(self) -> str:
        """The directory handed to Reverb's checkpointer."""
        return os.path.join(self.root, REVERB_DIR)

    @property
    def restore_dir(self) -> str:
        """Where the view of a checkpoint being restored is written (see `restore.py`)."""
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
        """Whether the directory holds a replay_service store file."""
        return os.path.isfile(self.store_file)

    def read_metadata(self) -> StoreMetadata:
        """Reads the store metadata of an existing directory.

        Raises:
          NoCheckpointError: If the directory does not exist or is empty.
          CheckpointError: If it is not a directory, or holds something other than a store.
        """
        self._check_is_store()
        try:
            with open(self.store_file, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"cannot read {self.store_file!r}: {e}") from e
        return StoreMetadata.from_json(data, self.store_file)

    def checkpoints(self) -> list[Checkpoint]:
        """Returns the complete checkpoints, oldest first."""
        found = []
        for name in _listdir(self.checkpoints_dir):
            sequence = _parse_sequence(name)
            path = os.path.join(self.checkpoints_dir, name)
            meta_path = os.path.join(path, CHECKPOINT_META_FILE)
            if sequence is None or not os.path.isfile(os.path.join(path, REVERB_DONE_FILE)):
                continue
            try:
                with open(meta_path, encoding="utf-8") as f:
                    info = json.load(f)
            except (OSError, json.JSONDecodeError):
                continue
            found.append(Checkpoint(path=path, sequence=sequence, info=info))
        return sorted(found, key=lambda c: c.sequence)

    def latest(self) -> Checkpoint | None:
        """Returns the newest complete checkpoint, or None."""
        checkpoints = self.checkpoints()
        return checkpoints[-1] if checkpoints else None

    def has_checkpoints(self) -> bool:
        """Whether a replay_service store here holds any complete checkpoint."""
        return self.is_store() and bool(self.checkpoints() or self.staged())

    def staged(self) -> list[str]:
        """Complete checkpoints still in Reverb's root (e.g. from `py_client.checkpoint()`)."""
        return [
            os.path.join(self.reverb_root, name)
            for name in sorted(_listdir(self.reverb_root))
            if os.path.isfile(os.path.join(self.reverb_root, name, REVERB_DONE_FILE))
        ]

    # ------------------------------------------------------------------------------- changes

    def check_new(self, overwrite: bool = False) -> None:
        """Checks, without writing anything, that a new buffer may start in this directory.

        Args:
          overwrite: Whether existing checkpoints of a replay_service store may be deleted.

        Raises:
          CheckpointExistsError: If checkpoints exist and `overwrite` is False.
          CheckpointError: If the path is not a directory or holds foreign files.
        """
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise CheckpointError(f"checkpoint_dir {self.root!r} exists and is not a directory")
        entries = [e for e in _listdir(self.root) if e != LOCK_FILE]
        if entries and not self.is_store():
            raise CheckpointError(_foreign_message(self.root, entries))
        existing = len(self.checkpoints()) + len(self.staged()) if self.is_store() else 0
        if existing and not overwrite:
            raise CheckpointExistsError(
                f"checkpoint_dir {self.root!r} already holds {existing} checkpoint(s). "
                "Continue from it (load_replay_buffer(), or replay-server --restore), delete "
                "them (create_replay_buffer(overwrite=True), or replay-server --overwrite), or "
                "choose another checkpoint_dir."
            )

    def prepare_new(self, metadata: StoreMetadata, overwrite: bool = False) -> None:
        """Makes the directory ready for a new, empty buffer and records its metadata.

        Args:
          metadata: What the new buffer holds.
          overwrite: Delete existing checkpoints of a replay_service store instead of refusing.
            Files that are not replay_service's are never deleted.

        Raises:
          CheckpointExistsError: If checkpoints exist and `overwrite` is False.
          CheckpointError: If the directory holds foreign files or cannot be written.
        """
        self.check_new(overwrite)
        try:
            os.makedirs(self.root, exist_ok=True)
            remove_path(self.restore_dir)
            for sub in (self.checkpoints_dir, self.reverb_root):
                if os.path.isdir(sub):
                    shutil.rmtree(sub)
                os.makedirs(sub)
            _write_json_atomic(self.store_file, metadata.to_json())
        except OSError as e:
            raise CheckpointError(f"cannot write checkpoint_dir {self.root!r}: {e}") from e

    def ensure_dirs(self) -> None:
        """Creates `checkpoints/` and `.reverb/` of an existing store if missing."""
        for sub in (self.checkpoints_dir, self.reverb_root):
            os.makedirs(sub, exist_ok=True)

    def clean_staging(self, metadata: StoreMetadata) -> list[Checkpoint]:
        """Adopts complete checkpoints from Reverb's root and removes incomplete ones.

        Leaves Reverb's root empty, so its keep-only-the-largest rule cannot delete the next
        checkpoint because of an older, later-sorting entry (clock skew, a crash mid-write).

        Returns:
          The checkpoints adopted, oldest first.
        """
        adopted = self.adopt_staged(metadata)
        for name in _listdir(self.reverb_root):
            remove_path(os.path.join(self.reverb_root, name))
        return adopted

    def adopt_staged(self, metadata: StoreMetadata) -> list[Checkpoint]:
        """Adopts the complete checkpoints in Reverb's root, leaving partial ones alone.

        Safe while Reverb writes: a checkpoint is complete only once `DONE` exists.
        """
        return [self.adopt(path, metadata) for path in self.staged()]

    def adopt(self, reverb_path: str, metadata: StoreMetadata) -> Checkpoint:
        """Moves a finished Reverb checkpoint into `checkpoints/`, then applies retention.

        Args:
          reverb_path: Directory Reverb wrote (must contain `DONE`).
          metadata: Store metadata recorded with the checkpoint.

        Returns:
          The adopted checkpoint.

        Raises:
          CheckpointError: If `reverb_path` is incomplete or cannot be moved.
        """
        if not os.path.isfile(os.path.join(reverb_path, REVERB_DONE_FILE)):
            raise CheckpointError(
                f"Reverb checkpoint {reverb_path!r} is incomplete (no {REVERB_DONE_FILE} file)"
            )
        existing = self.checkpoints()
        sequence = existing[-1].sequence + 1 if existing else 1
        info = {
            "format": FORMAT,
            "sequence": sequence,
            "created_at": datetime.datetime.now(datetime.UTC).isoformat(),
            "reverb_name": os.path.basename(reverb_path),
            "num_items": count_items(reverb_path),
            "store": metadata.to_json(),
        }
        target = os.path.join(self.checkpoints_dir, f"{CHECKPOINT_PREFIX}{sequence:08d}")
        try:
            _write_json_atomic(os.path.join(reverb_path, CHECKPOINT_META_FILE), info)
            os.makedirs(self.checkpoints_dir, exist_ok=True)
            os.rename(reverb_path, target)
            fsync_dir(self.checkpoints_dir)
        except OSError as e:
            raise CheckpointError(
                f"cannot move checkpoint {reverb_path!r} to {target!r}: {e}"
            ) from e
        self.prune()
        return Checkpoint(path=target, sequence=sequence, info=info)

    def quarantine(self, checkpoint: Checkpoint) -> str:
        """Moves a checkpoint that failed to restore into `corrupt/`; returns its new path.

        Raises:
          CheckpointError: If it cannot be moved.
        """
        target_dir = os.path.join(self.root, CORRUPT_DIR)
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S%f")
        target = os.path.join(target_dir, f"{os.path.basename(checkpoint.path)}-{stamp}")
        try:
            os.makedirs(target_dir, exist_ok=True)
            os.rename(checkpoint.path, target)
        except OSError as e:
            raise CheckpointError(f"cannot move {checkpoint.path!r} aside: {e}") from e
        return target

    def prune(self) -> list[str]:
        """Deletes complete checkpoints beyond the newest `keep`; returns the deleted paths."""
        old = self.checkpoints()[: -self.keep]
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

    def lock(self) -> None:
        """Takes an exclusive, process-wide lock on the directory.

        Raises:
          CheckpointError: If another process (or manager) serves this directory.
        """
        if self._lock_file is not None:
            return
        try:
            os.makedirs(self.root, exist_ok=True)
            handle = open(os.path.join(self.root, LOCK_FILE), "a+", encoding="utf-8")  # noqa: SIM115
        except OSError as e:
            raise CheckpointError(f"cannot use checkpoint_dir {self.root!r}: {e}") from e
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            raise CheckpointError(
                f"checkpoint_dir {self.root!r} is in use by another buffer (lock held by pid "
                f"{holder}); close it first or choose another checkpoint_dir"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        self._lock_file = handle

    def unlock(self) -> None:
        """Releases the lock taken by `lock` (no-op if not held)."""
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None

    # ------------------------------------------------------------------------------ helpers

    def _check_is_store(self) -> None:
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


def count_items(reverb_path: str) -> int | None:
    """Counts the items stored in a Reverb checkpoint (all its tables), or None if unreadable.

    Reverb writes one ZLIB-compressed record per item to `items.tfrecord`; counting them is exact
    even when items were inserted while the checkpoint was taken.
    """
    import tensorflow as tf

    path = os.path.join(reverb_path, REVERB_ITEMS_FILE)
    try:
        records = tf.data.TFRecordDataset(path, compression_type="ZLIB")
        return int(records.reduce(0, lambda count, _: count + 1))
    except (tf.errors.OpError, OSError):
        return None


def _foreign_message(root: str, entries: list[str]) -> str:
    shown = ", ".join(sorted(entries)[:5]) + (", ..." if len(entries) > 5 else "")
    hint = ""
    if any(os.path.isfile(os.path.join(root, e, REVERB_DONE_FILE)) for e in entries):
        hint = " It looks like a bare Reverb checkpoint root, which carries no data spec to check."
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


def _parse_sequence(name: str) -> int | None:
    digits = name.removeprefix(CHECKPOINT_PREFIX)
    if name.startswith(CHECKPOINT_PREFIX) and digits.isdigit():
        return int(digits)
    return None


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _write_json_atomic(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def fsync_dir(path: str) -> None:
    """Makes the entries of directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

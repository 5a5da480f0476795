"""`CheckpointStore`: one checkpoint directory's changes (layout in `storage.directory`).

Reverb keeps only the lexicographically largest entry of its checkpoint root and deletes the
rest, so any foreign file there can make it delete the checkpoint it just wrote. Every
checkpoint is therefore written into the staging root `.reverb/`, which holds nothing else, and
each finished checkpoint is moved (one atomic rename) into `checkpoints/` under an increasing
sequence number, where retention is ours. A directory under `checkpoints/` is verified by
construction: it appears only after its writer wrote `DONE`, every file was read back to its end
(by the backend's checkpoint format; the item count and checksums are recorded) and the metadata
file was synced. Reverb writes `DONE` even after a truncated file (a full disk), so `DONE` alone
proves nothing. Files are written with `file_modes.FILE_MODE` and directories with
`file_modes.DIR_MODE`, whatever the umask.

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
import datetime
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from replay_service.config.options import DEFAULT_KEEP
from replay_service.errors import (
    BackendMismatchError,
    CheckpointError,
    CheckpointExistsError,
    ConfigError,
    NoCheckpointError,
    NotRegularFileError,
    SpecMismatchError,
    UnknownFormatError,
)
from replay_service.storage import snapshots
from replay_service.storage.checkpoint_format import (
    CheckpointFormat,
    Verified,
    backend_of_files,
    verify_checkpoint,
)
from replay_service.storage.directory import (
    CHECKPOINT_META_FILE,
    CHECKPOINT_PREFIX,
    CORRUPT_DIR,
    LOCK_FILE,
    STORE_FILE,
    check_backend_of,
    foreign_message,
)
from replay_service.storage.file_modes import (
    fsync_dir,
    make_dirs,
    restrict_tree,
    write_json_atomic,
)
from replay_service.storage.files import list_dir, remove_path
from replay_service.storage.metadata import FORMAT, Checkpoint, StoreMetadata
from replay_service.storage.serving import ServedDirectory

_T = TypeVar("_T")

_log = logging.getLogger(__name__)

# What a checkpoint's writer returns: the directory it wrote, and `(num_items, files)` if it
# already read the files back (see `CheckpointStore.commit`).
WriteCheckpoint = Callable[[str], tuple[str, Verified | None]]


class CheckpointStore(ServedDirectory):
    """Reads, validates and maintains one checkpoint directory (see module docstring).

    Args:
      root: The user's `checkpoint_dir`.
      keep: How many complete checkpoints to retain; older ones are deleted.
      formats: The checkpoint formats it knows, in the order a directory is matched (see
        `storage.checkpoint_format`); None (the default): the registered ones, every
        backend's. They verify a checkpoint its writer did not read back, name the backend
        that wrote it, and tell how long a staged one may still be in its writer's hands.

    Raises:
      ConfigError: If `keep` < 1.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        keep: int = DEFAULT_KEEP,
        formats: Sequence[CheckpointFormat] | None = None,
    ) -> None:
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ConfigError(f"keep (checkpoints to retain) must be an integer >= 1, got {keep!r}")
        super().__init__(root, formats)
        self.keep = keep

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
        entries = [e for e in list_dir(self.root) if e != LOCK_FILE]
        if entries and not self.is_store():
            raise CheckpointError(foreign_message(self.root, entries, STORE_FILE))
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
        """Adopts complete checkpoints from the staging root (Reverb's root) and clears it.

        Leaves the staging root empty, so its keep-only-the-largest rule cannot delete the next
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
        """Deletes everything in the staging root (partial or failed checkpoint writes)."""
        for name in list_dir(self.reverb_root):
            remove_path(os.path.join(self.reverb_root, name))

    def adopt_staged(self, metadata: StoreMetadata) -> list[Checkpoint]:
        """Adopts the complete checkpoints in the staging root, leaving partial ones alone.

        Safe while Reverb writes: a checkpoint is complete only once `DONE` exists, and it is
        moved only the formats' longest `settle_s` after that (Reverb's `SAVE_SETTLE_S`), once
        the save that wrote it has surely returned.
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
        """Verifies a finished checkpoint, moves it into `checkpoints/`, applies retention.

        Every data file is read to its end by the format that owns the files
        (`checkpoint_format.verify_checkpoint`), which is recorded as its backend; the item
        count and each file's size and SHA-256 are recorded in its metadata file, which is
        synced before the directory is renamed into place.

        Args:
          reverb_path: Directory written into the staging root (must contain `DONE`).
          metadata: Store metadata recorded with the checkpoint.
          verified: `(num_items, files)` of a checkpoint its writer already read back and
            compared with what it meant to write (a local checkpoint); None reads it back here.

        Returns:
          The adopted checkpoint.

        Raises:
          CheckpointError: If `reverb_path` is incomplete or damaged (left where it is), or it
            cannot be moved (e.g. the disk is full); the message names the path.
        """
        num_items, files = verified or verify_checkpoint(self.formats, reverb_path)
        sequence = self.next_sequence()
        info = {
            "format": FORMAT,
            "backend": backend_of_files(self.formats, list(files)),
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
        return Checkpoint(path=target, sequence=sequence, info=info, formats=self.formats)

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
        before the move is written again (up to `snapshots.WRITES` times). The snapshot is
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
        self.check_own_dirs()
        holder = snapshots.new_snapshot_dir(self.snapshots_dir)
        try:
            with guard if guard is not None else contextlib.nullcontext():
                path = snapshots.write_into(
                    holder,
                    self.reverb_root,
                    lambda: self._write_staged(metadata, write, "snapshot")[0],
                )
            return read(path)
        finally:
            shutil.rmtree(holder, ignore_errors=True)

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
        return snapshots.remove_stale(self.snapshots_dir)

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
                check_backend_of(checkpoint, backend)
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

    def ensure_intact(self, metadata: StoreMetadata) -> None:
        """Checks that the locked directory is still in place before writing into it.

        If `checkpoint_dir` was removed (or replaced by an empty directory) while this process
        served it, it is created again with `metadata` and locked anew, with a warning, so the
        next checkpoint is a real one rather than a write into a deleted directory.

        Raises:
          CheckpointError: If the directory now holds another store, or cannot be recreated.
        """
        if not self._lock.held:
            return
        if self._lock.in_place() and self.is_store():
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

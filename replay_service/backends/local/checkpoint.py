"""The checkpoint files of the local backend: one safetensors export per table.

A local checkpoint is a directory written into the store's staging root and adopted into
`checkpoints/` exactly like a Reverb checkpoint (`CheckpointStore.adopt`: verified, digests
recorded, renamed into place, retention applied):

    local_checkpoint.json           format tag, the tables in order and, where the tables
                                    store large fields compressed, the codec ("compression")
    table<i>.state.safetensors      table i's items in the export format (`storage.export`)
    table<i>.metadata.json          its export metadata (data spec, counts, sha256 of the state)
    DONE                            written last: the directory is complete

Because each table is an export, the same files import into a Reverb-backed buffer
(`import_buffer`) and back, item for item. The items are written decoded, whatever the
tables' `compression=`: a checkpoint loads into a buffer of any compression (its frames are
encoded again as they are restored), and one without the "compression" key (every checkpoint
of an uncompressed buffer, and those written before the option) is read as it always was.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from replay_service.config.options import TableConfig
from replay_service.errors import CheckpointError
from replay_service.storage import export as export_lib
from replay_service.storage import export_state, export_target, formats, importing
from replay_service.storage.file_modes import (
    DIR_MODE,
    open_regular,
    regular_file_exists,
    write_synced,
)
from replay_service.storage.files import DONE_FILE, check_recorded_files, file_digest
from replay_service.storage.metadata import Checkpoint

if TYPE_CHECKING:
    from replay_service.backends.local.table import LocalTable

FORMAT = formats.LOCAL_CHECKPOINT.tag
INDEX_FILE = "local_checkpoint.json"


def is_local_checkpoint(path: str) -> bool:
    """Whether `path` holds a local-backend checkpoint (its index file).

    Raises:
      NotRegularFileError: If its index is not a regular file (a named pipe...).
    """
    return regular_file_exists(os.path.join(path, INDEX_FILE))


class LocalCheckpointFormat:
    """The local backend's checkpoint files as the store knows them
    (`storage.checkpoint_format`): owned by the index or safetensors files, verified by
    `verify`; written under the checkpoint lock, so adopted as soon as they are complete."""

    backend = "local"
    settle_s = 0.0

    def owns(self, names: Collection[str]) -> bool:
        """Whether files named `names` include the index or a table's safetensors file."""
        return any(n == INDEX_FILE or n.endswith(".safetensors") for n in names)

    def verify(self, path: str) -> tuple[int, dict[str, dict[str, Any]]]:
        """`verify(path)`."""
        return verify(path)


CHECKPOINT_FORMAT = LocalCheckpointFormat()


def table_prefix(index: int) -> str:
    """File name prefix of the `index`-th table's export inside a checkpoint."""
    return f"table{index}."


def write(
    path: str,
    tables: Sequence[tuple[TableConfig, Any, export_lib.ExportedItems]],
    compression: str | None = None,
) -> tuple[int, dict[str, dict[str, Any]]]:
    """Writes a complete local checkpoint into the new directory `path`.

    Each state file is read back and compared with the bytes meant while it is written (see
    `export_state.write_safetensors`), so its digest is known without hashing it again.

    Args:
      path: Directory to create (must not exist).
      tables: `(config, stored_spec, items)` per table, the primary table first.
      compression: The tables' codec (`codecs.CODECS`), recorded in the index; None: none
        (the index is then as it was before the option).

    Returns:
      `(num_items, files)` as `verify` gives them, for `CheckpointStore.adopt`.

    Raises:
      CheckpointError: If a file cannot be written (a full disk, permissions) or does not read
        back as written; the message names the path. A partial directory is left for the
        caller to discard.
    """
    try:
        os.mkdir(path, DIR_MODE)
        os.chmod(path, DIR_MODE)
    except OSError as e:
        raise CheckpointError(f"cannot create checkpoint directory {path!r}: {e}") from e
    num_items = 0
    files: dict[str, dict[str, Any]] = {}
    for index, (config, stored_spec, items) in enumerate(tables):
        # The directory is new and holds only this checkpoint's tables: no target check.
        state_path, metadata_path = export_lib.write_export(
            path, table_prefix(index), config, stored_spec, items, overwrite=True
        )
        metadata = export_lib.read_metadata(metadata_path)
        files[os.path.basename(state_path)] = {
            "size": os.path.getsize(state_path),
            "sha256": metadata[export_lib.CHECKSUMS][export_target.STATE_SUFFIX],
        }
        files[os.path.basename(metadata_path)] = file_digest(metadata_path)
        num_items += items.num_items
    index_data: dict[str, Any] = {
        "format": FORMAT,
        "tables": [config.name for config, _, _ in tables],
    }
    if compression is not None:
        index_data["compression"] = compression
    try:
        write_synced(os.path.join(path, INDEX_FILE), json.dumps(index_data, indent=2) + "\n")
        write_synced(os.path.join(path, DONE_FILE), "")
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoint {path!r}: {e}") from e
    files[INDEX_FILE] = file_digest(os.path.join(path, INDEX_FILE))
    return num_items, files


def read_index(path: str) -> list[str]:
    """The table names of the local checkpoint at `path`, in order.

    Raises:
      UnknownFormatError: If its format tag is unknown or of a newer version (not damage).
      CheckpointError: If the index is missing, unreadable or malformed.
      NotRegularFileError: If it is not a regular file (it is not opened).
    """
    index_path = os.path.join(path, INDEX_FILE)
    data = _read_index_data(path)
    tables = data.get("tables")
    if not isinstance(tables, list) or not all(isinstance(t, str) for t in tables):
        raise CheckpointError(f"{index_path!r} is not a {FORMAT} index: {data!r}")
    return tables


def _read_index_data(path: str) -> dict[str, Any]:
    """The parsed index of the local checkpoint at `path`, its format tag checked.

    Raises:
      UnknownFormatError: If its format tag is unknown or of a newer version.
      CheckpointError: If the index is missing, unreadable or not a JSON object.
      NotRegularFileError: If it is not a regular file.
    """
    index_path = os.path.join(path, INDEX_FILE)
    try:
        with open_regular(index_path, "r", encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint index {index_path!r} cannot be read: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{index_path!r} is not a {FORMAT} index: {data!r}")
    formats.LOCAL_CHECKPOINT.check(data.get("format"), repr(index_path))
    return data


def read_compression(path: str) -> str | None:
    """The codec the tables of the local checkpoint at `path` used (None: none recorded).

    Raises:
      CheckpointError: If the index cannot be read, or records a codec that is not a string.
    """
    index_path = os.path.join(path, INDEX_FILE)
    read_index(path)
    value = _read_index_data(path).get("compression")
    if value is not None and not isinstance(value, str):
        raise CheckpointError(f"{index_path!r} records compression={value!r}, not a codec name")
    return value


def verify(path: str) -> tuple[int, dict[str, dict[str, Any]]]:
    """Reads every file of a local checkpoint back and checks each table's digest.

    Returns:
      `(num_items, files)`: items of every table, and per file its size and SHA-256.

    Raises:
      CheckpointError: If `DONE`, the index or a table's files are missing or damaged.
    """
    if not regular_file_exists(os.path.join(path, DONE_FILE)):
        raise CheckpointError(f"local checkpoint {path!r} is incomplete (no {DONE_FILE} file)")
    tables = read_index(path)
    num_items = 0
    files: dict[str, dict[str, Any]] = {}
    for index in range(len(tables)):
        state_path, metadata_path = export_target.export_paths(path, table_prefix(index))
        metadata = export_lib.read_metadata(metadata_path)
        # The one read-back of the state file: its digest must be the one computed from the
        # bytes that were meant to be written.
        state = file_digest(state_path)
        recorded = metadata.get(export_lib.CHECKSUMS, {}).get(export_target.STATE_SUFFIX)
        if state["sha256"] != recorded:
            raise CheckpointError(
                f"{state_path!r} does not read back as written: SHA-256 {state['sha256']}, "
                f"written {recorded}"
            )
        files[os.path.basename(state_path)] = state
        files[os.path.basename(metadata_path)] = file_digest(metadata_path)
        num_items += int(metadata["num_items"])
    files[INDEX_FILE] = file_digest(os.path.join(path, INDEX_FILE))
    return num_items, files


def small_files(path: str) -> list[str]:
    """The index and each table's metadata: the files whose recorded digests a restore
    checks first (each state file is checked against its metadata as it is read)."""
    names = [INDEX_FILE]
    for index in range(len(read_index(path))):
        _, metadata_path = export_target.export_paths(path, table_prefix(index))
        names.append(os.path.basename(metadata_path))
    return names


def recorded_names(path: str) -> list[str]:
    """The files of a local checkpoint whose digests are recorded (all but `DONE`)."""
    names = [INDEX_FILE]
    for index in range(len(read_index(path))):
        state_path, metadata_path = export_target.export_paths(path, table_prefix(index))
        names += [os.path.basename(state_path), os.path.basename(metadata_path)]
    return names


def restore_table(path: str, index: int, stored_spec: Any, table: Any) -> None:
    """Fills the empty `table` (a `LocalTable`) with the `index`-th table of a checkpoint.

    The state file is mapped and copied once, straight into the table's storage, while its
    SHA-256 is computed beside the copy; a digest that differs from the one its metadata
    records raises after the copy (the caller then drops the table).

    Raises:
      CheckpointError: If a file is missing or damaged.
      SpecMismatchError: If its data spec or sequence length differ from the table's.
    """
    config = table.config
    state_path, metadata_path = export_target.export_paths(path, table_prefix(index))
    metadata = export_lib.read_metadata(metadata_path)
    importing.check_compatible(metadata, config.sequence_length, stored_spec, metadata_path)
    recorded = metadata.get(export_lib.CHECKSUMS, {}).get(export_target.STATE_SUFFIX)
    if not isinstance(recorded, str):
        raise CheckpointError(f"{metadata_path!r} records no sha256 of {state_path!r}")
    fields = export_lib.item_fields(stored_spec, config.sequence_length)
    with export_state.mapped_state(state_path, recorded) as tensors:
        items = export_lib.read_state_fields(
            state_path, fields, int(metadata["num_items"]), tensors
        )
        table.restore(items.data, items.priorities, items.times_sampled)


def check_restorable(checkpoint: Checkpoint, names: Sequence[str]) -> None:
    """Checks, before anything is restored, that `checkpoint` is a local checkpoint of the
    tables `names` whose small files (`small_files`) match their recorded digests.

    Args:
      checkpoint: The checkpoint, as the store recorded it.
      names: The configured tables' names, in order.

    Raises:
      CheckpointError: If it is a Reverb checkpoint, records no digests, a small file is
        damaged, or it holds other tables.
      UnknownFormatError: If its index's format tag is unknown or newer (not damage).
    """
    path = checkpoint.path
    if not is_local_checkpoint(path):
        raise CheckpointError(
            f"{path!r} is a Reverb checkpoint; the local backend reads only its own. Load "
            "it with backend='reverb' and export() it, then import_buffer() the export here"
        )
    if checkpoint.files is None:
        raise CheckpointError(f"{path!r} records no file digests")
    # The index's digest first: a damaged index is damage, never a format to refuse.
    check_recorded_files(path, checkpoint.files, [INDEX_FILE])
    check_recorded_files(path, checkpoint.files, small_files(path))
    tables = read_index(path)
    if tables != list(names):
        raise CheckpointError(f"{path!r} holds tables {tables}, not the configured ones")


def restore_tables(checkpoint: Checkpoint, stored_spec: Any, tables: Sequence[LocalTable]) -> None:
    """Fills the new, empty `tables` (in the checkpoint's order) from `checkpoint`
    (`restore_table`), after `check_restorable`.

    Raises:
      CheckpointError: If a file is missing or damaged, or the items restored are not as
        many as were recorded when the checkpoint was taken.
      SpecMismatchError: If a table's data spec or sequence length differ.
    """
    path = checkpoint.path
    total = 0
    for index, table in enumerate(tables):
        restore_table(path, index, stored_spec, table)
        total += table.size
    if checkpoint.num_items is not None and total != checkpoint.num_items:
        raise CheckpointError(
            f"restoring {path!r} gave {total} items, but {checkpoint.num_items} were "
            "recorded when it was taken"
        )

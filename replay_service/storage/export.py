"""The export format: a replay table's items as a safetensors state file and JSON metadata

An export is two files in one directory:

    <prefix>state.safetensors   one tensor per data field, "data/<path>" of shape
                                [num_items, sequence_length, *field_shape] and the spec's dtype;
                                "priorities" (float64 [num_items]) and "times_sampled"
                                (int32 [num_items]); items oldest first (insertion order)
    <prefix>metadata.json       format tag, table name, sequence length, capacity, item count,
                                data spec (`specs.describe_spec`), tensor names, item order,
                                the versions of replay_service, dm-reverb, tf-agents, tensorflow
                                and the sha256 of the state file ("sha256": {"state.safetensors":
                                hex digest})

An import recomputes the state file's sha256 and refuses a file whose digest differs from the
recorded one (one flipped byte of data is otherwise a valid safetensors file). Exports written
before digests were recorded still import, with a warning that their data is unverified.

This module holds the format: the items, the metadata, and the state file's tensors, written
and read back checked. The state file's bytes are `storage.export_state`'s, the files' names and
their directory `storage.export_target`'s, and an import's checks against the table it goes
into `storage.importing`'s. How a backend reads every item of a table exactly once, and writes
items back in order, is the backend's own (`Backend.read_items`, `Backend.insert_items`; for
Reverb `backends/reverb/transfer.py`).

Nothing random or time-dependent is written: the same items give byte-identical files. Reverb's
item keys are not exported (an import cannot choose them), and an import starts every item at
`times_sampled == 0`; export -> import -> export is therefore byte-identical whenever the
exported items had never been sampled, and otherwise differs only in "times_sampled".
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import warnings
from typing import Any

import numpy as np
import safetensors
from safetensors.numpy import load_file

from replay_service.config.options import TableConfig
from replay_service.errors import CheckpointError, SpecMismatchError
from replay_service.specs import nests as specs
from replay_service.storage import formats
from replay_service.storage.export_state import (
    Concatenated,
    check_header_tag,
    write_safetensors,
)
from replay_service.storage.export_target import STATE_SUFFIX, check_target, export_paths
from replay_service.storage.file_modes import (
    make_dirs,
    open_private,
    open_regular,
    regular_file_exists,
    sync_file,
)
from replay_service.storage.files import file_sha256

FORMAT = formats.EXPORT.tag
DATA_PREFIX = "data/"
PRIORITIES = "priorities"
TIMES_SAMPLED = "times_sampled"
ITEM_ORDER = "insertion order, oldest first"
VERSIONED_PACKAGES = ("replay_service", "dm-reverb", "tf-agents", "tensorflow")
"""Packages whose versions the metadata records; those not installed are left out (but
`replay_service`, always recorded)."""
CHECKSUMS = "sha256"

# safetensors caps a header at 100 MB; a longer length is damage (`load_file` says so).
_MAX_HEADER_BYTES = 100_000_000


@dataclasses.dataclass(frozen=True)
class ExportedItems:
    """Every item of a table, oldest first.

    Attributes:
      data: One array per field of the table signature (`tf.nest` order), each shaped
        `[num_items, sequence_length, *field_shape]`.
      priorities: float64 `[num_items]`.
      times_sampled: int32 `[num_items]`.
    """

    data: list[np.ndarray]
    priorities: np.ndarray
    times_sampled: np.ndarray

    @property
    def num_items(self) -> int:
        """Number of items."""
        return int(self.priorities.shape[0])

    def newest(self, count: int) -> ExportedItems:
        """Returns the newest `count` items."""
        start = max(0, self.num_items - count)
        return ExportedItems(
            data=[a[start:] for a in self.data],
            priorities=self.priorities[start:],
            times_sampled=self.times_sampled[start:],
        )


def item_fields(stored_spec: Any, sequence_length: int) -> list[specs.FieldDescription]:
    """The fields of one item: `specs.describe_spec(stored_spec)` with a leading dimension of
    `sequence_length` (what `specs.table_signature` describes, without TensorFlow).

    Args:
      stored_spec: The table's per-step stored spec (TF specs or `ArraySpec`).
      sequence_length: Steps per item.

    Returns:
      One `{"path", "dtype", "shape"}` dict per field, in `tf.nest` order.
    """
    return [
        {**field, "shape": [sequence_length, *field["shape"]]}
        for field in specs.describe_spec(stored_spec)
    ]


def write_export(
    dirpath: str | os.PathLike[str],
    prefix: str,
    table: TableConfig,
    stored_spec: Any,
    items: ExportedItems,
    overwrite: bool = False,
) -> tuple[str, str]:
    """Writes items as an export (see module docs): the one writer of the file format.

    Needs no TensorFlow or Reverb: any backend that can list a table's items, oldest first,
    writes its export with it.

    Args:
      dirpath: Directory to write into; created if missing.
      prefix: File name prefix.
      table: The exported table (its name, sequence length and capacity are recorded).
      stored_spec: Its per-step stored spec (TF specs or `ArraySpec`).
      items: Every item, oldest first; `items.data` holds one array per field of
        `item_fields(stored_spec, table.sequence_length)`, in that order.
      overwrite: Replace the two export files in a non-empty directory (other files are kept).

    Returns:
      `(state_path, metadata_path)`.

    Raises:
      ConfigError: If `prefix` could name a file outside `dirpath`.
      CheckpointExistsError: If `dirpath` is not empty and `overwrite` is False.
      SpecMismatchError: If the items' arrays do not match the fields of `stored_spec` (naming
        the field) or disagree on the number of items.
      CheckpointError: If the files cannot be written.
    """
    state_path, metadata_path = export_paths(dirpath, prefix)
    fields = item_fields(stored_spec, table.sequence_length)
    _check_items(items, fields)
    check_target(os.fspath(dirpath), overwrite)
    metadata = build_metadata(
        table.name, table.sequence_length, table.capacity, stored_spec, items.num_items
    )
    tensors = {name: array for name, array in zip(_data_names(fields), items.data, strict=True)}
    tensors[PRIORITIES] = items.priorities
    tensors[TIMES_SAMPLED] = items.times_sampled
    _write_files(state_path, metadata_path, tensors, metadata)
    return state_path, metadata_path


def _check_items(items: ExportedItems, fields: list[specs.FieldDescription]) -> None:
    """Checks the arrays of `items` against the item fields (see `write_export`)."""
    count = items.num_items
    if len(items.data) != len(fields):
        raise SpecMismatchError(
            f"the items hold {len(items.data)} data arrays, but the data spec has "
            f"{len(fields)} fields: {[f['path'] for f in fields]}"
        )
    expected = [(f["path"], np.dtype(f["dtype"]), (count, *f["shape"])) for f in fields]
    expected.append((PRIORITIES, np.dtype(np.float64), (count,)))
    expected.append((TIMES_SAMPLED, np.dtype(np.int32), (count,)))
    arrays = [*items.data, items.priorities, items.times_sampled]
    for (path, dtype, shape), array in zip(expected, arrays, strict=True):
        got = (getattr(array, "dtype", None), tuple(getattr(array, "shape", ())))
        if not isinstance(array, np.ndarray | Concatenated) or got != (dtype, shape):
            raise SpecMismatchError(
                f"exported field {path!r}: expected a numpy array {dtype}{list(shape)}, got "
                f"{type(array).__name__} {got[0]}{list(got[1])}"
            )


def build_metadata(
    table_name: str, sequence_length: int, capacity: int, data_spec: Any, num_items: int
) -> dict[str, Any]:
    """Returns the JSON metadata of an export (no time stamps: equal inputs, equal bytes).

    Args:
      table_name: The exported table.
      sequence_length: Steps per item.
      capacity: The table's capacity.
      data_spec: Its per-step stored spec (TF specs or `ArraySpec`).
      num_items: Number of items exported.

    Returns:
      The metadata, without the state file's digest (`write_export` adds it).
    """
    fields = item_fields(data_spec, sequence_length)
    return {
        "format": FORMAT,
        "table_name": table_name,
        "sequence_length": sequence_length,
        "capacity": capacity,
        "num_items": num_items,
        "data_spec": specs.describe_spec(data_spec),
        "tensors": {
            "data": [
                {"path": field["path"], "name": name}
                for field, name in zip(fields, _data_names(fields), strict=True)
            ],
            "priorities": PRIORITIES,
            "times_sampled": TIMES_SAMPLED,
        },
        "item_order": ITEM_ORDER,
        "versions": _versions(),
    }


def read_metadata(path: str) -> dict[str, Any]:
    """Reads and checks an export's metadata file.

    Raises:
      UnknownFormatError: If its format tag is unknown or of a newer version (not damage).
      CheckpointError: If it is missing, not JSON, or malformed.
      NotRegularFileError: If it is not a regular file (a named pipe...): it is not opened.
    """
    try:
        with open_regular(path, "r", encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError as e:
        raise CheckpointError(f"export metadata {path!r} does not exist") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"export metadata {path!r} is corrupt or truncated: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path!r} is not a {FORMAT} file: {type(data).__name__}")
    formats.EXPORT.check(data.get("format"), repr(path))
    missing = [k for k in ("sequence_length", "num_items", "data_spec") if k not in data]
    if missing:
        raise CheckpointError(f"export metadata {path!r} is malformed: it lacks {missing}")
    count = data["num_items"]
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise CheckpointError(f"export metadata {path!r}: bad num_items {count!r}")
    fields = data["data_spec"]
    if not isinstance(fields, list) or not all(
        isinstance(f, dict) and {"path", "dtype", "shape"} <= f.keys() for f in fields
    ):
        raise CheckpointError(f"export metadata {path!r}: malformed data_spec {fields!r}")
    return data


def verify_state(state_path: str, metadata: dict[str, Any], metadata_path: str) -> None:
    """Checks the state file against the sha256 recorded in the export's metadata.

    Metadata without a digest (exports written before digests were recorded) is accepted with
    a `UserWarning` that the data is unverified.

    Args:
      state_path: The export's `<prefix>state.safetensors`.
      metadata: Its metadata, from `read_metadata`.
      metadata_path: Where the metadata was read (named in errors).

    Raises:
      CheckpointError: If the state file is missing or unreadable, the recorded digest is
        malformed, or the file's digest differs from it (naming the file and both digests).
    """
    recorded = metadata.get(CHECKSUMS)
    if recorded is None:
        warnings.warn(
            f"export {metadata_path!r} records no sha256 of {state_path!r} (it was written "
            "before exports recorded one): its data is imported unverified",
            UserWarning,
            stacklevel=3,
        )
        return
    expected = recorded.get(STATE_SUFFIX) if isinstance(recorded, dict) else None
    if not (
        isinstance(expected, str)
        and len(expected) == 64
        and all(c in "0123456789abcdef" for c in expected)
    ):
        raise CheckpointError(
            f"export metadata {metadata_path!r}: malformed {CHECKSUMS} {recorded!r}; expected "
            f'{{"{STATE_SUFFIX}": "<64 hex digits>"}}'
        )
    try:
        actual = file_sha256(state_path)
    except FileNotFoundError as e:
        raise CheckpointError(f"export state {state_path!r} does not exist") from e
    except OSError as e:
        raise CheckpointError(f"export state {state_path!r} cannot be read: {e}") from e
    if actual != expected:
        raise CheckpointError(
            f"export state {state_path!r} is corrupt or truncated: its sha256 is {actual}, but "
            f"{metadata_path!r} records {expected}; nothing was imported"
        )


def read_state(path: str, signature: Any, num_items: int) -> ExportedItems:
    """Loads and checks an export's tensors against the table signature.

    Args:
      path: The export's `<prefix>state.safetensors`.
      signature: A nest of specs of one item (`specs.table_signature`, or `ArraySpec` with the
        leading `sequence_length` dimension).
      num_items: The number of items the metadata records.
      tensors: The file's tensors when already mapped (`mapped_state`); None reads the file.

    Returns:
      The items, oldest first.

    Raises:
      CheckpointError: If the file is missing, corrupt, truncated, or a tensor is missing or
        has the wrong dtype or shape (naming the file and the tensor).
    """
    return read_state_fields(path, specs.describe_spec(signature), num_items)


def read_state_fields(
    path: str,
    fields: list[specs.FieldDescription],
    num_items: int,
    tensors: dict[str, np.ndarray] | None = None,
) -> ExportedItems:
    """`read_state` from field descriptions of one item (see `item_fields`): no TensorFlow.

    Args:
      path: The export's `<prefix>state.safetensors`.
      fields: `{"path", "dtype", "shape"}` of every field of one item, in `tf.nest` order.
      num_items: The number of items the metadata records.

    Returns:
      The items, oldest first.

    Raises:
      CheckpointError: If the file is missing, corrupt, truncated, or a tensor is missing or
        has the wrong dtype or shape (naming the file and the tensor), or a field's dtype is
        not a numpy dtype.
    """
    if tensors is None:
        try:
            if not regular_file_exists(path):  # a named pipe would block `load_file`
                raise FileNotFoundError(2, "No such file or directory", path)
            with open_regular(path, "rb") as f:
                length = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(length)) if 0 < length <= _MAX_HEADER_BYTES else {}
            tensors = load_file(path)
        except FileNotFoundError as e:
            raise CheckpointError(f"export state {path!r} does not exist") from e
        except (OSError, ValueError, safetensors.SafetensorError) as e:
            raise CheckpointError(f"export state {path!r} is corrupt or truncated: {e}") from e
        check_header_tag(header, path)
    names = _data_names(fields)
    expected: dict[str, tuple[Any, tuple[int, ...]]] = {}
    for name, field in zip(names, fields, strict=True):
        try:
            dtype = np.dtype(field["dtype"])
        except TypeError as e:
            raise CheckpointError(
                f"export state {path!r}: field {field['path']!r} has dtype {field['dtype']!r}, "
                "which numpy does not know"
            ) from e
        expected[name] = (dtype, (num_items, *field["shape"]))
    expected[PRIORITIES] = (np.float64, (num_items,))
    expected[TIMES_SAMPLED] = (np.int32, (num_items,))
    for name, (dtype, shape) in expected.items():
        array = tensors.get(name)
        if array is None:
            raise CheckpointError(f"export state {path!r} has no tensor {name!r}")
        if array.dtype != np.dtype(dtype) or array.shape != shape:
            raise CheckpointError(
                f"export state {path!r}: tensor {name!r} is {array.dtype}{list(array.shape)}, "
                f"expected {np.dtype(dtype)}{list(shape)}"
            )
    priorities = tensors[PRIORITIES]
    if not np.all(np.isfinite(priorities) & (priorities >= 0)):
        bad = priorities[~(np.isfinite(priorities) & (priorities >= 0))][0]
        raise CheckpointError(f"export state {path!r}: priority {bad!r} is not finite and >= 0")
    return ExportedItems(
        data=[tensors[name] for name in names],
        priorities=priorities,
        times_sampled=tensors[TIMES_SAMPLED],
    )


def _write_files(
    state_path: str, metadata_path: str, tensors: dict[str, np.ndarray], metadata: dict[str, Any]
) -> None:
    directory = os.path.dirname(state_path) or "."
    try:
        for path in (state_path, metadata_path):  # replaced below: never another kind of file
            regular_file_exists(path)
        make_dirs(directory)
        state_tmp, metadata_tmp = f"{state_path}.tmp", f"{metadata_path}.tmp"
        with open_private(state_tmp, "wb") as f:
            # The digest is that of the bytes meant (hashed while they are written and synced),
            # and the file must read back as exactly those bytes.
            digest = write_safetensors(
                f, tensors, {"format": FORMAT}, then=lambda: sync_file(f), read_back=state_tmp
            )
        metadata = {**metadata, CHECKSUMS: {STATE_SUFFIX: digest}}
        with open_private(metadata_tmp, "w", encoding="utf-8") as f:
            json.dump(metadata, f, indent=2, sort_keys=True)
            f.write("\n")
            sync_file(f)
        os.replace(state_tmp, state_path)
        os.replace(metadata_tmp, metadata_path)
    except OSError as e:
        raise CheckpointError(f"cannot write the export into {directory!r}: {e}") from e


def _data_names(fields: list[specs.FieldDescription]) -> list[str]:
    return [f"{DATA_PREFIX}{field['path']}" for field in fields]


def _versions() -> dict[str, str]:
    """Versions of `VERSIONED_PACKAGES`, leaving out those not installed."""
    versions = {name: _version(name) for name in VERSIONED_PACKAGES}
    return {
        name: version
        for name, version in versions.items()
        if name == "replay_service" or version != "unknown"
    }


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"

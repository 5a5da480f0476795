"""Exact, portable export of a replay table to safetensors, and import into a new buffer.

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

How a backend reads every item of a table exactly once, and writes items back in order, is
the backend's own (`Backend.read_items`, `Backend.insert_items`; for Reverb
`backends/reverb/transfer.py`): this module holds the format.

Nothing random or time-dependent is written: the same items give byte-identical files. Reverb's
item keys are not exported (an import cannot choose them), and an import starts every item at
`times_sampled == 0`; export -> import -> export is therefore byte-identical whenever the
exported items had never been sampled, and otherwise differs only in "times_sampled".
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import math
import mmap
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import safetensors
from safetensors.numpy import load_file

from replay_service.config.options import SamplingConfig, TableConfig
from replay_service.errors import (
    CheckpointError,
    CheckpointExistsError,
    ConfigError,
    SpecMismatchError,
)
from replay_service.specs import nests as specs
from replay_service.storage import formats
from replay_service.storage.file_modes import (
    make_dirs,
    open_private,
    open_regular,
    regular_file_exists,
    sync_file,
)
from replay_service.storage.files import file_sha256

FORMAT = formats.EXPORT.tag
DEFAULT_PREFIX = "buffer_"
STATE_SUFFIX = "state.safetensors"
METADATA_SUFFIX = "metadata.json"
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
class Concatenated:
    """Arrays written one after the other as one tensor (along axis 0) without being joined in
    memory: how a table hands its storage to `write_export` without copying it.

    Attributes:
      parts: Arrays of one dtype and equal trailing shapes.
    """

    parts: tuple[np.ndarray, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the joined array."""
        first = self.parts[0].shape
        return (sum(p.shape[0] for p in self.parts), *first[1:])

    @property
    def dtype(self) -> np.dtype:
        """The parts' dtype."""
        return self.parts[0].dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the joined array."""
        return sum(p.nbytes for p in self.parts)


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


def export_paths(dirpath: str | os.PathLike[str], prefix: str = DEFAULT_PREFIX) -> tuple[str, str]:
    """Returns `(state_path, metadata_path)` of an export, confined to `dirpath`.

    Raises:
      ConfigError: If `prefix` could name a file outside `dirpath` (a path separator or ".."),
        or `prefix` or `dirpath` holds a NUL character (no file name can).
    """
    if (
        not isinstance(prefix, str)
        or "/" in prefix
        or os.sep in prefix
        or ".." in prefix
        or "\0" in prefix
    ):
        raise ConfigError(
            "prefix must be a plain file-name prefix without '/', '..' or NUL characters, "
            f"got {prefix!r}"
        )
    root = os.fspath(dirpath)
    if "\0" in (root if isinstance(root, str) else root.decode("utf-8", "replace")):
        raise ConfigError(f"export directory {root!r} holds a NUL character; no path can")
    return (
        os.path.join(root, f"{prefix}{STATE_SUFFIX}"),
        os.path.join(root, f"{prefix}{METADATA_SUFFIX}"),
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


def require_one_table(tables: Sequence[TableConfig], what: str) -> None:
    """Refuses a buffer with extra tables: an export holds one table.

    Raises:
      ConfigError: If `tables` holds more than one table.
    """
    names = [t.name for t in tables]
    if len(names) > 1:
        raise ConfigError(
            f"{what} supports a buffer of one table; this manager has tables {names}. Use a "
            "manager without extra_tables (checkpoints keep every table)"
        )


def read_export(
    table: TableConfig,
    stored_spec: Any,
    dirpath: str | os.PathLike[str],
    prefix: str = DEFAULT_PREFIX,
    *,
    drop_oldest: bool = False,
) -> ExportedItems:
    """Reads and checks an export completely, before anything is created from it.

    The table's capacity may differ from the exported one (this is how a buffer is resized).
    Its data spec and sequence length must match the export; the table name may differ.

    Args:
      table: The table the items will go into.
      stored_spec: Its per-step stored spec.
      dirpath: Directory holding the export.
      prefix: File name prefix used by the export.
      drop_oldest: If the export holds more items than `table.capacity`, keep the newest
        `capacity` items instead of refusing.

    Returns:
      The items, oldest first.

    Raises:
      CheckpointError: If a file is missing, corrupt or truncated, or the state file's sha256
        differs from the one recorded in the metadata (naming the file and both digests).
      SpecMismatchError: If the data spec or sequence length differ (naming every field).
      ConfigError: If the items exceed the capacity without `drop_oldest`, or the table's
        samples-per-insert rate limiter would block the inserts.
    """
    state_path, metadata_path = export_paths(dirpath, prefix)
    metadata = read_metadata(metadata_path)
    check_compatible(metadata, table.sequence_length, stored_spec, metadata_path)
    verify_state(state_path, metadata, metadata_path)
    fields = item_fields(stored_spec, table.sequence_length)
    items = read_state_fields(state_path, fields, int(metadata["num_items"]))
    capacity = table.capacity
    if items.num_items > capacity:
        if not drop_oldest:
            raise ConfigError(
                f"{state_path!r} holds {items.num_items} items but the manager's capacity is "
                f"{capacity}; use a capacity >= {items.num_items}, or drop_oldest=True to keep "
                f"the newest {capacity}"
            )
        items = items.newest(capacity)
    _check_rate_limiter(table.sampling, items.num_items)
    return items


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
        _check_header_tag(header, path)
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


@contextlib.contextmanager
def mapped_state(path: str, expected_sha256: str) -> Iterator[dict[str, np.ndarray]]:
    """Maps a state file and yields its tensors as read-only views of the mapping, while its
    SHA-256 is computed in a second thread; on leaving the block the digest must equal
    `expected_sha256` (copy what you need out of the views inside the block, and treat it as
    unverified until the block exits without error).

    Raises:
      CheckpointError: If the file is missing, not a well-formed safetensors file, or its
        digest differs from `expected_sha256` (naming the file and both digests).
    """
    try:
        with open_regular(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
    except FileNotFoundError as e:
        raise CheckpointError(f"export state {path!r} does not exist") from e
    except OSError as e:
        raise CheckpointError(f"export state {path!r} cannot be read: {e}") from e
    if mapping is None:
        raise CheckpointError(f"export state {path!r} is empty")
    hasher = hashlib.sha256()
    thread = threading.Thread(target=hasher.update, args=(memoryview(mapping),), daemon=True)
    thread.start()
    tensors: dict[str, np.ndarray] = {}
    try:
        tensors = _tensor_views(path, mapping)
        yield tensors
    finally:
        thread.join()
        tensors.clear()
        # A view that escaped the block keeps the mapping open until it is freed.
        with contextlib.suppress(BufferError):
            mapping.close()
    actual = hasher.hexdigest()
    if actual != expected_sha256:
        raise CheckpointError(
            f"export state {path!r} is corrupt or truncated: its sha256 is {actual}, but its "
            f"metadata records {expected_sha256}"
        )


def _tensor_views(path: str, mapping: Any) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file's bytes, as views (no copy)."""
    dtypes = {name: dtype for dtype, name in _SAFETENSORS_DTYPES.items()}
    try:
        length = int.from_bytes(mapping[:8], "little")
        header = json.loads(bytes(mapping[8 : 8 + length]))
        base = 8 + length
        views = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, end = (int(x) for x in entry["data_offsets"])
            dtype = dtypes[entry["dtype"]].newbyteorder("<")
            shape = tuple(int(d) for d in entry["shape"])
            count = int(np.prod(shape, dtype=np.int64))
            if end - begin != count * dtype.itemsize or base + end > len(mapping):
                raise ValueError(f"tensor {name!r} does not fit the file")
            views[name] = np.frombuffer(mapping, dtype, count, base + begin).reshape(shape)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"export state {path!r} is corrupt or truncated: {e}") from e
    _check_header_tag(header, path)
    return views


def _check_header_tag(header: Any, path: str) -> None:
    """Checks the format tag in a state file's safetensors header as the metadata file's is:
    a newer or unknown format is refused (`UnknownFormatError`), not read as this one.

    Raises:
      UnknownFormatError: If the tag is unknown or of a newer version.
      CheckpointError: If the header has no tag (damage).
    """
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    formats.EXPORT.check(metadata.get("format") if isinstance(metadata, dict) else None, repr(path))


# Bytes compared per read when a written file is read back.
_READ_BACK_BLOCK = 8 << 20


def _compare_read_back(path: str, chunks: list[Any]) -> None:
    """Reads `path` back and compares it with the `chunks` it was written from.

    Raises:
      CheckpointError: If it differs or is shorter or longer (naming the file and offset).
    """
    offset = 0
    buffer = np.empty(_READ_BACK_BLOCK, np.uint8)
    with open_regular(path, "rb", buffering=0) as f:
        for chunk in chunks:
            view = np.frombuffer(chunk, np.uint8)
            for start in range(0, len(view), _READ_BACK_BLOCK):
                want = view[start : start + _READ_BACK_BLOCK]
                got = buffer[: f.readinto(memoryview(buffer)[: len(want)])]
                if not np.array_equal(got, want):
                    raise CheckpointError(
                        f"{path!r} does not read back as written near byte {offset + start} "
                        f"({len(got)} of {len(want)} bytes read)"
                    )
            offset += len(view)
        if f.read(1):
            raise CheckpointError(f"{path!r} is longer than the {offset} bytes written")


# safetensors' dtype names, in the order its serializer sorts tensors by (largest first).
_SAFETENSORS_DTYPES = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint8): "U8",
    np.dtype(np.int8): "I8",
    np.dtype(np.int16): "I16",
    np.dtype(np.uint16): "U16",
    np.dtype(np.float16): "F16",
    np.dtype(np.int32): "I32",
    np.dtype(np.uint32): "U32",
    np.dtype(np.float32): "F32",
    np.dtype(np.float64): "F64",
    np.dtype(np.int64): "I64",
    np.dtype(np.uint64): "U64",
}
_SAFETENSORS_RANK = {name: rank for rank, name in enumerate(_SAFETENSORS_DTYPES.values())}


def write_safetensors(
    f: Any,
    tensors: dict[str, np.ndarray | Concatenated],
    metadata: dict[str, str],
    *,
    then: Callable[[], None] | None = None,
    read_back: str | None = None,
) -> str:
    """Writes `tensors` to the binary file `f` in the safetensors format, byte for byte what
    `safetensors.numpy.save(tensors, metadata)` gives, without building the file in memory:
    each array goes to the file as it is, and its SHA-256 is computed in a second thread while
    the file is written (both release the GIL).

    Args:
      f: A binary file open for writing.
      tensors: Name -> array (or `Concatenated` parts).
      metadata: safetensors' `__metadata__`.
      then: Called once everything is written, while the digest may still be computing (e.g.
        to flush and fsync `f`).
      read_back: Path of `f`: after `then`, the file is read back and compared byte for byte
        with what was written.

    Returns:
      The SHA-256 hex digest of the bytes written.

    Raises:
      ConfigError: For a dtype safetensors does not have.
      CheckpointError: If `read_back` does not read back as written.
    """
    entries = []
    for name, array in tensors.items():
        dtype = np.dtype(array.dtype).newbyteorder("=")
        if dtype not in _SAFETENSORS_DTYPES:
            raise ConfigError(f"tensor {name!r}: dtype {array.dtype} has no safetensors type")
        if not isinstance(array, Concatenated):
            array = Concatenated((array,))
        entries.append((name, _SAFETENSORS_DTYPES[dtype], array))
    entries.sort(key=lambda e: (-_SAFETENSORS_RANK[e[1]], e[0]))
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, dtype_name, array in entries:
        header[name] = {
            "dtype": dtype_name,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    chunks = [len(text).to_bytes(8, "little"), text]
    chunks += [
        memoryview(
            np.ascontiguousarray(part.astype(part.dtype.newbyteorder("<"), copy=False))
        ).cast("B")
        for _, _, array in entries
        for part in array.parts
        if part.nbytes
    ]
    hasher = hashlib.sha256()
    thread = threading.Thread(target=lambda: [hasher.update(c) for c in chunks], daemon=True)
    thread.start()
    try:
        for chunk in chunks:
            f.write(chunk)
        if then is not None:
            then()
        if read_back is not None:
            _compare_read_back(read_back, chunks)
    finally:
        thread.join()
    return hasher.hexdigest()


def check_target(dirpath: str, overwrite: bool) -> None:
    """Checks that an export may be written into `dirpath`.

    Args:
      dirpath: The export directory (it may not exist yet).
      overwrite: Whether the export files of a non-empty directory may be replaced.

    Raises:
      CheckpointError: If `dirpath` exists and is not a directory.
      CheckpointExistsError: If `dirpath` is not empty and `overwrite` is False.
    """
    if os.path.exists(dirpath) and not os.path.isdir(dirpath):
        raise CheckpointError(f"export directory {dirpath!r} exists and is not a directory")
    entries = sorted(os.listdir(dirpath)) if os.path.isdir(dirpath) else []
    if entries and not overwrite:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise CheckpointExistsError(
            f"export directory {dirpath!r} is not empty (it contains: {shown}); choose an empty "
            "directory, or pass overwrite=True to replace the export files (other files are kept)"
        )


def check_compatible(
    metadata: dict[str, Any], sequence_length: int, stored_spec: Any, path: str
) -> None:
    """Checks an export's metadata against the table it goes into.

    Raises:
      SpecMismatchError: If the sequence length or the data spec differ (naming every field).
    """
    problems = []
    if metadata["sequence_length"] != sequence_length:
        problems.append(
            f"sequence_length: manager {sequence_length}, export {metadata['sequence_length']!r}"
        )
    problems += [
        f"data_spec {p}"
        for p in specs.diff_descriptions(specs.describe_spec(stored_spec), metadata["data_spec"])
    ]
    if problems:
        raise SpecMismatchError(
            f"export {path!r} does not match this manager: " + "; ".join(problems)
        )


def _check_rate_limiter(sampling: SamplingConfig, num_items: int) -> None:
    spi = sampling.samples_per_insert
    if spi is None:
        return
    allowed = sampling.min_size_to_sample + math.floor(sampling.effective_error_buffer() / spi)
    if num_items > allowed:
        raise ConfigError(
            f"importing {num_items} items would block: the table's rate limiter "
            f"(samples_per_insert={spi}) admits about {allowed} inserts before it waits for "
            "samples; import with a manager without samples_per_insert"
        )


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

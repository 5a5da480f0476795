"""An export's state file at the byte level: safetensors written, read back and mapped.

The file is written byte for byte as `safetensors` writes it, without building it in memory,
and mapped back without a copy.

The writer (`write_safetensors`) hashes the bytes while it writes them and reads the file back
to compare; the reader (`mapped_state`) yields the tensors as views of a mapping while it hashes
the file. Both check the export's format tag in the header's `__metadata__`
(`check_header_tag`). What the tensors mean is `storage.export`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from replay_service.errors import CheckpointError, ConfigError
from replay_service.storage import formats
from replay_service.storage.file_modes import open_regular


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
    check_header_tag(header, path)
    return views


def check_header_tag(header: Any, path: str) -> None:
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

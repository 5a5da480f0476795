"""Compressed storage of a local table's large fields: codecs and the `CompressedColumn`.

A `CompressedColumn` is a ring of `n` slots, each holding one array of a fixed shape and dtype
(an 84x84 uint8 frame, say) compressed on its own. Writers `encode` values before they take the
table's lock and `store` the payloads under it; readers `gather` the payloads of a batch under
the lock and `decode` them into one preallocated array outside it (the payloads are immutable
`bytes`, so a later overwrite does not change what was gathered), or `decode_take` them: each
distinct payload decoded once and copied once into every place a read needs it (a transition
batch's states and next states share frames). Decoding releases the GIL (zstd's
`multi_decompress_to_buffer` on its own threads, one lz4 call per payload) and spreads a large
batch over threads, the calling one decoding a part.

Each slot holds one `bytes` object (None: never written): small payloads live in CPython's
small-object pools, which reuse freed blocks of the same size class, so a ring that overwrites
its slots does not fragment (`nbytes` counts each object's header and the slot's pointer;
docs/benchmarks.md "Codecs for frames" has the resident memory per stored frame). A checkpoint
stores the compressed bytes (`to_arrays`, `from_arrays`). Before a ring exists its compressed
slots are counted at `estimated_bytes` (an eighth of the value plus `SLOT_OVERHEAD`); as it
fills, `PayloadBudget` looks at the memory available whenever its payloads have grown past
what was granted, so an insert the memory cannot hold is refused with a `ConfigError` before
anything of it is stored.

`CODECS` names the codecs: "lz4" (`DEFAULT_CODEC`: about 410 B per Breakout frame of 7,056 B,
2,500-3,300 batches of 32x5 frames decoded per second on one core), "zstd" (level 1: about
300 B, decoded about 3x slower) and "none" (the raw bytes, for tests and comparisons);
docs/benchmarks.md "Codecs for frames" has the measurements. `codec(name)` builds one,
refusing an unknown name or a codec whose library is not installed with a `ConfigError`.
"""

from __future__ import annotations

import abc
import concurrent.futures
import importlib
import itertools
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from replay_service.errors import CheckpointError, ConfigError
from replay_service.specs import sizes

# A batch of at least this many payloads is decoded on several threads (below it, handing the
# work to a pool costs more than it saves).
PARALLEL_MIN = 64
# Threads a batch is decoded on at most.
MAX_THREADS = 4
# What a slot costs beyond its payload: the list's pointer and the `bytes` object's header.
SLOT_OVERHEAD = 8 + sys.getsizeof(b"")
# With `compression=`, a field of at least this many bytes per step is stored compressed (a
# stacked observation's frame column always is); smaller ones stay plain arrays.
COMPRESS_MIN_BYTES = 1024

# Memory a ring's compressed columns leave free for the rest of the process (reads' batches
# and decode buffers): an insert that would take it is refused (`PayloadBudget`).
MEMORY_MARGIN = 64 << 20
# The least growth of a ring's payloads granted by one look at the available memory.
MIN_GRANT = 1 << 20

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def decode_threads() -> int:
    """Threads a large batch is decoded on: the CPUs this process may use, at most
    `MAX_THREADS` (1: decode in the calling thread)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cpus))


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    """The process's decoding pool, made on first use (its threads are daemons of the
    interpreter and end with it)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=MAX_THREADS, thread_name_prefix="replay-decode"
            )
        return _pool


class Codec(abc.ABC):
    """How one array becomes a payload and a batch of payloads becomes arrays again, bit for
    bit. Instances are safe to use from several threads at once."""

    name: ClassVar[str]
    """The name `compression=` takes."""

    module: ClassVar[str | None] = None
    """The module it needs (None: none beyond numpy)."""

    package: ClassVar[str | None] = None
    """The pip package that provides `module`."""

    ratio: ClassVar[int] = 8
    """How many times smaller than its value a payload is estimated to be when the memory a
    ring needs is checked before it exists (`estimated_bytes`): 8 for the compressing codecs,
    about twice what Atari frames take (Breakout's 7,056 B frames: about 410 B with lz4, 300 B
    with zstd); a ring whose payloads outgrow the estimate is refused at the insert that does
    not fit (`check_room`)."""

    @abc.abstractmethod
    def encode(self, value: np.ndarray) -> bytes:
        """The payload of `value`, a C-contiguous array."""

    @abc.abstractmethod
    def decode_into(self, payloads: Sequence[bytes], out: memoryview, size: int) -> None:
        """Decodes `payloads` one after the other into `out` (`len(payloads) * size` bytes),
        payload `i` into bytes `[i * size, (i + 1) * size)`.

        Raises:
          ValueError: If a payload is corrupt or does not decode to `size` bytes.
        """

    def decode_batch(self, payloads: Sequence[bytes], out: np.ndarray, threads: int = 1) -> None:
        """Decodes `payloads` into `out`, payload `i` into `out[i]`.

        Args:
          payloads: What `encode` returned, one per row of `out`.
          out: A C-contiguous array of `len(payloads)` rows of the encoded shape and dtype.
          threads: Threads to decode on (batches under `PARALLEL_MIN` use one).

        Raises:
          ValueError: If a payload is corrupt or does not decode to one row of `out`.
        """
        count = len(payloads)
        if count == 0:
            return
        size = out.nbytes // count
        flat = memoryview(out.reshape(-1).view(np.uint8))
        parts = min(threads, count // (PARALLEL_MIN // 2)) if count >= PARALLEL_MIN else 1
        if parts <= 1:
            self.decode_into(payloads, flat, size)
            return
        bounds = np.linspace(0, count, parts + 1).astype(int).tolist()
        _in_parts(
            lambda start, stop: self.decode_into(
                payloads[start:stop], flat[start * size : stop * size], size
            ),
            bounds,
        )

    def decode_take(
        self, payloads: Sequence[bytes], take: np.ndarray, size: int, threads: int = 1
    ) -> bytearray:
        """Decodes each of `payloads` once and lays them out as `take` says: value `j` of the
        result is payload `take[j]` decoded (a batch's stacks share frames: each frame is
        decoded once, copied once into place).

        Args:
          payloads: What `encode` returned.
          take: int64 indexes into `payloads`, any order, repeats allowed.
          size: Bytes of one value.
          threads: Threads to decode on (batches under `PARALLEL_MIN` use one).

        Returns:
          `len(take) * size` bytes, writable (`np.frombuffer` of it is a writable array).

        Raises:
          ValueError: If a payload is corrupt or does not decode to `size` bytes.
        """
        decoded = np.empty(len(payloads) * size, np.uint8)
        if len(payloads):
            self.decode_batch(payloads, decoded.reshape(len(payloads), size), threads)
        out = bytearray(len(take) * size)
        np.take(
            decoded.reshape(-1, size),
            take,
            axis=0,
            out=np.frombuffer(out, np.uint8).reshape(len(take), size),
        )
        return out


class RawCodec(Codec):
    """The array's bytes as they are."""

    name = "none"
    ratio = 1

    def encode(self, value: np.ndarray) -> bytes:
        return value.tobytes()

    def decode_into(self, payloads: Sequence[bytes], out: memoryview, size: int) -> None:
        _check_sizes(payloads, size)
        out[:] = b"".join(payloads)


class ZstdCodec(Codec):
    """Zstandard frames (with their content size) at `level`; a batch is decoded by one
    `multi_decompress_to_buffer` call, which releases the GIL."""

    name = "zstd"
    module = "zstandard"
    package = "zstandard"

    def __init__(self, level: int = 1) -> None:
        """Compresses at `level` (1: about 300 B per Breakout frame)."""
        import zstandard

        self._zstd = zstandard
        self._level = level
        self._local = threading.local()

    def _coders(self) -> tuple[Any, Any]:
        """This thread's compressor and decompressor (neither is thread-safe)."""
        coders = getattr(self._local, "coders", None)
        if coders is None:
            compressor = self._zstd.ZstdCompressor(
                level=self._level, write_content_size=True, write_checksum=False
            )
            coders = self._local.coders = (compressor, self._zstd.ZstdDecompressor())
        return coders

    def encode(self, value: np.ndarray) -> bytes:
        # `compress` returns its worst-case output buffer shrunk in place: kept, each payload
        # would pin a heap chunk of the value's size (4.5 KB of RSS per 300 B Breakout frame);
        # a copy of the exact size lives in the small-object pools (360 B).
        return bytes(memoryview(self._coders()[0].compress(value)))

    def decode_into(self, payloads: Sequence[bytes], out: memoryview, size: int) -> None:
        try:
            decoded = self._coders()[1].multi_decompress_to_buffer(
                list(payloads), decompressed_sizes=_sizes(len(payloads), size), threads=1
            )
        except self._zstd.ZstdError as error:
            raise ValueError(f"a zstd payload does not decode to {size} bytes: {error}") from error
        for index in range(len(payloads)):
            out[index * size : (index + 1) * size] = decoded[index]

    def decode_take(
        self, payloads: Sequence[bytes], take: np.ndarray, size: int, threads: int = 1
    ) -> bytearray:
        """`Codec.decode_take`: one `multi_decompress_to_buffer` call per part (on `threads`
        threads of the decoding pool, the calling one decoding the first; each call releases
        the GIL), the decoded segments joined in `take`'s order."""
        count = len(payloads)
        segments: list[Any] = [b""] * count

        def part(start: int, stop: int) -> None:
            try:
                decoded = self._coders()[1].multi_decompress_to_buffer(
                    list(payloads[start:stop]),
                    decompressed_sizes=_sizes(stop - start, size),
                    threads=1,
                )
            except self._zstd.ZstdError as error:
                raise ValueError(
                    f"a zstd payload does not decode to {size} bytes: {error}"
                ) from error
            if decoded.size() != (stop - start) * size:
                raise ValueError(f"zstd payloads do not decode to {size} bytes each")
            segments[start:stop] = [decoded[index] for index in range(stop - start)]

        parts = min(threads, count // (PARALLEL_MIN // 2)) if count >= PARALLEL_MIN else 1
        _in_parts(part, np.linspace(0, count, max(parts, 1) + 1).astype(int).tolist())
        return bytearray().join([segments[index] for index in take.tolist()])


class Lz4Codec(Codec):
    """LZ4 blocks without their size (every payload decodes to one array); each
    `lz4.block.decompress` call releases the GIL."""

    name = "lz4"
    module = "lz4.block"
    package = "lz4"

    def __init__(self) -> None:
        """The default (fast) LZ4 mode."""
        import lz4.block

        self._block = lz4.block

    def encode(self, value: np.ndarray) -> bytes:
        return self._block.compress(value, store_size=False)

    def decode_into(self, payloads: Sequence[bytes], out: memoryview, size: int) -> None:
        decompress = self._block.decompress
        for index, payload in enumerate(payloads):
            try:
                out[index * size : (index + 1) * size] = decompress(payload, uncompressed_size=size)
            except (self._block.LZ4BlockError, ValueError) as error:
                raise ValueError(
                    f"an lz4 payload does not decode to {size} bytes: {error}"
                ) from error

    def decode_take(
        self, payloads: Sequence[bytes], take: np.ndarray, size: int, threads: int = 1
    ) -> bytearray:
        """`Codec.decode_take`: each payload decompressed once (in parts on `threads` threads,
        the calling one decoding the first), the results joined in `take`'s order."""
        count = len(payloads)
        decoded: list[bytes] = [b""] * count
        decompress = self._block.decompress
        error_type = self._block.LZ4BlockError

        def part(start: int, stop: int) -> None:
            try:
                decoded[start:stop] = [
                    decompress(payload, uncompressed_size=size) for payload in payloads[start:stop]
                ]
            except (error_type, ValueError) as error:
                raise ValueError(
                    f"an lz4 payload does not decode to {size} bytes: {error}"
                ) from error

        parts = min(threads, count // (PARALLEL_MIN // 2)) if count >= PARALLEL_MIN else 1
        _in_parts(part, np.linspace(0, count, max(parts, 1) + 1).astype(int).tolist())
        out = bytearray().join([decoded[index] for index in take.tolist()])
        if len(out) != len(take) * size:  # a payload decoded short
            raise ValueError(f"an lz4 payload does not decode to {size} bytes")
        return out


CODECS: dict[str, type[Codec]] = {c.name: c for c in (Lz4Codec, ZstdCodec, RawCodec)}
"""The codecs by the name `compression=` takes."""

DEFAULT_CODEC = "lz4"
"""The codec recommended for frames: small payloads (17x smaller Breakout frames) decoded about
3x faster than zstd's (docs/benchmarks.md, "Codecs for frames")."""


def estimated_bytes(value_bytes: int, compression: str) -> int:
    """Bytes a slot of a `CompressedColumn` of `value_bytes`-byte values is counted at before
    anything is stored: the value's bytes divided by the codec's `Codec.ratio`, rounded up, plus
    `SLOT_OVERHEAD` (an 84x84 uint8 frame: 923 B with "lz4" or "zstd").

    Args:
      value_bytes: Bytes of one value.
      compression: A name of `CODECS` (an unknown one counts as "none").

    Returns:
      The estimated bytes per slot.
    """
    implementation = CODECS.get(compression, RawCodec)
    return -(-value_bytes // implementation.ratio) + SLOT_OVERHEAD


def codec(name: str) -> Codec:
    """The codec called `name`.

    Args:
      name: One of `CODECS`.

    Returns:
      A new instance.

    Raises:
      ConfigError: If `name` is not one of `CODECS`, or its library is not installed (naming
        the pip package).
    """
    implementation = CODECS.get(name) if isinstance(name, str) else None
    if implementation is None:
        raise ConfigError(f"compression must be one of {sorted(CODECS)} or None, got {name!r}")
    if implementation.module is not None:
        try:
            importlib.import_module(implementation.module)
        except ImportError as error:
            raise ConfigError(
                f"compression={name!r} needs the {implementation.package!r} package, which "
                f"is not installed (pip install {implementation.package}): {error}"
            ) from error
    return implementation()


class PayloadBudget:
    """How far a ring's compressed payloads may grow before the memory available is looked at
    again: the payloads of an insert are allocated one `bytes` object at a time, so without a
    look a ring whose payloads outgrow the memory would be killed by the kernel (or fail with a
    bare `MemoryError`) part-way through a write.

    `check` is called under the table's lock before an insert changes anything: while the
    payloads held plus the insert's stay under the bytes granted it returns at once; past them
    it reads `sizes.available_memory()` and grants the insert's bytes plus an eighth of what is
    held (at least `MIN_GRANT`, at most what leaves `MEMORY_MARGIN` free), or refuses the
    insert. A ring that overwrites its slots stops growing, and looks no more.
    """

    __slots__ = ("limit",)

    def __init__(self) -> None:
        self.limit = 0

    def check(self, held: int, incoming: int, what: str) -> None:
        """Refuses an insert of `incoming` payload bytes that the memory cannot hold.

        Args:
          held: Bytes the ring's compressed columns hold (`CompressedColumn.nbytes`, summed).
          incoming: Bytes the insert adds (its payloads and `SLOT_OVERHEAD` each), at most.
          what: The table, for the error.

        Raises:
          ConfigError: Naming the bytes held, needed and available, if `incoming` plus
            `MEMORY_MARGIN` exceeds the available memory (the insert must then change nothing).
        """
        if held + incoming <= self.limit:
            return
        available = sizes.available_memory()
        grant = max(MIN_GRANT, held // 8)
        if available is not None:
            needed = incoming + MEMORY_MARGIN
            if needed > available:
                raise ConfigError(
                    f"{what} cannot store {incoming} more bytes of compressed payloads: it "
                    f"holds {held} bytes ({sizes.human(held)}) of them, and the insert needs "
                    f"{needed} bytes ({sizes.human(needed)}, with {MEMORY_MARGIN} bytes kept "
                    f"free for reads) but {available} bytes ({sizes.human(available)}) of "
                    "memory are available. The insert was refused and nothing was written (the "
                    "items held stay readable): lower the table's capacity, free memory, or use "
                    "a codec that compresses these values better"
                )
            grant = min(grant, available - needed)
        self.limit = held + incoming + grant


class CompressedColumn:
    """A ring of slots, each holding one compressed array of `shape` and `dtype`.

    Not thread-safe: its owner serializes `store`, `gather`, `clear` and the state calls (a
    table's lock); `encode` and `decode` touch no slot and run outside it.
    """

    def __init__(
        self, slots: int, shape: Sequence[int], dtype: Any, compression: str | Codec
    ) -> None:
        """An empty column.

        Args:
          slots: Number of slots (>= 0).
          shape: Shape of one value.
          dtype: Numpy dtype of the values.
          compression: A name of `CODECS` or a codec.

        Raises:
          ConfigError: If `compression` is unknown or its library missing, or `slots` < 0.
        """
        if isinstance(slots, bool) or not isinstance(slots, int | np.integer) or slots < 0:
            raise ConfigError(f"a compressed column needs slots >= 0, got {slots!r}")
        self.codec = compression if isinstance(compression, Codec) else codec(compression)
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.value_bytes = int(np.prod(self.shape)) * self.dtype.itemsize
        self._payloads: list[bytes | None] = [None] * int(slots)
        self._payload_bytes = 0
        self._filled = 0

    def __len__(self) -> int:
        """Number of slots."""
        return len(self._payloads)

    @property
    def nbytes(self) -> int:
        """Bytes held: the payloads, and per slot its pointer plus, where filled, the
        `bytes` object's header (`SLOT_OVERHEAD` in all)."""
        empty = len(self._payloads) - self._filled
        return self._payload_bytes + self._filled * SLOT_OVERHEAD + empty * 8

    @property
    def payload_bytes(self) -> int:
        """Bytes of the payloads alone."""
        return self._payload_bytes

    def encode(self, values: np.ndarray) -> list[bytes]:
        """The payloads of `values` (no slot is touched: call it outside the owner's lock).

        Args:
          values: `[count, *shape]` values of the column's dtype.

        Returns:
          One payload per value.

        Raises:
          ValueError: If `values` does not have the column's shape and dtype.
        """
        values = np.asarray(values)
        if values.dtype != self.dtype or values.shape[1:] != self.shape:
            raise ValueError(
                f"values of shape {values.shape} and dtype {values.dtype} do not fit a column of "
                f"{self.shape} {self.dtype} values"
            )
        encode = self.codec.encode
        return [encode(np.ascontiguousarray(value)) for value in values]

    def store(self, slots: np.ndarray, payloads: Sequence[bytes]) -> None:
        """Puts `payloads[i]` into slot `slots[i]` (a repeated slot keeps the last).

        Raises:
          ValueError: If the counts differ or a slot is out of range; nothing is stored then.
        """
        slots = self._check_slots(slots)
        if len(slots) != len(payloads):
            raise ValueError(f"{len(slots)} slots for {len(payloads)} payloads")
        held = self._payloads
        for slot, payload in zip(slots.tolist(), payloads, strict=True):
            old = held[slot]
            if old is None:
                self._filled += 1
            else:
                self._payload_bytes -= len(old)
            self._payload_bytes += len(payload)
            held[slot] = payload

    def put(self, slot: int, payload: bytes) -> None:
        """Puts `payload` into slot `slot`, an index in range (a writer's one step)."""
        old = self._payloads[slot]
        if old is None:
            self._filled += 1
        else:
            self._payload_bytes -= len(old)
        self._payload_bytes += len(payload)
        self._payloads[slot] = payload

    def write(self, slots: np.ndarray, values: np.ndarray) -> None:
        """`store(slots, encode(values))`.

        Raises:
          ValueError: See `encode` and `store`.
        """
        self.store(slots, self.encode(values))

    def gather(self, slots: np.ndarray) -> list[bytes]:
        """The payloads of `slots` (under the owner's lock; `decode` them outside it).

        Raises:
          ValueError: If a slot is out of range or was never written.
        """
        held = self._payloads
        payloads = [held[slot] for slot in self._check_slots(slots).tolist()]
        if None in payloads:
            empty = [int(s) for s, p in zip(slots, payloads, strict=True) if p is None]
            raise ValueError(f"slots {empty[:8]} of the compressed column were never written")
        return payloads  # type: ignore[return-value]

    def decode(
        self, payloads: Sequence[bytes], out: np.ndarray | None = None, threads: int | None = None
    ) -> np.ndarray:
        """Decodes `payloads` into `out`, or a new array.

        Args:
          payloads: What `gather` returned.
          out: A C-contiguous `[len(payloads), *shape]` array of the column's dtype; None:
            a new one.
          threads: Threads to decode a large batch on; None: `decode_threads()`.

        Returns:
          `out`, filled.

        Raises:
          ValueError: If `out` does not fit, or a payload is corrupt.
        """
        expected = (len(payloads), *self.shape)
        if out is None:
            out = np.empty(expected, self.dtype)
        elif out.shape != expected or out.dtype != self.dtype or not out.flags.c_contiguous:
            raise ValueError(
                f"out must be a C-contiguous {self.dtype} array of shape {expected}, got "
                f"{out.dtype} {out.shape}"
            )
        if self.value_bytes:
            threads = decode_threads() if threads is None else threads
            self.codec.decode_batch(payloads, out, threads)
        return out

    def decode_take(
        self, payloads: Sequence[bytes], take: np.ndarray, threads: int | None = None
    ) -> np.ndarray:
        """Decodes each of `payloads` once into the values `take` picks: what
        `decode(payloads)[take]` returns, without decoding a payload twice or a second copy.

        Args:
          payloads: What `gather` returned (the distinct slots of a read).
          take: int indexes into `payloads` (any shape, repeats allowed).
          threads: Threads to decode a large batch on; None: `decode_threads()`.

        Returns:
          A new writable array `[*take.shape, *shape]` of the column's dtype.

        Raises:
          ValueError: If a payload is corrupt, or `take` names no payload.
        """
        take = np.asarray(take, dtype=np.int64)
        if take.size and (take.min() < 0 or take.max() >= len(payloads)):
            raise ValueError(f"take names payloads out of range of {len(payloads)}")
        if not self.value_bytes:
            return np.empty((*take.shape, *self.shape), self.dtype)
        threads = decode_threads() if threads is None else threads
        data = self.codec.decode_take(payloads, take.reshape(-1), self.value_bytes, threads)
        return np.frombuffer(data, self.dtype).reshape(*take.shape, *self.shape)

    def read(
        self, slots: np.ndarray, out: np.ndarray | None = None, threads: int | None = None
    ) -> np.ndarray:
        """`decode(gather(slots), out, threads)`: the values of `slots`, `[len(slots), *shape]`.

        Raises:
          ValueError: See `gather` and `decode`.
        """
        return self.decode(self.gather(slots), out, threads)

    def clear(self) -> None:
        """Empties every slot."""
        self._payloads = [None] * len(self._payloads)
        self._payload_bytes = 0
        self._filled = 0

    def remap(self, order: np.ndarray, slots: int) -> None:
        """Makes this a column of `slots` slots whose slot `i` holds what slot `order[i]` held
        (the slots after `len(order)` empty): a growing ring's reordering, no payload copied.

        Raises:
          ValueError: If `order` is longer than `slots` or names a slot out of range.
        """
        order = self._check_slots(order)
        if len(order) > slots:
            raise ValueError(f"{len(order)} slots kept in a column of {slots}")
        held = self._payloads
        moved = [held[slot] for slot in order.tolist()]
        self._payloads = moved + [None] * (slots - len(moved))
        kept = [p for p in moved if p is not None]
        self._filled = len(kept)
        self._payload_bytes = sum(len(p) for p in kept)

    def to_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The column's state as flat arrays, what a checkpoint stores.

        Returns:
          `(payload, offsets)`: the payloads one after the other (uint8), and int64
          `offsets[slots + 1]`: slot `i` holds `payload[offsets[i]:offsets[i + 1]]`, `offsets[i]
          == offsets[i + 1]` where it is empty (an encoded value is never empty unless the
          column's values have no bytes).
        """
        lengths = np.fromiter(
            (0 if p is None else len(p) for p in self._payloads), np.int64, len(self._payloads)
        )
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        payload = np.frombuffer(b"".join(p for p in self._payloads if p is not None), np.uint8)
        return payload, offsets

    def from_arrays(self, payload: np.ndarray, offsets: np.ndarray) -> None:
        """Replaces the column's state by what `to_arrays` returned.

        Raises:
          CheckpointError: If the arrays do not describe this column's slots (nothing is
            changed then).
        """
        payload = np.asarray(payload)
        offsets = np.asarray(offsets)
        slots = len(self._payloads)
        if (
            payload.dtype != np.uint8
            or payload.ndim != 1
            or offsets.dtype.kind not in "iu"
            or offsets.shape != (slots + 1,)
        ):
            raise CheckpointError(
                f"a compressed column of {slots} slots needs uint8 payload bytes and "
                f"{slots + 1} integer offsets, got {payload.dtype} {payload.shape} and "
                f"{offsets.dtype} {offsets.shape}"
            )
        lengths = np.diff(offsets)
        if offsets[0] != 0 or offsets[-1] != len(payload) or (lengths < 0).any():
            raise CheckpointError(
                f"the offsets of a compressed column do not divide its {len(payload)} payload "
                f"bytes (first {offsets[0]}, last {offsets[-1]}, decreasing: "
                f"{bool((lengths < 0).any())})"
            )
        data = payload.tobytes()
        empty_is_value = self.value_bytes == 0
        bounds = offsets.tolist()
        self._payloads = [
            data[start:stop] if stop > start or empty_is_value else None
            for start, stop in itertools.pairwise(bounds)
        ]
        self._filled = sum(p is not None for p in self._payloads)
        self._payload_bytes = len(data)

    def _check_slots(self, slots: np.ndarray) -> np.ndarray:
        """`slots` as int64, every one in range.

        Raises:
          ValueError: Naming a slot out of range.
        """
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        if len(slots) and (slots.min() < 0 or slots.max() >= len(self._payloads)):
            bad = slots[(slots < 0) | (slots >= len(self._payloads))]
            raise ValueError(
                f"slots {bad[:8].tolist()} are out of range of a column of "
                f"{len(self._payloads)} slots"
            )
        return slots


def _in_parts(work: Any, bounds: Sequence[int]) -> None:
    """Runs `work(start, stop)` for each pair of consecutive `bounds`, on this thread and the
    decoding pool at once: each thread claims the next part not yet claimed, so this thread
    never waits for a pool thread that has not started (it does the work itself, and a pool
    task that finds nothing left is cancelled or ends at once).

    Raises:
      Whatever a part raised (this thread's first), once every started part has ended.
    """
    pairs = list(itertools.pairwise(bounds))
    if len(pairs) <= 1:
        for start, stop in pairs:
            work(start, stop)
        return
    claim = itertools.count()  # next() is atomic under the GIL

    def run() -> None:
        index = next(claim)
        while index < len(pairs):
            work(*pairs[index])
            index = next(claim)

    futures = [_executor().submit(run) for _ in pairs[1:]]
    try:
        run()
    finally:
        for future in futures:
            if not future.cancel():
                future.exception()  # every started part ends before the buffers are used
    for future in futures:
        if not future.cancelled():
            future.result()


def _sizes(count: int, size: int) -> bytes:
    """`decompressed_sizes` of zstd's `multi_decompress_to_buffer`: `count` uint64 `size`s."""
    return np.full(count, size, np.uint64).tobytes()


def _check_sizes(payloads: Sequence[bytes], size: int) -> None:
    """Refuses raw payloads that are not `size` bytes each.

    Raises:
      ValueError: Naming the first wrong length.
    """
    for payload in payloads:
        if len(payload) != size:
            raise ValueError(f"a raw payload of {len(payload)} bytes is not a {size}-byte value")

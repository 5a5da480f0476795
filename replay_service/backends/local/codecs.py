"""The codecs of a local table's compressed fields (`compressed_column.CompressedColumn` stores
them): each encodes one array on its own and decodes a batch of payloads into one array, or
each distinct payload once into every place a read needs it (`decode_take`). Decoding releases
the GIL (zstd's `multi_decompress_to_buffer`, one lz4 call per payload) and spreads a large
batch over threads, the calling one decoding a part. Before a ring exists its compressed slots
are counted at `estimated_bytes` (an eighth of the value plus `SLOT_OVERHEAD`).

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

from replay_service.errors import ConfigError

# A batch of at least this many payloads is decoded on several threads (below it, handing the
# work to a pool costs more than it saves).
PARALLEL_MIN = 64
# The same for lz4's `decode_take`: one lz4 call per frame releases and takes back the GIL
# (about 2 us of decoding each), so threads contend for it between frames; a batch of 32
# transitions' 160 frames decodes faster on the calling thread alone.
LZ4_PARALLEL_MIN = 1024
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
        self,
        payloads: Sequence[bytes],
        take: np.ndarray,
        size: int,
        threads: int = 1,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Decodes each of `payloads` once and lays them out as `take` says: value `j` of the
        result is payload `take[j]` decoded (a batch's stacks share frames: each frame is
        decoded once, copied once into place).

        Args:
          payloads: What `encode` returned.
          take: int64 indexes into `payloads`, any order, repeats allowed.
          size: Bytes of one value.
          threads: Threads to decode on (batches under `PARALLEL_MIN` use one).
          out: A C-contiguous array of `len(take) * size` bytes to fill; None: a new one.

        Returns:
          `out` (or a new uint8 array) holding the `len(take)` values, writable.

        Raises:
          ValueError: If a payload is corrupt or does not decode to `size` bytes.
        """
        decoded = np.empty(len(payloads) * size, np.uint8)
        if len(payloads):
            self.decode_batch(payloads, decoded.reshape(len(payloads), size), threads)
        result = _take_out(out, len(take), size)
        np.take(decoded.reshape(-1, size), take, axis=0, out=result.reshape(len(take), size))
        return result if out is None else out


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
        self,
        payloads: Sequence[bytes],
        take: np.ndarray,
        size: int,
        threads: int = 1,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """`Codec.decode_take`: one `multi_decompress_to_buffer` call per part (on `threads`
        threads of the decoding pool, the calling one decoding the first; each call releases
        the GIL), the decoded segments copied into `out` in `take`'s order."""
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

        _in_parts(part, _part_bounds(count, threads))
        result = _take_out(out, len(take), size)
        _copy_taken(segments, take, size, result)
        return result if out is None else out


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
        self,
        payloads: Sequence[bytes],
        take: np.ndarray,
        size: int,
        threads: int = 1,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """`Codec.decode_take`: each payload decompressed once into a scratch array of the
        calling thread (in parts on `threads` threads when there are at least
        `LZ4_PARALLEL_MIN`, the calling one decoding the first), then gathered into `out` in
        `take`'s order by one numpy call."""
        count = len(payloads)
        decoded = _scratch(count * size)
        view = memoryview(decoded)
        decompress = self._block.decompress
        error_type = self._block.LZ4BlockError

        def part(start: int, stop: int) -> None:
            at = start * size
            try:
                for payload in payloads[start:stop]:
                    # A payload decoding short does not fit the slice: a ValueError.
                    view[at : at + size] = decompress(payload, uncompressed_size=size)
                    at += size
            except (error_type, ValueError) as error:
                raise ValueError(
                    f"an lz4 payload does not decode to {size} bytes: {error}"
                ) from error

        if count < LZ4_PARALLEL_MIN or threads <= 1:
            part(0, count)
        else:
            _in_parts(part, _part_bounds(count, threads))
        result = _take_out(out, len(take), size)
        np.take(
            decoded[: count * size].reshape(count, size),
            take,
            axis=0,
            out=result.reshape(len(take), size),
            mode="wrap",  # `take` is in range: "wrap" writes `out` directly
        )
        return result if out is None else out


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


def payload_bound(value_bytes: int) -> int:
    """The most bytes a payload of a `value_bytes`-byte value takes with any of `CODECS`
    (an incompressible value: lz4's `LZ4_COMPRESSBOUND`, zstd's `ZSTD_COMPRESSBOUND` with its
    frame header), what an insert counts for a payload it encodes only under the table's lock.

    Args:
      value_bytes: Bytes of the value.

    Returns:
      An upper bound of its payload's bytes.
    """
    return value_bytes + (value_bytes >> 7) + 64


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


def _part_bounds(count: int, threads: int) -> list[int]:
    """Bounds of the parts `count` payloads are decoded in on `threads` threads: one part
    under `PARALLEL_MIN` payloads, else at most `threads`, of `PARALLEL_MIN // 2` or more."""
    parts = min(threads, count // (PARALLEL_MIN // 2)) if count >= PARALLEL_MIN else 1
    return np.linspace(0, count, max(parts, 1) + 1).astype(int).tolist()


def _take_out(out: np.ndarray | None, count: int, size: int) -> np.ndarray:
    """`decode_take`'s output as flat bytes: `out` viewed as uint8, or a new array.

    Raises:
      ValueError: If `out` is not a C-contiguous array of `count * size` bytes.
    """
    if out is None:
        return np.empty(count * size, np.uint8)
    if not out.flags.c_contiguous or out.nbytes != count * size:
        raise ValueError(
            f"out must be a C-contiguous array of {count * size} bytes, got {out.dtype} {out.shape}"
        )
    return out.reshape(-1).view(np.uint8)


# The calling thread's scratch array of lz4's `decode_take` (kept up to `SCRATCH_BYTES`).
_scratch_local = threading.local()
SCRATCH_BYTES = 16 << 20


def _scratch(nbytes: int) -> np.ndarray:
    """A uint8 array of at least `nbytes` bytes for this thread's decoding, reused by its
    next call (up to `SCRATCH_BYTES`; a larger one is made for the call alone)."""
    if nbytes > SCRATCH_BYTES:
        return np.empty(nbytes, np.uint8)
    scratch = getattr(_scratch_local, "array", None)
    if scratch is None or len(scratch) < nbytes:
        scratch = _scratch_local.array = np.empty(max(nbytes, 1 << 20), np.uint8)
    return scratch


def _copy_taken(values: Sequence[Any], take: np.ndarray, size: int, out: np.ndarray) -> None:
    """Copies `values[take[j]]` (`size` bytes each) into bytes `[j * size, (j + 1) * size)`
    of `out` (flat uint8)."""
    view = memoryview(out)
    start = 0
    for index in take.tolist():
        view[start : start + size] = values[index]
        start += size


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

"""The `CompressedColumn` of a local table's large fields, and the `PayloadBudget` that
keeps its payloads within the memory available.

A `CompressedColumn` is a ring of `n` slots, each holding one array of a fixed shape and dtype
(an 84x84 uint8 frame, say) compressed on its own by a `codecs.Codec`. Writers `encode` values
before they take the table's lock and `store` the payloads under it; readers `gather` the
payloads of a batch under the lock and `decode` them into one preallocated array outside it
(the payloads are immutable `bytes`, so a later overwrite does not change what was gathered),
or `decode_take` them: each distinct payload decoded once and copied once into every place a
read needs it (a transition batch's states and next states share frames).

Each slot holds one `bytes` object (None: never written): small payloads live in CPython's
small-object pools, which reuse freed blocks of the same size class, so a ring that overwrites
its slots does not fragment (`nbytes` counts each object's header and the slot's pointer). A
checkpoint stores the compressed bytes (`to_arrays`, `from_arrays`). As a ring fills,
`PayloadBudget` looks at the memory available whenever its payloads have grown past what was
granted, so an insert the memory cannot hold is refused with a `ConfigError` before anything of
it is stored; one budget serves every table of a backend.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from replay_service.backends.local.codecs import (
    MEMORY_MARGIN,
    MIN_GRANT,
    SLOT_OVERHEAD,
    Codec,
    codec,
    decode_threads,
)
from replay_service.errors import CheckpointError, ConfigError
from replay_service.specs import sizes


class PayloadBudget:
    """How far the compressed payloads of a backend's tables may grow before the memory
    available is looked at again: the payloads of an insert are allocated one `bytes` object at
    a time, so without a look a ring whose payloads outgrow the memory would be killed by the
    kernel (or fail with a bare `MemoryError`) part-way through a write.

    One budget is shared by every table of a backend (each table passes itself as `owner`), so
    that two tables are never granted the same free memory: the bytes granted cover what all
    of them hold. `check` is called under the table's lock before an insert changes anything:
    while the payloads the tables hold plus the insert's stay under the bytes granted it
    returns at once; past them it reads `sizes.available_memory()` and grants the insert's
    bytes plus an eighth of what is held (at least `MIN_GRANT`, at most what leaves
    `MEMORY_MARGIN` free), or refuses the insert. Rings that overwrite their slots stop
    growing, and look no more. Thread-safe (tables insert under locks of their own).
    """

    __slots__ = ("_held", "_lock", "_owners", "_total", "limit")

    def __init__(self) -> None:
        self.limit = 0
        self._lock = threading.Lock()
        # Per table, what it holds once its last checked insert is stored (at most), in a
        # one-element list updated in place.
        self._held: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()
        # The sum of `_held` while it has `_owners` tables (a table dropped: summed again).
        self._total = 0
        self._owners = 0

    def check(self, held: int, incoming: int, what: str, owner: Any = None) -> None:
        """Refuses an insert of `incoming` payload bytes that the memory cannot hold.

        Args:
          held: Bytes the table's compressed columns hold (`CompressedColumn.nbytes`, summed).
          incoming: Bytes the insert adds (its payloads and `SLOT_OVERHEAD` each), at most.
          what: The table, for the error.
          owner: The table (weakly referenced): the budget counts what every owner holds;
            None: `held` is all there is.

        Raises:
          ConfigError: Naming the bytes held, needed and available, if `incoming` plus
            `MEMORY_MARGIN` exceeds the available memory (the insert must then change nothing).
        """
        with self._lock:
            if owner is None:
                if held + incoming > self.limit:
                    self._grant(held, held, incoming, what)
                return
            cells = self._held
            cell = cells.get(owner)
            if cell is None or len(cells) != self._owners:
                if cell is None:
                    cell = cells[owner] = [0]
                self._total = sum(c[0] for c in cells.values())
                self._owners = len(cells)
            cell[0], total = held, self._total - cell[0] + held
            self._total = total
            if total + incoming > self.limit:
                self._grant(total, held, incoming, what)
            cell[0] = held + incoming
            self._total = total + incoming

    def _grant(self, total: int, held: int, incoming: int, what: str) -> None:
        """Looks at the memory: raises `check`'s error, or grants `incoming` and more."""
        available = sizes.available_memory()
        grant = max(MIN_GRANT, total // 8)
        if available is not None:
            needed = incoming + MEMORY_MARGIN
            if needed > available:
                others = (
                    ""
                    if total == held
                    else f" (the backend's tables hold {total} bytes, {sizes.human(total)})"
                )
                raise ConfigError(
                    f"{what} cannot store {incoming} more bytes of compressed payloads: it "
                    f"holds {held} bytes ({sizes.human(held)}) of them{others}, and the insert "
                    f"needs {needed} bytes ({sizes.human(needed)}, with {MEMORY_MARGIN} bytes "
                    f"kept free for reads) but {available} bytes ({sizes.human(available)}) of "
                    "memory are available. The insert was refused and nothing was written (the "
                    "items held stay readable): lower the table's capacity, free memory, or use "
                    "a codec that compresses these values better"
                )
            grant = min(grant, available - needed)
        self.limit = total + incoming + grant


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
        out = self._out(out, expected)
        if self.value_bytes:
            threads = decode_threads() if threads is None else threads
            self.codec.decode_batch(payloads, out, threads)
        return out

    def _out(self, out: np.ndarray | None, expected: tuple[int, ...]) -> np.ndarray:
        """`out`, checked to be a C-contiguous array of shape `expected` and the column's
        dtype, or a new one.

        Raises:
          ValueError: If `out` does not fit.
        """
        if out is None:
            return np.empty(expected, self.dtype)
        if out.shape != expected or out.dtype != self.dtype or not out.flags.c_contiguous:
            raise ValueError(
                f"out must be a C-contiguous {self.dtype} array of shape {expected}, got "
                f"{out.dtype} {out.shape}"
            )
        return out

    def decode_take(
        self,
        payloads: Sequence[bytes],
        take: np.ndarray,
        threads: int | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Decodes each of `payloads` once into the values `take` picks: what
        `decode(payloads)[take]` returns, without decoding a payload twice or a second copy.

        Args:
          payloads: What `gather` returned (the distinct slots of a read).
          take: int indexes into `payloads` (any shape, repeats allowed).
          threads: Threads to decode a large batch on; None: `decode_threads()`.
          out: A C-contiguous `[*take.shape, *shape]` array of the column's dtype to fill;
            None: a new one.

        Returns:
          `out`, or a new writable array `[*take.shape, *shape]` of the column's dtype.

        Raises:
          ValueError: If a payload is corrupt, `take` names no payload, or `out` does not fit.
        """
        take = np.asarray(take, dtype=np.int64)
        if take.size and (take.min() < 0 or take.max() >= len(payloads)):
            raise ValueError(f"take names payloads out of range of {len(payloads)}")
        expected = (*take.shape, *self.shape)
        out = self._out(out, expected)
        if not self.value_bytes:
            return out
        threads = decode_threads() if threads is None else threads
        self.codec.decode_take(payloads, take.reshape(-1), self.value_bytes, threads, out)
        return out

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

"""Arrays that a local table's reads gather batches into, reused once nothing refers to them.

A batch of pixels is a large array (32 Atari transitions: about 1 MB). Allocated afresh for
every batch, its pages come from the operating system each time once glibc's malloc hands
large blocks back (its trim and mmap thresholds): every page faults and is zeroed before the
gather writes it, which costs as much as the gather itself. `BatchBuffers` keeps a few arrays
per shape and hands one out again only when no other object refers to it (`sys.getrefcount`:
a batch's tensors, their views and numpy arrays made from them all hold a reference to the
array through `torch.from_numpy`'s storage or numpy's `base`), so a batch a caller still
holds is never written. While every kept array is held, a new one is made and kept in place
of one of them, in turn (the pool then holds the arrays of the batches in use, whatever a
caller keeps for long).
"""

from __future__ import annotations

import math
import sys
import threading
from typing import Any

import numpy as np

# Arrays smaller than this are allocated as usual (malloc keeps small blocks; a pool saves
# nothing there).
MIN_BYTES = 64 << 10
# Arrays kept per shape and dtype: a loop holding the batch before the one it asks for, and a
# prefetched one, leave some free.
KEEP = 6
# Shapes kept at once (a stream's few batch shapes; the oldest shape is dropped beyond this).
MAX_SHAPES = 8
# Larger arrays are allocated as usual (kept, they would hold that much memory each).
MAX_BYTES = 16 << 20
# Bytes kept at most, all shapes together.
MAX_KEPT_BYTES = 64 << 20

# `sys.getrefcount` of a kept array that nothing else refers to, inside `empty`'s loop: the
# list's reference, the loop variable's and getrefcount's argument.
_FREE_REFS = 3


class BatchBuffers:
    """A few output arrays per shape and dtype, reused once nothing else refers to them (see
    the module docstring). Safe to use from several threads at once."""

    def __init__(self) -> None:
        self._kept: dict[tuple[tuple[int, ...], np.dtype], list[np.ndarray]] = {}
        # Per shape and dtype, the kept array replaced next when every one is in use.
        self._turn: dict[tuple[tuple[int, ...], np.dtype], int] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialised C-contiguous array of `shape` and `dtype` that nothing else
        refers to: a kept one that its last batch no longer uses, or a new one (kept, up to
        `KEEP` per shape and dtype, else in place of a kept one, in turn).

        Args:
          shape: The array's shape (a tuple of ints).
          dtype: Its dtype.

        Returns:
          The array; the caller fills every element (its contents are undefined).
        """
        kept = self._kept.get((shape, dtype))
        if kept is not None:  # a shape held (`dtype` given as a `np.dtype`): a free one at once
            with self._lock:
                for array in kept:
                    if sys.getrefcount(array) == _FREE_REFS:
                        return array
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < MIN_BYTES or nbytes > MAX_BYTES:
            return np.empty(shape, dtype)
        key = (shape, dtype)
        with self._lock:
            kept = self._kept.get(key)
            if kept is None:
                if len(self._kept) >= MAX_SHAPES:
                    dropped = next(iter(self._kept))
                    self._bytes -= sum(a.nbytes for a in self._kept.pop(dropped))
                    del self._turn[dropped]
                kept = self._kept[key] = []
                self._turn[key] = 0
            for array in kept:
                if sys.getrefcount(array) == _FREE_REFS:
                    return array
            array = np.empty(shape, dtype)
            if len(kept) < KEEP and self._bytes + nbytes <= MAX_KEPT_BYTES:
                kept.append(array)
                self._bytes += nbytes
            elif kept:  # every kept one in use: this one takes the place of one, in turn
                turn = self._turn[key] % len(kept)
                kept[turn] = array
                self._turn[key] = turn + 1
            return array

    def clear(self) -> None:
        """Drops every kept array (arrays still in use stay valid: their holders own them)."""
        with self._lock:
            self._kept.clear()
            self._turn.clear()
            self._bytes = 0

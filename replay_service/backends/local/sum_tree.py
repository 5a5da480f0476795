"""`SumTree`: the sum tree behind the local backend's "prioritized" sampler.

A complete binary tree over a power of two of leaves in one numpy array (`tree[1]` the root,
`tree[i]` the sum of `tree[2i]` and `tree[2i+1]`, the leaves from `tree[leaves]` on). Setting
weights updates the sums of their ancestors level by level; `find` walks from the root to the
leaf whose range of prefix sums holds each target. Both are vectorized over many slots.

The tree stores what it is given: checking priorities (finite, >= 0) is the caller's job
(`sample.priorities` refuses NaN, infinite and negative ones before they reach a table).
"""

from __future__ import annotations

import math

import numpy as np


class SumTree:
    """Sums of non-negative weights over `capacity` slots; samples slots by weight.

    Updates and samples are vectorized over slots (`O(k log capacity)` numpy work per call).

    Args:
      capacity: Number of slots.
    """

    def __init__(self, capacity: int) -> None:
        self._leaves = 1 << max(0, math.ceil(math.log2(max(1, capacity))))
        self._tree = np.zeros(2 * self._leaves, dtype=np.float64)

    @property
    def total(self) -> float:
        """The sum of all weights."""
        return float(self._tree[1])

    def get(self, slots: np.ndarray) -> np.ndarray:
        """The weights of `slots`."""
        return self._tree[np.asarray(slots, dtype=np.int64) + self._leaves]

    def set(self, slots: np.ndarray, weights: np.ndarray) -> None:
        """Sets the weights of `slots` (later duplicates win)."""
        index = np.asarray(slots, dtype=np.int64) + self._leaves
        self._tree[index] = weights
        index = np.unique(index >> 1)
        while index[0] >= 1:
            self._tree[index] = self._tree[2 * index] + self._tree[2 * index + 1]
            if index[0] == 1:
                break
            index = np.unique(index >> 1)

    def find(self, targets: np.ndarray) -> np.ndarray:
        """The slot holding each prefix sum in `targets` (each in `[0, total)`)."""
        index = np.ones(len(targets), dtype=np.int64)
        remaining = np.array(targets, dtype=np.float64)
        while index[0] < self._leaves:
            left = self._tree[2 * index]
            right = remaining >= left
            remaining -= left * right
            index = 2 * index + right
        return index - self._leaves

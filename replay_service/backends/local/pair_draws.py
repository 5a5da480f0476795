"""Transitions of a frame-stacked local table drawn several batches at a time: the draws and
the small fields read in one table call, each batch's frames gathered (and its draws counted)
only when it is handed out (`LocalTable`'s base class `PairDrawing`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from replay_service.backends.local.ring_reads import PairPlan
from replay_service.backends.local.slots import RingSlots
from replay_service.config.options import TableConfig
from replay_service.specs.frames import FrameStack


class PairDrawing:
    """Draws of transitions ahead of their reads, a base class of `LocalTable` (whose
    attributes and methods below it uses)."""

    config: TableConfig
    size: int
    samples: int
    _frames: FrameStack | None
    _slots: Any
    _device: torch.device | None
    _compressed: frozenset[int]
    _length: int
    _changed: threading.Condition
    _closed: bool
    _rng: np.random.Generator
    _times_sampled: np.ndarray
    _step_positions: Any
    _read_plain: Any
    _pair_plan: Any
    _pair_frames: Any
    _wait_for_items: Any
    _require_open: Any
    _priorities: Any

    def pair_steps(self, steps: Sequence[tuple[int, int]]) -> bool:
        """Whether transitions reading `steps` can be drawn ahead (`draw_pairs`): a uniform
        table of independent draws whose stacked observations are read at steps 0 and 1 from
        host frames stored as they are.

        Args:
          steps: `(field, step)` pairs of a transition (`sample`'s `steps`).
        """
        frames = self._frames
        return (
            frames is not None
            and self.config.sampling.independent_draws
            and isinstance(self._slots, RingSlots)
            and self._device is None
            and not self._compressed
            and self._length == 2
            and sorted(s for f, s in steps if f == frames.field) == [0, 1]
        )

    def draw_pairs(
        self, batch_size: int, draws: int, steps: Sequence[tuple[int, int]], timeout: float | None
    ) -> PairDraws:
        """Draws `draws` batches of `batch_size` transitions at once (see `pair_steps`), uniform
        with replacement, and reads every field but the stacked observation: their frames are
        gathered a batch at a time by `read_pairs`, which counts the batch's draws.

        Args:
          batch_size: Items per batch.
          draws: Batches.
          steps: `(field, step)` pairs read per item (`sample`'s `steps`).
          timeout: Seconds to wait for `min_size_to_sample` items; None waits forever.

        Returns:
          The draws, for `read_pairs`.

        Raises:
          BufferStateError: If the table does not hold `min_size_to_sample` items within
            `timeout`.
          ManagerClosedError: If the table was closed (also while waiting).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        frames = self._frames
        assert frames is not None and isinstance(self._slots, RingSlots)
        field = frames.field
        plain = [pair for pair in steps if pair[0] != field]
        total = batch_size * draws
        with self._changed:
            self._wait_for_items(deadline, timeout)
            held = self.size
            numbers = self._rng.integers(0, held, total) + self._slots.first
            slots = numbers % self.config.capacity
            positions = self._step_positions(slots, 1)
            data = self._read_plain(dict(enumerate(positions)), plain) if plain else []
            plan = self._pair_plan(positions[0], positions[1], batch_size)
        oldest = numbers.reshape(draws, batch_size).min(axis=1).tolist()
        return PairDraws(batch_size, numbers, slots, oldest, data, plan, held)

    def read_pairs(
        self, drawn: PairDraws, index: int, with_info: bool
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], dict[str, np.ndarray]] | None:
        """Batch `index` of `drawn`: its stacked observations at steps 0 and 1 (as `sample`
        reads them) and its info (as `sample`'s; an empty dict without `with_info`), its draws
        counted as samples now; None if one of its items left the table since the draw
        (nothing counted then).

        Raises:
          ManagerClosedError: If the table was closed.
        """
        size = drawn.batch_size
        with self._changed:
            if self._closed:
                self._require_open()
            if drawn.oldest[index] < self._slots.first:  # RingSlots: items leave oldest first
                return None
            lo = index * size
            slots = drawn.slots[lo : lo + size]
            # `_count_draws` of the batch's slots: a slot drawn twice in the batch is counted
            # twice (`np.add.at`), the common batch of distinct slots by one indexed add.
            if drawn.repeats[index]:
                np.add.at(self._times_sampled, slots, 1)
            else:
                self._times_sampled[slots] += 1
            self.samples += size
            info = {}
            if with_info:
                info = {
                    "key": self._slots.keys_for(drawn.numbers[lo : lo + size], slots),
                    "probability": np.full(size, 1.0 / drawn.held),
                    "table_size": np.full(size, drawn.held, dtype=np.int64),
                    "priority": self._priorities(slots),
                    "times_sampled": self._times_sampled.take(slots),
                }
            stacks = self._pair_frames(drawn.plan, index)
        return stacks, info


class PairDraws:
    """Batches of transitions drawn at once by `LocalTable.draw_pairs`.

    Attributes:
      batch_size: Items per batch.
      numbers: The items' insertion numbers (`slots.RingSlots`), `[batches * batch_size]`.
      slots: Their slots.
      oldest: Per batch, its oldest item's insertion number (held while the table's oldest
        is not newer).
      data: The fields but the stacked observation, one tensor per `(field, step)` pair
        (`[batches * batch_size, ...]`), in the order of the pairs.
      plan: Where the stacked observations' frames are (`ring_reads.PairPlan`).
      held: Items the table held at the draw (their probability is its inverse).
      repeats: Per batch, whether one of its slots is drawn more than once in it.
    """

    __slots__ = (
        "batch_size",
        "data",
        "held",
        "numbers",
        "oldest",
        "plan",
        "repeats",
        "slots",
    )

    def __init__(
        self,
        batch_size: int,
        numbers: np.ndarray,
        slots: np.ndarray,
        oldest: list[int],
        data: list[torch.Tensor],
        plan: PairPlan,
        held: int,
    ) -> None:
        self.batch_size = batch_size
        self.numbers = numbers
        self.slots = slots
        self.oldest = oldest
        self.data = data
        self.plan = plan
        self.held = held
        # Per batch, whether a slot is drawn more than once in it.
        rows = np.sort(slots.reshape(len(oldest), batch_size), axis=1)
        self.repeats = (rows[:, 1:] == rows[:, :-1]).any(axis=1).tolist()

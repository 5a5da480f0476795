"""`SharedTable` and `SharedReader` built by hand: a reader draws only held items, reads each
item's steps from its first ring position (wrapping), waits for `min_size`, redraws items
evicted while read, gives up after `MAX_ROUNDS`, and stops once the owner closes the table."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replay_service.backends.local import shared
from replay_service.backends.local.shared import (
    CELL_CLOSED,
    CELL_NEXT,
    CELL_OLDEST,
    CELL_SIZE,
    SharedReader,
    SharedTable,
)
from replay_service.errors import BufferStateError, ManagerClosedError

pytestmark = pytest.mark.local

CAPACITY = 4
LENGTH = 2
RING = 10


def make_table(
    oldest: int, next_: int, *, min_size: int = 1, seed: int | None = 0, stride: int = 1
) -> SharedTable:
    """A table holding items `[oldest, next_)`: item n starts at ring position `3 * n % RING`
    and step s of the ring holds x = [s, -s] and n = 100 + s."""
    steps = np.arange(RING)
    columns = [
        torch.from_numpy(np.stack([steps, -steps], axis=-1).astype(np.float32)),
        torch.from_numpy(100 + steps),
    ]
    first = np.zeros(CAPACITY, np.int64)
    for n in range(oldest, next_):
        first[n % CAPACITY] = 3 * n % RING
    cell = np.zeros(4, np.int64)
    cell[[CELL_SIZE, CELL_OLDEST, CELL_NEXT]] = [min(next_ - oldest, CAPACITY), oldest, next_]
    metadata = {
        "_first": torch.from_numpy(first),
        "_priority": torch.from_numpy(np.arange(CAPACITY, dtype=np.float64) + 0.5),
        "_times_sampled": torch.from_numpy(np.arange(CAPACITY, dtype=np.int32) * 10),
        "_cell": torch.from_numpy(cell),
    }
    seq = None if seed is None else np.random.SeedSequence(seed)
    return SharedTable("t", CAPACITY, LENGTH, RING, min_size, columns, metadata, seq, stride, 1)


def first_steps(numbers: np.ndarray) -> np.ndarray:
    return 3 * numbers % RING


def test_a_reader_returns_whole_held_items_read_around_the_ring_and_their_info() -> None:
    table = make_table(oldest=3, next_=7)  # items 3..6; item 6 starts at 8 and wraps to 9, 0
    data, info = table.reader(0).sample(200, timeout=1.0)
    x, n = (d.numpy() for d in data)
    assert x.shape == (200, LENGTH, 2) and n.shape == (200, LENGTH)
    starts = n[:, 0] - 100
    assert set(starts.tolist()) == {9, 2, 5, 8}  # items 3, 4, 5, 6: all drawn, nothing else
    np.testing.assert_array_equal(n[:, 1] - 100, (starts + 1) % RING)
    np.testing.assert_array_equal(x[..., 0], n - 100)
    np.testing.assert_array_equal(x[..., 1], -(n - 100))
    numbers = (info["key"].astype(np.int64) - 2) // CAPACITY  # keys: (n * cap + slot) + offset 1
    np.testing.assert_array_equal(first_steps(numbers), starts)
    slots = numbers % CAPACITY
    np.testing.assert_array_equal(info["priority"], slots + 0.5)
    np.testing.assert_array_equal(info["times_sampled"], slots * 10)
    np.testing.assert_array_equal(info["table_size"], np.full(200, 4))
    np.testing.assert_array_equal(info["probability"], np.full(200, 0.25))


def test_keys_follow_the_tables_stride_and_offset() -> None:
    _, info = make_table(0, 4, stride=3).reader(0).sample(50, timeout=1.0)
    keys = info["key"].astype(np.int64)
    assert set((keys % 3).tolist()) == {2}  # offset 1 of stride 3: base * 3 + 2
    assert set(((keys - 2) // 3).tolist()) <= {n * CAPACITY + n % CAPACITY for n in range(4)}


def test_without_info_the_reader_returns_an_empty_dict() -> None:
    data, info = make_table(0, 2).reader(0).sample(3, timeout=1.0, with_info=False)
    assert info == {} and data[0].shape == (3, LENGTH, 2)


def test_seeded_readers_repeat_per_worker_and_differ_between_workers() -> None:
    table = make_table(0, 4)

    def draws(worker: int) -> list[int]:
        return table.reader(worker).sample(64, timeout=1.0)[1]["key"].tolist()

    assert draws(1) == draws(1)
    assert draws(1) != draws(2)
    unseeded = make_table(0, 4, seed=None)
    a, b = (unseeded.reader(0).sample(64, 1.0)[1]["key"].tolist() for _ in range(2))
    assert a != b


def test_a_reader_below_min_size_fails_within_its_timeout_naming_the_table_and_sizes() -> None:
    reader = make_table(0, 2, min_size=3).reader(0)
    with pytest.raises(
        BufferStateError,
        match=r"table 't' within 0\.05 s: it holds 2 items .*"
        r"min_size_to_sample=3",
    ):
        reader.sample(1, timeout=0.05)
    with pytest.raises(BufferStateError, match="it holds 0 items"):
        make_table(5, 5, min_size=0).reader(0).sample(1, timeout=0.02)


def test_a_closed_table_stops_its_readers() -> None:
    table = make_table(0, 4)
    reader = table.reader(0)
    assert not reader.closed()
    table.metadata["_cell"][CELL_CLOSED] = 1
    assert reader.closed()
    with pytest.raises(ManagerClosedError, match="the buffer of table 't' was closed"):
        reader.sample(1, timeout=None)


class _EvictingCell:
    """A cell whose oldest item moves on by `step` on every read of it after `calm` reads."""

    def __init__(self, cell: np.ndarray, step: int, calm: int) -> None:
        self.cell, self.step, self.calm = cell, step, calm

    def __getitem__(self, index: int) -> np.int64:
        if index == CELL_OLDEST:
            if self.calm:
                self.calm -= 1
            else:
                self.cell[CELL_OLDEST] += self.step
                self.cell[CELL_NEXT] += self.step
        return self.cell[index]


def test_items_evicted_while_read_are_redrawn_from_the_newer_ones() -> None:
    table = make_table(0, 4)
    reader = SharedReader(table, np.random.default_rng(0))
    # First round: oldest is read as 0, then checked as 2: draws of items 0 and 1 are redrawn
    # from items 2..5 (whose first steps stay those of the slots they reuse).
    reader._cell = _EvictingCell(reader._cell.copy(), step=2, calm=1)
    _, info = reader.sample(100, timeout=1.0)
    numbers = (info["key"].astype(np.int64) - 2) // CAPACITY
    assert numbers.min() >= 2
    assert (numbers >= 4).any()


def test_draws_that_keep_landing_on_evicted_items_give_up_after_max_rounds(monkeypatch) -> None:
    monkeypatch.setattr(shared, "MAX_ROUNDS", 3)
    reader = make_table(0, 4).reader(0)
    reader._cell = _EvictingCell(reader._cell.copy(), step=CAPACITY, calm=0)
    with pytest.raises(BufferStateError, match=r"table 't': 3 draws in a row landed on items"):
        reader.sample(4, timeout=1.0)

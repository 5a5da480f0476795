"""Inserts into a local table (`WindowInserts`) used directly: whole windows and a writer's
overlapping windows read back exactly whether or not they share steps, a writer's memory
(`WindowStream`) is dropped on reset and ignored once its last item is gone, oversized inserts
keep the newest items, and data of another shape or dtype is refused naming the field."""

from __future__ import annotations

import numpy as np
import pytest

from replay_service.backends.local.table import LocalTable
from replay_service.backends.local.windows import WindowStream
from replay_service.config.options import SamplingConfig, TableConfig
from replay_service.errors import ManagerClosedError, SpecMismatchError

pytestmark = pytest.mark.local

FIELDS = [
    {"path": "x", "dtype": "float32", "shape": [2]},
    {"path": "n", "dtype": "int64", "shape": []},
]
LENGTH = 3


def make(capacity: int = 4, length: int = LENGTH) -> LocalTable:
    config = TableConfig("t", capacity, length, sampling=SamplingConfig(sampler="prioritized"))
    return LocalTable(config, FIELDS, seed=0)


def step(v: int) -> list[np.ndarray]:
    return [np.array([v, -v], np.float32), np.int64(v)]


def windows(starts: list[int], length: int = LENGTH) -> list[np.ndarray]:
    """One item per start s: steps s, s+1, ..."""
    n = np.array([[s + i for i in range(length)] for s in starts], np.int64).reshape(-1, length)
    x = np.stack([n, -n], axis=-1).astype(np.float32)
    return [x, n]


def held(table: LocalTable) -> list[list[int]]:
    data, _, _ = table.items()
    np.testing.assert_array_equal(data[0][..., 0], data[1])  # x = [n, -n] on every step
    np.testing.assert_array_equal(data[0][..., 1], -data[1])
    return data[1].tolist()


@pytest.mark.parametrize(
    "starts",
    [
        [0, 1, 2, 3],  # each the one before shifted by one step: shares all but its last
        [0, 3, 6, 9],  # disjoint
        [0, 1, 5, 6, 7],  # runs broken by a jump; the first is evicted
        [2, 2, 2],  # the same window again is no shift of it
    ],
)
def test_inserted_windows_read_back_exactly_with_their_priorities(starts: list[int]) -> None:
    table = make()
    priorities = np.arange(len(starts), dtype=np.float64) + 0.25
    keys = table.insert(windows(starts), priorities)
    kept = starts[-4:]
    assert keys.dtype == np.uint64 and len(set(keys.tolist())) == len(kept)
    assert held(table) == [[s + i for i in range(LENGTH)] for s in kept]
    np.testing.assert_array_equal(table.items()[1], priorities[-4:])
    assert (table.size, table.inserts) == (len(kept), len(starts))


def test_an_insert_larger_than_the_table_keeps_its_newest_items() -> None:
    table = make(capacity=3)
    table.insert(windows([100]), np.ones(1))
    table.insert(windows(list(range(10))), np.arange(10, dtype=np.float64))
    assert held(table) == [[7, 8, 9], [8, 9, 10], [9, 10, 11]]
    np.testing.assert_array_equal(table.items()[1], [7.0, 8.0, 9.0])
    assert table.inserts == 11


def test_an_empty_insert_changes_nothing_and_a_closed_table_refuses_it() -> None:
    table = make()
    table.insert(windows([4]), np.ones(1))
    keys = table.insert(windows([]), np.zeros(0))
    assert keys.dtype == np.uint64 and keys.shape == (0,)
    assert held(table) == [[4, 5, 6]] and table.inserts == 1
    table.close()
    with pytest.raises(ManagerClosedError, match="table 't' was closed"):
        table.insert(windows([]), np.zeros(0))
    with pytest.raises(ManagerClosedError, match="table 't' was closed"):
        table.insert_window([step(0)] * LENGTH, 1.0)
    assert held(table) == [[4, 5, 6]]


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (windows([0])[:1], r"table 't' stores 2 fields, got 1"),
        (
            [windows([0])[0].astype(np.float64), windows([0])[1]],
            r"table 't' field 'x': expected float32 \[1, 3, 2\], got float64 \[1, 3, 2\]",
        ),
        (
            windows([0], length=2),
            r"field 'x': expected float32 \[1, 3, 2\], got float32 \[1, 2, 2\]",
        ),
        (windows([0, 1]), r"field 'x': expected float32 \[1, 3, 2\], got float32 \[2, 3, 2\]"),
    ],
)
def test_data_of_another_layout_is_refused_naming_the_field(data, match) -> None:
    table = make()
    table.insert(windows([7]), np.ones(1))
    with pytest.raises(SpecMismatchError, match=match):
        table.insert(data, np.ones(1))
    assert held(table) == [[7, 8, 9]] and table.inserts == 1


def test_a_writers_overlapping_windows_read_back_exactly_and_reset_starts_afresh() -> None:
    table = make(capacity=6)
    stream = table.stream()
    assert isinstance(stream, WindowStream) and stream.serials == [] and stream.key == 0
    written: list[list[int]] = []
    history: list[int] = []

    def add(value: int, fresh: int | None = 1) -> None:
        history.append(value)
        if len(history) >= LENGTH:
            window = history[-LENGTH:]
            key = table.insert_window([step(v) for v in window], 0.5, stream, fresh)
            assert stream.key == key and len(stream.serials) == LENGTH
            written.append(window)

    for v in range(5):
        add(v)
    stream.reset()
    assert (stream.serials, stream.key) == ([], 0)
    history.clear()
    for v in (50, 51):
        add(v)
    add(52, fresh=LENGTH)  # a new episode's first window: all its steps are new
    add(53)
    add(54, fresh=None)  # unknown: nothing is shared
    add(55)
    assert held(table) == written[-6:]
    np.testing.assert_array_equal(table.items()[1], np.full(6, 0.5))


def test_a_writer_whose_last_item_was_evicted_writes_its_window_whole() -> None:
    table = make(capacity=2)
    stream = table.stream()
    table.insert_window([step(v) for v in (0, 1, 2)], 1.0, stream, LENGTH)
    # Other items evict the writer's last one (and may overwrite its steps).
    table.insert(windows([10, 20]), np.ones(2))
    table.insert(windows([30, 40]), np.ones(2))
    table.insert_window([step(v) for v in (1, 2, 3)], 1.0, stream, 1)
    assert held(table) == [[40, 41, 42], [1, 2, 3]]


def test_windows_of_one_step_share_nothing_and_read_back_exactly() -> None:
    table = make(length=1)
    stream = table.stream()
    for v in range(6):
        table.insert_window([step(v)], 1.0, stream, 1)
    table.insert(windows([7, 8], length=1), np.ones(2))
    assert held(table) == [[4], [5], [7], [8]]

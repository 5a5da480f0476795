"""`pair_draws`: a frame-stacked table draws several batches of transitions in one call, reads
each batch's stacks as a plain sample would, counts a batch's draws only when it is read, and
gives nothing for a batch whose items left the table since the draw."""

from __future__ import annotations

import numpy as np
import pytest

from replay_service.backends.local.table import LocalTable
from replay_service.config.options import TableConfig

pytestmark = pytest.mark.local

K = 3
FIELDS = [
    {"path": "observation", "dtype": "uint8", "shape": [K, 2, 2]},
    {"path": "reward", "dtype": "float32", "shape": []},
]
STEPS = [(0, 0), (0, 1), (1, 0)]


def stack(newest: int) -> np.ndarray:
    return np.stack([np.full((2, 2), max(1, newest - K + 1 + i), np.uint8) for i in range(K)])


def filled(capacity: int = 16, items: int = 10) -> LocalTable:
    table = LocalTable(TableConfig("t", capacity, 2, frame_stack=K), FIELDS, seed=0)
    windows = np.stack([np.stack([stack(i), stack(i + 1)]) for i in range(1, items + 1)])
    rewards = np.arange(1, items + 1, dtype=np.float32)[:, None].repeat(2, 1)
    table.insert([windows, rewards], np.ones(items))
    return table


def test_only_transitions_of_frame_stacked_uniform_host_tables_are_drawn_ahead() -> None:
    assert filled().pair_steps(STEPS)
    assert not filled().pair_steps([(0, 0), (1, 0)])  # no next stack
    plain = LocalTable(TableConfig("t", 4, 2), FIELDS[1:], seed=0)
    assert not plain.pair_steps([(0, 0), (0, 1)])


def test_drawn_batches_read_the_stacks_of_their_items_and_count_when_read() -> None:
    table = filled()
    drawn = table.draw_pairs(4, 3, STEPS, timeout=1.0)
    assert table.samples == 0 and not table._times_sampled.any()
    for index in range(3):
        got = table.read_pairs(drawn, index, with_info=True)
        assert got is not None
        (states, next_states), info = got
        rewards = drawn.data[0][index * 4 : index * 4 + 4].numpy()
        for state, following, reward in zip(states, next_states, rewards, strict=True):
            item = int(reward)  # item v: stacks ending at frames v and v + 1
            np.testing.assert_array_equal(np.asarray(state), stack(item))
            np.testing.assert_array_equal(np.asarray(following), stack(item + 1))
        assert info["table_size"].tolist() == [10] * 4
    assert table.samples == 12 and int(table._times_sampled.sum()) == 12


def test_a_batch_whose_items_left_is_not_read_and_not_counted() -> None:
    table = filled(capacity=10)
    drawn = table.draw_pairs(5, 2, STEPS, timeout=1.0)
    table.insert(  # every item drawn is evicted
        [
            np.stack([np.stack([stack(i), stack(i + 1)]) for i in range(20, 30)]),
            np.zeros((10, 2), np.float32),
        ],
        np.ones(10),
    )
    assert table.read_pairs(drawn, 0, with_info=False) is None
    assert table.samples == 0


def test_a_batch_s_probability_and_table_size_are_those_of_its_draw() -> None:
    table = filled(capacity=16, items=4)
    drawn = table.draw_pairs(2, 1, STEPS, timeout=1.0)
    table.insert(  # the table grows before the batch is read
        [
            np.stack([np.stack([stack(i), stack(i + 1)]) for i in range(5, 9)]),
            np.zeros((4, 2), np.float32),
        ],
        np.ones(4),
    )
    got = table.read_pairs(drawn, 0, with_info=True)
    assert got is not None
    _, info = got
    assert info["table_size"].tolist() == [4, 4]
    np.testing.assert_allclose(info["probability"], [0.25, 0.25])


def test_a_batch_drawn_before_the_ring_grew_reads_its_items_stacks() -> None:
    table = filled(capacity=16, items=30)  # the ring wrapped: steps on both sides of its head
    drawn = table.draw_pairs(8, 4, STEPS, timeout=1.0)
    size = table._ring_size
    with table._changed:
        assert table._grow(size + 8)  # steps after the head move up
    assert table._ring_size == size + 8
    for index in range(4):
        got = table.read_pairs(drawn, index, with_info=False)
        assert got is not None
        (states, next_states), _ = got
        rewards = drawn.data[0][index * 8 : index * 8 + 8].numpy()
        for state, following, reward in zip(states, next_states, rewards, strict=True):
            item = int(reward)
            np.testing.assert_array_equal(np.asarray(state), stack(item))
            np.testing.assert_array_equal(np.asarray(following), stack(item + 1))


def test_a_slot_drawn_twice_in_a_batch_is_counted_twice() -> None:
    table = filled(capacity=16, items=3)  # 8 draws of 3 items: slots repeat in every batch
    drawn = table.draw_pairs(8, 2, STEPS, timeout=1.0)
    assert table.read_pairs(drawn, 0, with_info=False) is not None
    expected = np.bincount(drawn.slots[:8], minlength=16)
    np.testing.assert_array_equal(table._times_sampled, expected)
    assert table.read_pairs(drawn, 1, with_info=False) is not None
    np.testing.assert_array_equal(table._times_sampled, np.bincount(drawn.slots, minlength=16))

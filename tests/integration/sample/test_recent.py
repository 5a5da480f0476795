"""Emphasizing recent experience (pytorchrl's EREBuffer): recent_batches samples update k of K
only from the newest c_k = max(N * eta ** (k * 1000 / K), c_min) items; Reverb refuses it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from gymnasium import spaces

from conftest import FAST_TIMEOUTS
from replay_service import BufferStateError, ConfigError, ReplayBufferManager

pytestmark = pytest.mark.heavy

OBSERVATION = spaces.Box(-1e6, 1e6, (2,), np.float32)
ACTION = spaces.Discrete(2)


def manager_for(tmp_path: Any, backend: str, capacity: int) -> ReplayBufferManager:
    return ReplayBufferManager.from_spaces(
        OBSERVATION,
        ACTION,
        capacity=capacity,
        checkpoint_dir=str(tmp_path / backend),
        backend=backend,
        timeouts=FAST_TIMEOUTS,
    )


def fill(manager: ReplayBufferManager, count: int, start: int = 0) -> None:
    """`count` transitions of one episode; transition i's state is `[i, 0]`."""
    writer = manager.transition_writer()
    for i in range(start, start + count):
        state = np.array([i, 0], np.float32)
        writer.add(state, i % 2, 0.0, np.array([i + 1, 0], np.float32), i == start + count - 1)
    writer.flush()


def test_update_k_samples_only_the_newest_c_k_items(tmp_path):
    # 260 transitions into 200 slots: the 60 oldest were evicted, items hold states 60..259.
    with manager_for(tmp_path, "local", capacity=200) as manager:
        manager.create_replay_buffer()
        fill(manager, 260)
        assert len(manager) == 200
        eta, c_min, updates = 0.999, 20, 8
        batches = manager.recent_batches(
            256, updates, eta=eta, c_min=c_min, seed=3, transitions=True
        )
        assert len(batches) == updates
        drawn = [batch.states[:, 0].numpy().astype(int) for batch in batches]
        expected = [max(int(200 * eta ** (k * 1000 / updates)), c_min) for k in range(updates)]
        assert batches.windows == expected
        assert expected[0] == 200 and expected[-1] < 100  # the schedule shrinks the window
        for k, (states, window) in enumerate(zip(drawn, expected, strict=True)):
            newest = set(range(260 - window, 260))
            assert set(states.tolist()) <= newest, f"update {k} sampled outside its window"
            # Uniform over the window: its oldest quarter is drawn too.
            assert states.min() < 260 - window + window // 4, k
        # A seed repeats the round; the table was read, not sampled.
        again = [b.states[:, 0].numpy().astype(int) for b in batches]
        for a, b in zip(drawn, again, strict=True):
            np.testing.assert_array_equal(a, b)


def test_the_window_follows_items_written_during_a_round(tmp_path):
    with manager_for(tmp_path, "local", capacity=1000) as manager:
        manager.create_replay_buffer()
        fill(manager, 100)
        batches = iter(manager.recent_batches(64, 2, eta=0.5, c_min=10, seed=0))
        first = next(batches)
        assert first.observation[:, 0, 0].max() <= 99
        fill(manager, 100, start=1000)  # N becomes 200; update 1's window is its 10 newest
        second = next(batches).observation[:, 0, 0].numpy().astype(int)
        assert set(second.tolist()) <= set(range(1090, 1100))


def test_eta_one_is_uniform_over_the_whole_table(tmp_path):
    with manager_for(tmp_path, "local", capacity=1000) as manager:
        manager.create_replay_buffer()
        fill(manager, 50)
        batches = manager.recent_batches(400, 5, eta=1.0, c_min=1, seed=1)
        for batch in batches:
            assert set(batch.observation[:, 0, 0].numpy().astype(int).tolist()) == set(range(50))
        assert batches.windows == [50] * 5


def test_reverb_refuses_recent_batches_and_says_what_to_use(tmp_path):
    with manager_for(tmp_path, "reverb", capacity=100) as manager:
        manager.create_replay_buffer()
        with pytest.raises(ConfigError, match=r"recent_batches\(eta=0\.996.*backend='local'"):
            manager.recent_batches(32, 10)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"eta": 0.0}, "eta must be a number in \\(0, 1\\], got 0.0"),
        ({"eta": 1.5}, "got 1.5"),
        ({"eta": float("nan")}, "got nan"),
        ({"c_min": 0}, "c_min must be a positive integer, got 0"),
        ({"num_updates": 0}, "num_updates must be a positive integer, got 0"),
        ({"batch_size": True}, "batch_size must be a positive integer, got True"),
        ({"seed": -2}, "got -2"),
        ({"transitions": "yes"}, "got 'yes'"),
        ({"table": "nope"}, "nope"),
    ],
)
def test_bad_options_are_refused(tmp_path, kwargs, named):
    options = {"batch_size": 8, "num_updates": 4, **kwargs}
    with manager_for(tmp_path, "local", capacity=100) as manager:
        manager.create_replay_buffer()
        fill(manager, 10)
        with pytest.raises(ConfigError, match=named):
            manager.recent_batches(**options)


def test_an_empty_table_is_named(tmp_path):
    with manager_for(tmp_path, "local", capacity=100) as manager:
        manager.create_replay_buffer()
        with pytest.raises(BufferStateError, match="holds no items"):
            next(iter(manager.recent_batches(8, 4)))

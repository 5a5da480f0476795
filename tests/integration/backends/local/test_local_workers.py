"""DataLoader worker processes sampling a local table from shared memory.

Every item a worker yields must be exactly an item that was written (states are
`[episode, index, 0, 0]`, so each transition tells which one it is), workers must see items
written after they started, and the manager's `seed=` must make the workers' batches repeat.
Workers start with the platform's default method (fork on Linux).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gymnasium import spaces

from replay_service import ConfigError, ReplayBufferManager, SamplingConfig, Timeouts

pytestmark = pytest.mark.local

FAST = Timeouts(connect=5.0, write=10.0, sample=5.0, checkpoint=60.0)
OBSERVATION = spaces.Box(-1e6, 1e6, (4,), np.float32)
ACTION = spaces.Discrete(2)
NEXT = np.array([0, 1, 0, 0], np.float32)
BATCH = 16


@pytest.fixture()
def make(tmp_path) -> Iterator[Callable[..., ReplayBufferManager]]:
    """Local managers of a Box(4)/Discrete(2) spec; every one is closed at teardown."""
    made: list[ReplayBufferManager] = []

    def factory(name: str = "ckpt", **options: Any) -> ReplayBufferManager:
        options.setdefault("capacity", 64)
        options.setdefault("timeouts", FAST)
        manager = ReplayBufferManager.from_spaces(
            OBSERVATION, ACTION, checkpoint_dir=str(tmp_path / name), backend="local", **options
        )
        made.append(manager)
        manager.create_replay_buffer()
        return manager

    yield factory
    for manager in made:
        manager.close()


def write(writer: Any, episode: int, steps: int) -> None:
    """An episode of `steps` transitions: state `[episode, index, 0, 0]`, action
    `index % 2`, reward `episode * 1000 + index`."""
    for index in range(steps):
        state = np.array([episode, index, 0, 0], np.float32)
        writer.add(
            state, [index % 2], float(episode * 1000 + index), state + NEXT, index == steps - 1
        )


def check_written(batch: Any, episodes: set[int]) -> set[int]:
    """Asserts every transition of `batch` is one that was written, in an episode of
    `episodes`; returns the episodes it holds."""
    states = batch.states.numpy()
    assert batch.states.shape == (BATCH, 4)
    assert batch.actions.shape[0] == BATCH
    assert batch.rewards.shape == (BATCH,)
    assert batch.next_states.shape == (BATCH, 4)
    assert batch.dones.shape == (BATCH,)
    episode, index = states[:, 0].astype(np.int64), states[:, 1].astype(np.int64)
    np.testing.assert_array_equal(states[:, 2:], 0)
    np.testing.assert_array_equal(batch.next_states.numpy(), states + NEXT)
    np.testing.assert_array_equal(batch.rewards.numpy(), episode * 1000 + index)
    np.testing.assert_array_equal(batch.actions.numpy().reshape(BATCH), index % 2)
    assert set(episode.tolist()) <= episodes, set(episode.tolist()) - episodes
    return set(episode.tolist())


def test_workers_yield_written_items_and_see_new_ones(make) -> None:
    manager = make(seed=0)
    writer = manager.transition_writer()
    for episode in range(4):  # 4 * 20 transitions > capacity 64: evictions before the start
        write(writer, episode, 20)
    loader = manager.torch_dataset(BATCH, transitions=True).data_loader(num_workers=2)
    batches = iter(loader)
    seen: set[int] = set()
    for _ in range(6):
        seen |= check_written(next(batches), {0, 1, 2, 3})
    assert seen <= {0, 1, 2, 3}
    # Written after the workers started, while they sample: new episodes (the ring wraps and
    # evicts the items the workers were drawing from).
    # A batch comes from the DataLoader's queue, up to 4 batches drawn earlier, so it may hold
    # episodes the table has evicted since; any episode from 4 on was written after the start.
    found_new = False
    for episode in range(4, 40):
        write(writer, episode, 20)
        batch_episodes = check_written(next(batches), set(range(episode + 1)))
        if any(e >= 4 for e in batch_episodes):
            found_new = True
    assert found_new, "the workers never sampled an item written after they started"
    # Once writing stops, every batch drawn since holds only items the table still holds
    # (the DataLoader's queue holds up to prefetch_factor * num_workers = 4 batches drawn
    # before).
    time.sleep(0.2)
    for _ in range(4):
        next(batches)
    for _ in range(8):
        check_written(next(batches), set(range(36, 40)))
    del batches


def test_worker_items_match_the_table_exactly(make) -> None:
    """Sequences of 3 steps: every worker item is one window of the table, byte for byte."""
    manager = make(sequence_length=3, seed=1)
    writer = manager.transition_writer()
    write(writer, 0, 30)
    write(writer, 1, 30)
    written = {
        tuple(row.ravel().tolist())
        for row in next(iter(manager.torch_batches(4096))).observation.numpy()
    }
    loader = manager.torch_dataset(BATCH).data_loader(num_workers=2)
    for _, batch in zip(range(6), loader, strict=False):
        observation = batch.observation.numpy()
        assert observation.shape == (BATCH, 3, 4)
        for row in observation:
            assert tuple(row.ravel().tolist()) in written


def test_seeded_workers_repeat(make) -> None:
    def draws(name: str) -> list[np.ndarray]:
        manager = make(name, seed=7)
        writer = manager.transition_writer()
        write(writer, 0, 40)
        loader = manager.torch_dataset(BATCH, transitions=True).data_loader(num_workers=2)
        out = [batch.states.numpy().copy() for _, batch in zip(range(6), loader, strict=False)]
        manager.close()
        return out

    first, second = draws("a"), draws("b")
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)
    # The two workers draw from generators of their own: batches 0 and 1 differ.
    assert not np.array_equal(first[0], first[1])


def test_workers_with_info_give_keys_of_the_table(make) -> None:
    manager = make()
    writer = manager.transition_writer()
    write(writer, 0, 30)
    keys = set(next(iter(manager.torch_batches(4096, with_info=True)))[1].key.tolist())
    loader = manager.torch_dataset(BATCH, with_info=True).data_loader(num_workers=2)
    for _, (_, info) in zip(range(4), loader, strict=False):
        assert info.key.shape == (BATCH,)
        assert set(info.key.tolist()) <= keys
        np.testing.assert_array_equal(info.table_size.numpy(), 30)


@pytest.mark.heavy
def test_spawned_workers_sample_the_shared_table(make) -> None:
    manager = make(seed=2)
    writer = manager.transition_writer()
    write(writer, 0, 30)
    loader = manager.torch_dataset(BATCH, transitions=True).data_loader(
        num_workers=1, multiprocessing_context="spawn"
    )
    batches = iter(loader)
    check_written(next(batches), {0})
    write(writer, 1, 30)
    deadline = time.monotonic() + 30
    while not check_written(next(batches), {0, 1}) & {1}:
        assert time.monotonic() < deadline, "the spawned worker never saw episode 1"


def test_memmap_tables_are_shared_too(make) -> None:
    manager = make(storage="memmap")
    writer = manager.transition_writer()
    write(writer, 0, 30)
    batches = iter(manager.torch_dataset(BATCH, transitions=True).data_loader(num_workers=2))
    check_written(next(batches), {0})
    write(writer, 1, 70)  # wraps the ring: only episode 1 is held
    deadline = time.monotonic() + 30
    while check_written(next(batches), {0, 1}) != {1}:
        assert time.monotonic() < deadline, "the workers never saw the new items only"


@pytest.mark.heavy
def test_a_grown_memmap_table_is_shared_with_spawned_workers(make) -> None:
    """Interleaved writers grow a memory-mapped ring (steps shared between windows, items
    scattered): sharing moves it into files of whole windows, which a spawned worker opens by
    name, and every item it yields is one written, new ones included."""
    manager = make(storage="memmap", seed=3)
    writers = [manager.transition_writer() for _ in range(2)]
    for index in range(40):
        for episode, writer in enumerate(writers):
            state = np.array([episode, index, 0, 0], np.float32)
            writer.add(state, [index % 2], float(episode * 1000 + index), state + NEXT, index == 39)
    for writer in writers:
        writer.flush()
    table = manager._backend.client.table(manager.table_name)
    assert table.step_capacity > 64 + 1  # it grew
    loader = manager.torch_dataset(BATCH, transitions=True).data_loader(
        num_workers=1, multiprocessing_context="spawn"
    )
    batches = iter(loader)
    assert check_written(next(batches), {0, 1})
    assert table.step_capacity == 64 * 2  # whole windows once shared
    scratch = Path(manager._backend._scratch_dir(manager.table_name))
    assert all(".grow." not in p.name for p in scratch.iterdir())
    write(writers[0], 2, 70)  # wraps the ring: only episode 2 is held
    deadline = time.monotonic() + 30
    while check_written(next(batches), {0, 1, 2}) != {2}:
        assert time.monotonic() < deadline, "the spawned worker never saw the new items only"


def test_the_table_keeps_working_after_sharing(make, tmp_path) -> None:
    """The shared ring keeps keys, order and the items; the manager samples, exports and
    checkpoints it as before."""
    manager = make(capacity=8, sequence_length=2)
    writer = manager.transition_writer()
    write(writer, 0, 6)
    before = next(iter(manager.torch_batches(256, with_info=True)))
    manager.torch_dataset(BATCH).data_loader(num_workers=1)  # shares the table
    after = next(iter(manager.torch_batches(256, with_info=True)))
    assert set(after[1].key.tolist()) == set(before[1].key.tolist())
    write(writer, 1, 10)  # evicts: 8 items of episode 1 remain
    manager.checkpoint()
    states = next(iter(manager.torch_batches(512, transitions=True))).states.numpy()
    assert set(states[:, 0].tolist()) == {1.0}
    assert set(states[:, 1].tolist()) == set(range(2, 10))


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(sampler="prioritized"),
        SamplingConfig(sampler="fifo"),
        SamplingConfig(max_times_sampled=2),
    ],
)
def test_workers_refuse_sampling_that_changes_the_table(make, sampling) -> None:
    manager = make(sampling=sampling)
    with pytest.raises(ConfigError, match="worker processes sample a local table read-only"):
        manager.torch_dataset(BATCH).data_loader(num_workers=2)
    # num_workers=0 still works in-process.
    write(manager.transition_writer(), 0, 20)
    loader = manager.torch_dataset(2).data_loader(num_workers=0)
    assert next(iter(loader)).observation.shape == (2, 2, 4)


def test_a_hand_built_loader_says_what_to_do(make) -> None:
    manager = make()
    write(manager.transition_writer(), 0, 5)
    loader = torch.utils.data.DataLoader(
        manager.torch_dataset(BATCH), batch_size=None, num_workers=1
    )
    with pytest.raises(ConfigError, match=r"data_loader\(num_workers=N\)"):
        next(iter(loader))


@pytest.mark.heavy
def test_closing_the_manager_stops_the_workers(make) -> None:
    manager = make()
    write(manager.transition_writer(), 0, 5)
    batches = iter(manager.torch_dataset(BATCH).data_loader(num_workers=1, prefetch_factor=1))
    next(batches)
    manager.close()
    with pytest.raises(Exception, match="was closed"):
        for _ in range(10):
            next(batches)

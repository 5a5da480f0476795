"""The local backend's step ring: every step stored once, windows read back exactly, eviction,
seeded sampling.

Imports no TensorFlow, TF-Agents or Reverb (also runs under Python 3.12): specs come from
gymnasium spaces, items are read back through `export` and torch batches.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gymnasium import spaces
from safetensors.numpy import load_file

from replay_service import (
    ConfigError,
    ReplayBufferManager,
    SamplingConfig,
    TableConfig,
    Timeouts,
)
from replay_service.backends.local.client import LocalClient
from replay_service.backends.local.table import LocalTable

pytestmark = pytest.mark.local

FAST = Timeouts(connect=5.0, write=10.0, sample=1.0, checkpoint=60.0)
OBSERVATION = spaces.Box(-1000.0, 1000.0, (4,), np.float32)
ACTION = spaces.Discrete(2)
NEXT = np.array([0, 1, 0, 0], np.float32)


@pytest.fixture()
def make(tmp_path) -> Iterator[Callable[..., ReplayBufferManager]]:
    """Local managers of a Box(4)/Discrete(2) spec; every one is closed at teardown."""
    made: list[ReplayBufferManager] = []

    def factory(name: str = "ckpt", **options: Any) -> ReplayBufferManager:
        options.setdefault("capacity", 1000)
        options.setdefault("timeouts", FAST)
        manager = ReplayBufferManager.from_spaces(
            OBSERVATION, ACTION, checkpoint_dir=str(tmp_path / name), backend="local", **options
        )
        made.append(manager)
        return manager

    yield factory
    for manager in made:
        manager.close()


def transition(writer: Any, episode: int, index: int, done: bool) -> None:
    """Transition `index` of `episode`: state `[episode, index, 0, 0]`."""
    state = np.array([episode, index, 0, 0], np.float32)
    writer.add(state, [index % 2], float(index), state + NEXT, done)


def exported(manager: ReplayBufferManager, directory: Path) -> dict[str, np.ndarray]:
    state_path, _ = manager.export(directory)
    return load_file(state_path)


def unpadded_windows(steps: int, length: int, stride: int) -> list[tuple[int, int]]:
    """`(first, last)` step of each window the writers cut from an episode of `steps` steps."""
    windows, since = [], 0
    for index in range(steps):
        since += 1
        if index >= length - 1 and since >= stride:
            since = 0
            windows.append((index - length + 1, index))
    return windows


def padded_windows(steps: int, length: int, stride: int) -> list[tuple[int, int]]:
    """`(first, valid steps)` of each padded window of an episode of `steps` steps."""
    last = max(0, -(-(steps - length) // stride)) * stride
    return [(start, min(length, steps - start)) for start in range(0, last + 1, stride)]


def interleave(manager: ReplayBufferManager, episodes: dict[int, list[int]]) -> None:
    """Writes each writer's episodes (`writer id -> episode lengths in transitions`) through
    one transition writer per writer id, the writers taking turns step by step."""
    writers = {w: manager.transition_writer() for w in episodes}
    plans = {
        w: [(w * 100 + e, i, i == n - 1) for e, n in enumerate(lengths) for i in range(n)]
        for w, lengths in episodes.items()
    }
    turn = 0
    while any(plans.values()):
        for w, plan in plans.items():
            for _ in range(1 + (turn + w) % 3):  # uneven turns
                if plan:
                    transition(writers[w], *plan.pop(0))
        turn += 1
    for writer in writers.values():
        writer.flush()


# ------------------------------------------------------------------------------ memory


FIELDS = [
    {"path": "observation", "dtype": "float32", "shape": [4]},
    {"path": "action", "dtype": "int64", "shape": []},
    {"path": "reward", "dtype": "float32", "shape": []},
    {"path": "discount", "dtype": "float32", "shape": []},
    {"path": "step_type", "dtype": "int32", "shape": []},
    {"path": "next_step_type", "dtype": "int32", "shape": []},
]
RAW_STEP = 16 + 8 + 4 + 4 + 4 + 4


@pytest.mark.parametrize("length", [2, 20])
def test_memory_per_stored_step_does_not_grow_with_the_sequence_length(length):
    capacity = 2000
    table = LocalTable(TableConfig("t", capacity, length), FIELDS)
    writer = LocalClient({"t": table}).window_writer([("t", length, 1, 1.0, False)])
    for step in range(3 * capacity):
        writer.append(
            [np.full(4, step, np.float32), *(np.zeros((), f["dtype"]) for f in FIELDS[1:])]
        )
        if step % 500 == 499:
            writer.end_episode()
    assert table.size == capacity
    assert table.nbytes <= 1.5 * RAW_STEP * capacity, (table.nbytes, RAW_STEP * capacity)
    data, _, _ = table.items()
    first = data[0][:, :, 0]
    np.testing.assert_array_equal(
        first - first[:, :1], np.broadcast_to(np.arange(length), first.shape)
    )


def metadata_bytes(table: LocalTable) -> int:
    """Bytes of every numpy array a table keeps besides its step ring (`nbytes` counts that
    ring, with its per-step `_gap` and `_refs`): per-item arrays, its slots', its sum tree's."""
    owners = [vars(table)[name] for name in ("_slots", "_tree") if vars(table).get(name)]
    owners.append(table)
    return sum(
        value.nbytes
        for owner in owners
        for name, value in vars(owner).items()
        if isinstance(value, np.ndarray) and name not in ("_gap", "_refs")
    )


def test_a_restored_table_keeps_a_step_in_as_few_bytes_as_the_table_it_was_saved_from():
    """A checkpoint's items, restored (more than a byte's worth of them, in one insert), take
    the bytes per step their writer's table took: one more than the raw step."""
    capacity, length = 600, 2
    table = LocalTable(TableConfig("t", capacity, length), FIELDS)
    writer = LocalClient({"t": table}).window_writer([("t", length, 1, 1.0, False)])
    for step in range(capacity + length - 1):
        writer.append(
            [np.full(4, step, np.float32), *(np.zeros((), f["dtype"]) for f in FIELDS[1:])]
        )
    restored = LocalTable(TableConfig("t", capacity, length), FIELDS)
    restored.restore(*table.items())
    assert restored.size == table.size == capacity
    for each in (table, restored):
        assert each.nbytes == each.step_capacity * (RAW_STEP + 1), each.nbytes
    for saved, loaded in zip(table.items()[0], restored.items()[0], strict=True):
        np.testing.assert_array_equal(loaded, saved)


@pytest.mark.parametrize("length", [2, 20])
def test_a_full_uniform_table_with_its_item_metadata_holds_a_step_in_1_5x_its_bytes(length):
    """Memory per stored step, everything counted: the ring, per-step and per-item arrays
    (episodes of 200 steps, as the benchmark writes; one item per step but the first
    `length - 1` of each episode)."""
    capacity = 4000
    table = LocalTable(TableConfig("t", capacity, length), FIELDS)
    writer = LocalClient({"t": table}).window_writer([("t", length, 1, 1.0, False)])
    steps = 0
    while table.size < capacity:
        writer.append(
            [np.full(4, steps, np.float32), *(np.zeros((), f["dtype"]) for f in FIELDS[1:])]
        )
        steps += 1
        if steps % 200 == 0:
            writer.end_episode()
    stored = steps  # nothing was evicted yet: every step written is stored
    total = table.nbytes + metadata_bytes(table)
    assert total <= 1.5 * RAW_STEP * stored, (total / stored, RAW_STEP)


# ----------------------------------------------------------------------- windows read back


@pytest.mark.parametrize("length, stride", [(2, 1), (5, 1), (5, 2), (3, 4)])
def test_interleaved_writers_windows_read_back_exactly(make, tmp_path, length, stride):
    manager = make(sequence_length=length, stride_length=stride)
    manager.create_replay_buffer()
    episodes = {0: [7, 3, 12], 1: [1, 9], 2: [15]}
    interleave(manager, episodes)
    tensors = exported(manager, tmp_path / "export")
    observation = tensors["data/observation"]
    got = sorted(
        (int(o[0, 0]), int(o[0, 1]), int(o[-1, 1])) for o in observation
    )  # (episode, first step, last step)
    want = sorted(
        (w * 100 + e, first, last)
        for w, lengths in episodes.items()
        for e, n in enumerate(lengths)
        for first, last in unpadded_windows(n + 1, length, stride)
    )
    assert got == want
    # Every step of every item is that episode's step, in order, with its own fields.
    np.testing.assert_array_equal(observation[:, :, 0] - observation[:, :1, 0], 0)
    np.testing.assert_array_equal(
        observation[:, :, 1] - observation[:, :1, 1],
        np.broadcast_to(np.arange(length), observation.shape[:2]),
    )
    index = observation[:, :, 1].astype(np.int64)
    last = np.array(
        [[episodes[int(e) // 100][int(e) % 100] for e in row] for row in observation[:, :, 0]]
    )
    np.testing.assert_array_equal(tensors["data/reward"], np.where(index < last, index, 0))
    np.testing.assert_array_equal(
        tensors["data/action"][..., 0], np.where(index < last, index % 2, 0)
    )
    # The same items through torch batches of a FIFO queue, oldest first.
    batches = sorted(
        (int(o[0, 0]), int(o[0, 1]), int(o[-1, 1]))
        for o in next(iter(manager.torch_batches(len(observation)))).observation.numpy()
    )
    assert set(batches) <= set(want)


@pytest.mark.parametrize("vector", [False, True], ids=["writers", "vector_env"])
def test_transitions_of_interleaved_writers_read_each_items_own_next_state(make, vector):
    manager = make(capacity=60)
    manager.create_replay_buffer()
    # 70 transitions into 60 slots: the oldest are evicted, the ring wraps.
    if vector:  # every item scattered: 5 envs' steps take turns
        writer = manager.transition_writer()
        for index in range(14):
            states = np.array([[env, index, 0, 0] for env in range(5)], np.float32)
            writer.add_multi(
                states,
                np.full(5, index % 2),
                np.full(5, float(index)),
                states + NEXT,
                np.zeros(5, bool),
            )
        writer.flush()
    else:  # some items scattered: writers take uneven turns
        interleave(manager, {0: [7, 3, 12], 1: [1, 9, 4], 2: [15, 19]})
    stream = manager.torch_batches(512, transitions=True)
    table = stream._source.table
    assert table._scattered > 0 and (table._scattered == table.size) == vector
    for _ in range(3):
        batch = next(stream)
        states, next_states = batch.states.numpy(), batch.next_states.numpy()
        # Each transition's next state is its own step's, whoever wrote in between.
        np.testing.assert_array_equal(next_states, states + NEXT)
        np.testing.assert_array_equal(batch.rewards.numpy(), states[:, 1])
        np.testing.assert_array_equal(batch.actions.numpy()[:, 0], states[:, 1] % 2)
    stream.close()


def test_padded_windows_of_interleaved_writers_read_back_exactly(make, tmp_path):
    length, stride = 4, 2
    manager = make(sequence_length=length, stride_length=stride, pad_end_of_episode=True)
    manager.create_replay_buffer()
    episodes = {0: [6, 2], 1: [9], 2: [1, 4]}
    interleave(manager, episodes)
    tensors = exported(manager, tmp_path / "export")
    observation, mask = tensors["data/step/observation"], tensors["data/mask"]
    got = []
    for o, m in zip(observation, mask, strict=True):
        valid = int(m.sum())
        np.testing.assert_array_equal(m, np.arange(length) < valid)  # padding at the end only
        np.testing.assert_array_equal(o[valid:], 0)
        np.testing.assert_array_equal(o[:valid, 1], o[0, 1] + np.arange(valid))
        np.testing.assert_array_equal(o[:valid, 0], o[0, 0])
        got.append((int(o[0, 0]), int(o[0, 1]), valid))
    want = [
        (w * 100 + e, first, valid)
        for w, lengths in episodes.items()
        for e, n in enumerate(lengths)
        for first, valid in padded_windows(n + 1, length, stride)
    ]
    assert sorted(got) == sorted(want)


def test_items_whose_steps_are_overwritten_are_evicted_oldest_first(make, tmp_path):
    capacity, length = 10, 3
    manager = make(capacity=capacity, sequence_length=length)
    manager.create_replay_buffer()
    writer = manager.transition_writer()
    for i in range(60):
        transition(writer, 1, i, False)
    writer.flush()
    observation = exported(manager, tmp_path / "export")["data/observation"]
    # Steps 0..59 were appended: the newest `capacity` windows, oldest first, end at 59.
    np.testing.assert_array_equal(observation[:, 0, 1], np.arange(48, 58))
    np.testing.assert_array_equal(
        observation[:, :, 1] - observation[:, :1, 1],
        np.broadcast_to(np.arange(length), observation.shape[:2]),
    )
    assert manager.num_frames() == capacity


def test_windows_stay_exact_after_removals_and_a_clear(make, tmp_path):
    manager = make(capacity=8, sequence_length=3, sampling=SamplingConfig(max_times_sampled=1))
    manager.create_replay_buffer()
    writer = manager.transition_writer()
    stream = iter(manager.torch_batches(1))
    sampled = []
    for i in range(40):
        transition(writer, 2, i, False)
        if i % 3 == 0 and manager.num_frames():
            sampled.append(next(stream).observation.numpy()[0])
        if i == 20:
            manager.clear()
    writer.flush()
    items = list(exported(manager, tmp_path / "export")["data/observation"]) + sampled
    assert items
    for o in items:
        np.testing.assert_array_equal(o[:, 1], o[0, 1] + np.arange(3))
        np.testing.assert_array_equal(o[:, 0], 2)


@pytest.mark.parametrize(
    "capacity, episodes",
    [(50, {0: [20], 1: [5, 5]}), (30, {0: [20], 1: [15, 12], 2: [3, 9]})],
    ids=["part-full", "full"],
)
def test_insert_of_independent_items_round_trips_through_a_checkpoint(
    make, tmp_path, capacity, episodes
):
    manager = make(capacity=capacity, sequence_length=4)
    manager.create_replay_buffer()
    interleave(manager, episodes)
    before = exported(manager, tmp_path / "before")
    manager.checkpoint()
    manager.close()
    restored = make(capacity=capacity, sequence_length=4)
    restored.load_replay_buffer()
    after = exported(restored, tmp_path / "after")
    assert sorted(before) == sorted(after)
    for name, array in before.items():
        np.testing.assert_array_equal(after[name], array, err_msg=name)


# --------------------------------------------------------------------------------- seeds


def _samples(manager: ReplayBufferManager) -> list[np.ndarray]:
    writer = manager.transition_writer()
    for i in range(200):
        transition(writer, 3, i, i % 50 == 49)
    writer.flush()
    stream = iter(manager.torch_batches(32))
    return [next(stream).observation.numpy() for _ in range(4)]


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_the_same_seed_samples_the_same_items_and_another_seed_others(make, sampler):
    runs = {}
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        manager = make(name, seed=seed, sampling=SamplingConfig(sampler=sampler))
        manager.create_replay_buffer()
        runs[name] = _samples(manager)
    for x, y in zip(runs["a"], runs["b"], strict=True):
        np.testing.assert_array_equal(x, y)
    assert any(not np.array_equal(x, y) for x, y in zip(runs["a"], runs["c"], strict=True))


@pytest.mark.parametrize("seed", [-1, 1.5, "7", True])
def test_a_seed_that_is_not_an_integer_from_zero_is_a_config_error(make, seed):
    with pytest.raises(ConfigError, match="seed"):
        make(seed=seed)


def test_reverb_refuses_a_seed_naming_the_local_backend(tmp_path):
    pytest.importorskip("reverb")
    with pytest.raises(ConfigError, match=r"seed=7.*backend='local'"):
        ReplayBufferManager.from_spaces(
            OBSERVATION, ACTION, capacity=10, checkpoint_dir=str(tmp_path), backend="reverb", seed=7
        )
    assert not any(tmp_path.iterdir())  # refused before anything was written


@pytest.mark.parametrize("seed", [20, 35, 65])
def test_a_memory_mapped_table_of_interleaved_writers_holds_its_newest_windows(tmp_path, seed):
    """Three writers append to one table in a random order (seeded): the table holds the newest
    `capacity` windows, oldest first, each exact."""
    rnd = random.Random(seed)
    length, capacity = rnd.randint(2, 4), rnd.randint(2, 5)
    table = LocalTable(
        TableConfig("t", capacity, length),
        [{"path": "step", "dtype": "int64", "shape": []}],
        storage="memmap",
        scratch_dir=str(tmp_path / "memmap"),
    )
    streams = [table.stream() for _ in range(3)]
    steps: list[list[int]] = [[], [], []]
    since = [0, 0, 0]
    windows = []
    for value in range(1, 61):
        writer = rnd.randrange(3)
        steps[writer].append(value)
        since[writer] += 1
        if len(steps[writer]) >= length:
            window = steps[writer][-length:]
            table.insert_window(
                [[np.int64(v)] for v in window], 1.0, streams[writer], since[writer]
            )
            since[writer] = 0
            windows.append(window)
    data, _, _ = table.items()
    assert data[0].tolist() == windows[-capacity:]


# -------------------------------------------------------------------------------- keys


@pytest.mark.parametrize(
    "sampler, max_times_sampled",
    [("prioritized", 0), ("uniform", 0), ("fifo", 1), ("prioritized", 3)],
)
def test_update_priorities_ignores_keys_that_name_no_item_it_handed_out(sampler, max_times_sampled):
    """A key the table never handed out (a key of another table, one mangled on its way, e.g.
    through a float32 tensor) updates nothing, even where it names a held item's insertion
    number with another slot: only the items' own keys set their priorities."""
    capacity = 10
    table = LocalTable(
        TableConfig(
            "t",
            capacity,
            1,
            sampling=SamplingConfig(sampler=sampler, max_times_sampled=max_times_sampled),
        ),
        [{"path": "step", "dtype": "int64", "shape": []}],
    )
    keys = table.insert([np.arange(14, dtype=np.int64).reshape(14, 1)], np.ones(14))
    held = [int(k) for k in keys[-capacity:]]
    handed = {int(k) for k in keys}
    # Every number below the next key that is not a key handed out: among them, for each held
    # item, the keys of its insertion number with every other slot.
    never = [k for k in range(1, held[-1] + capacity) if k not in handed]
    assert table.update_priorities(dict.fromkeys(never, 9.0)) == 0
    _, priorities, _ = table.items()
    np.testing.assert_array_equal(priorities, np.ones(capacity))
    assert table.update_priorities({held[3]: 4.0}) == 1
    _, priorities, _ = table.items()
    np.testing.assert_array_equal(priorities, [1.0] * 3 + [4.0] + [1.0] * 6)


@pytest.mark.parametrize(
    "sampling",
    [SamplingConfig(), SamplingConfig(sampler="prioritized", max_times_sampled=2)],
    ids=["ring", "list"],
)
def test_an_empty_buffers_export_imports_as_an_empty_buffer(make, tmp_path, sampling):
    empty = make("empty", sampling=sampling)
    empty.create_replay_buffer()
    empty.export(tmp_path / "export")
    manager = make("imported", sampling=sampling)
    manager.import_buffer(tmp_path / "export")
    assert manager.num_frames() == 0
    interleave(manager, {0: [3]})
    assert manager.num_frames() == 3

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


def _vm_flags(address: int) -> list[str]:
    """The `VmFlags` of the mapping of this process holding `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds address {address:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc")
def test_a_ring_reserved_in_anonymous_memory_asks_for_huge_pages():
    """Samples read steps at random places of the ring: each column of a ring reserved for its
    largest size asks for transparent huge pages (`madvise`, VmFlags "hg"), as numpy's own
    large arrays do, so a read of a large ring does not also miss the TLB."""
    table = LocalTable(TableConfig("t", 100_000, 2), FIELDS)
    writer = LocalClient({"t": table}).window_writer([("t", 2, 1, 1.0, False)])
    for step in range(3):
        writer.append(
            [np.full(4, step, np.float32), *(np.zeros((), f["dtype"]) for f in FIELDS[1:])]
        )
    assert table._reserved is not None  # the ring grows inside its reservation
    for column in table._columns:
        assert "hg" in _vm_flags(column.ctypes.data), column.dtype


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


# ------------------------------------------------------------------- memory-mapped files


PIXELS = spaces.Box(0, 255, (8, 8), np.uint8)
STACKED = spaces.Box(0, 255, (4, 8, 8), np.uint8)


@pytest.fixture()
def make_pixels(tmp_path) -> Iterator[Callable[..., ReplayBufferManager]]:
    """Local managers of 8x8 uint8 frames (`frame_stack=4`: stacks of 4), Discrete(2)
    actions; every one is closed at teardown."""
    made: list[ReplayBufferManager] = []

    def factory(name: str, frame_stack: int | None, **options: Any) -> ReplayBufferManager:
        if frame_stack:
            options["frame_stack"] = frame_stack
        manager = ReplayBufferManager.from_spaces(
            STACKED if frame_stack else PIXELS,
            ACTION,
            checkpoint_dir=str(tmp_path / name),
            backend="local",
            timeouts=FAST,
            seed=0,
            **options,
        )
        made.append(manager)
        return manager

    yield factory
    for manager in made:
        manager.close()


class PixelWriter:
    """One env's transitions through a transition writer: frame `n` of writer `w` is all
    `(w * 100 + n) % 251 + 1`; a stack holds the 4 newest frames, its episode's first one
    repeated at the start (`padding_type="reset"`). Every pair written is kept (`pairs`)."""

    def __init__(self, manager: ReplayBufferManager, writer_id: int, stacked: bool) -> None:
        self.writer = manager.transition_writer()
        self.id, self.stacked, self.frame = writer_id, stacked, 0
        self.frames: list[np.ndarray] = []
        self.state = self._reset()
        self.pairs: set[tuple[bytes, bytes]] = set()

    def _next_frame(self) -> np.ndarray:
        self.frame += 1
        return np.full((8, 8), (self.id * 100 + self.frame) % 251 + 1, np.uint8)

    def _reset(self) -> np.ndarray:
        first = self._next_frame()
        self.frames = [first] * 4
        return np.stack(self.frames) if self.stacked else first

    def add(self, done: bool) -> None:
        frame = self._next_frame()
        self.frames = [*self.frames[1:], frame]
        following = np.stack(self.frames) if self.stacked else frame
        self.writer.add(self.state, [self.frame % 2], float(self.frame), following, done)
        self.pairs.add((self.state.tobytes(), following.tobytes()))
        self.state = self._reset() if done else following


def memmap_files(manager: ReplayBufferManager) -> dict[str, int]:
    """Size of each file of the manager's table's memory-mapped directory, by name."""
    directory = Path(manager._backend._scratch_dir(manager.table_name))
    return {p.name: p.stat().st_size for p in directory.iterdir()}


def local_table(manager: ReplayBufferManager) -> LocalTable:
    return manager._backend.client.table(manager.table_name)


def read_pairs(manager: ReplayBufferManager, batch_size: int) -> set[tuple[bytes, bytes]]:
    batch = next(iter(manager.torch_batches(batch_size, transitions=True)))
    return {
        (s.numpy().tobytes(), n.numpy().tobytes())
        for s, n in zip(batch.states, batch.next_states, strict=True)
    }


@pytest.mark.heavy
@pytest.mark.parametrize("frame_stack", [None, 4], ids=["transitions", "frame_stack"])
def test_a_memory_mapped_table_stores_each_step_once_as_memory_does(make_pixels, frame_stack):
    """One env's transitions past the capacity: the memory-mapped files hold the steps the RAM
    ring holds, `capacity + span - 1`, each step once (its newest frame, stacked), not a
    window per item."""
    capacity = 50
    span = 2 + (frame_stack - 1 if frame_stack else 0)
    tables = {}
    for storage in ("memory", "memmap"):
        manager = make_pixels(storage, frame_stack, capacity=capacity, storage=storage)
        manager.create_replay_buffer()
        env = PixelWriter(manager, 0, bool(frame_stack))
        for _ in range(capacity + 30):
            env.add(False)
        env.writer.flush()
        assert manager.num_frames() == capacity
        assert read_pairs(manager, 64) <= env.pairs
        tables[storage] = manager
    memory, memmap = (local_table(tables[s]) for s in ("memory", "memmap"))
    assert memmap.step_capacity == memory.step_capacity == capacity + span - 1
    files = memmap_files(tables["memmap"])
    assert sum(files.values()) == memory.step_capacity * memmap.step_bytes
    assert memmap.nbytes == memory.nbytes
    for saved, mapped in zip(memory.items()[0], memmap.items()[0], strict=True):
        np.testing.assert_array_equal(mapped, saved)


@pytest.mark.heavy
@pytest.mark.parametrize("frame_stack", [None, 4], ids=["transitions", "frame_stack"])
@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_interleaved_writers_past_a_memory_mapped_tables_capacity_read_back_exactly(
    make_pixels, frame_stack, sampler
):
    """Two envs taking uneven turns, past the capacity, their episodes ending apart: the
    memory-mapped ring grows into new files as the RAM ring grows, and every item sampled,
    exported and restored from a checkpoint is a transition that was written."""
    capacity = 60
    options = dict(capacity=capacity, sampling=SamplingConfig(sampler=sampler))
    rings = {}
    for storage in ("memory", "memmap"):
        manager = make_pixels(storage, frame_stack, storage=storage, **options)
        manager.create_replay_buffer()
        envs = [PixelWriter(manager, w, bool(frame_stack)) for w in range(2)]
        for turn in range(200):
            for w, env in enumerate(envs):
                for _ in range(1 + (turn + w) % 3):
                    env.add(done=env.frame % (17 + 6 * w) == 0)
        for env in envs:
            env.writer.flush()
        written = envs[0].pairs | envs[1].pairs
        assert manager.num_frames() == capacity
        for _ in range(3):
            assert read_pairs(manager, 128) <= written
        rings[storage] = manager
    memory, memmap = (local_table(rings[s]) for s in ("memory", "memmap"))
    # The same ring as in RAM, grown past its first size, in files of that size only.
    assert memmap.step_capacity == memory.step_capacity > capacity + 1 + (frame_stack or 1) - 1
    files = memmap_files(rings["memmap"])
    assert all(".grow." not in name for name in files), files
    assert sum(files.values()) == memmap.step_capacity * memmap.step_bytes
    held = memmap.items()
    for saved, mapped in zip(memory.items()[0], held[0], strict=True):
        np.testing.assert_array_equal(mapped, saved)
    rings["memmap"].checkpoint()
    rings["memmap"].close()
    loaded = make_pixels("memmap", frame_stack, storage="memmap", **options)
    loaded.load_replay_buffer()
    for saved, restored in zip(held[0], local_table(loaded).items()[0], strict=True):
        np.testing.assert_array_equal(restored, saved)
    assert read_pairs(loaded, 128) <= written


def test_a_memory_mapped_ring_whose_files_cannot_grow_evicts_and_refuses_what_cannot_fit(
    tmp_path, monkeypatch, caplog
):
    """Files that cannot grow (the disk is full): a writer's windows evict the oldest items
    instead, with a warning, and read back exactly; an insert of more steps than the ring
    holds is refused whole with a `ConfigError`, nothing evicted; once the ring has been
    written round, it grows again."""
    from replay_service.backends.local import ring

    capacity, length = 6, 2
    table = LocalTable(
        TableConfig("t", capacity, length),
        [{"path": "step", "dtype": "int64", "shape": []}],
        storage="memmap",
        scratch_dir=str(tmp_path / "memmap"),
    )
    reserve = ring.reserve_files

    def full(files: Any, what: str, fields: Any) -> None:
        raise ConfigError(f"cannot reserve bytes on disk for {what}: the disk is full")

    monkeypatch.setattr(ring, "reserve_files", full)
    streams = [table.stream() for _ in range(2)]
    last = [-1, -2]  # each writer's last step
    windows = []
    value = 0
    for turn in range(6):  # two writers' interleaved steps: more than capacity + 1 held
        for writer, stream in enumerate(streams):
            value += 1
            window = [last[writer], value]
            table.insert_window([[np.int64(v)] for v in window], 1.0, stream, 1 if turn else None)
            last[writer] = value
            windows.append(window)
    assert "memory-mapped step ring cannot grow" in caplog.text
    assert table.step_capacity == capacity + length - 1
    data, _, _ = table.items()
    assert 0 < table.size < capacity
    assert data[0].tolist() == windows[-table.size :]
    before = data[0].tolist()
    apart = np.arange(2 * capacity, dtype=np.int64).reshape(capacity, length) * 10
    with pytest.raises(ConfigError, match="cannot grow.*Nothing was inserted"):
        table.insert([apart], np.ones(capacity))
    assert table.items()[0][0].tolist() == before
    assert not [p.name for p in (tmp_path / "memmap").iterdir() if ".grow." in p.name]
    monkeypatch.setattr(ring, "reserve_files", reserve)
    table.insert([apart], np.ones(capacity))  # the disk has room again: the ring grows
    assert table.items()[0][0].tolist() == apart.tolist()
    assert table.step_capacity >= capacity * length
    assert sorted(p.name for p in (tmp_path / "memmap").iterdir()) == ["field0.memmap"]


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

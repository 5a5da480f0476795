"""The local backend on its own: spaces, storage, the checkpoint protocol under faults, limits.

Imports no TensorFlow, TF-Agents or Reverb (this file also runs under Python 3.12, where they
do not install): specs come from gymnasium spaces, items are read back through `export` and
torch batches.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tree
from gymnasium import spaces
from safetensors.numpy import load_file

from conftest import wait_for
from replay_service import (
    BufferStateError,
    CheckpointError,
    CheckpointExistsError,
    ConfigError,
    ManagerClosedError,
    NoCheckpointError,
    ReplayBufferManager,
    SamplingConfig,
    SpecMismatchError,
    TableConfig,
    Timeouts,
)
from replay_service.backends.local import sampling as local_sampling

pytestmark = pytest.mark.local

FAST = Timeouts(connect=5.0, write=10.0, sample=1.0, checkpoint=60.0)
OBSERVATION = spaces.Box(-1000.0, 1000.0, (4,), np.float32)
ACTION = spaces.Discrete(2)
CHECKPOINTS = "checkpoints"
CORRUPT = "corrupt"
BLOCK = 4096
# TF-Agents step types.
FIRST, MID, LAST = 0, 1, 2
NEXT = np.array([0, 1, 0, 0], np.float32)


@pytest.fixture()
def make(tmp_path) -> Iterator[Callable[..., ReplayBufferManager]]:
    """Local managers of a Box(4)/Discrete(2) spec; every one is closed at teardown."""
    made: list[ReplayBufferManager] = []

    def factory(
        root: str | Path | None = None,
        observation_space: Any = OBSERVATION,
        action_space: Any = ACTION,
        **options: Any,
    ) -> ReplayBufferManager:
        options.setdefault("capacity", 100)
        options.setdefault("timeouts", FAST)
        manager = ReplayBufferManager.from_spaces(
            observation_space,
            action_space,
            checkpoint_dir=str(root or tmp_path / "ckpt"),
            backend="local",
            **options,
        )
        made.append(manager)
        return manager

    yield factory
    for manager in made:
        manager.close()


def write_episode(manager: ReplayBufferManager, episode: int, length: int) -> None:
    """One terminated episode of `length` transitions; state i is `[episode, i, 0, 0]`."""
    writer = manager.transition_writer()
    for i in range(length):
        state = np.array([episode, i, 0, 0], np.float32)
        writer.add(state, [i % 2], float(i), state + NEXT, i == length - 1)
    writer.flush()


def exported(manager: ReplayBufferManager, directory: Path) -> dict[str, np.ndarray]:
    state_path, _ = manager.export(directory)
    return load_file(state_path)


def first_states(manager: ReplayBufferManager, directory: Path) -> list[tuple[int, int]]:
    """`(episode, index)` of the first step of every item, oldest first."""
    observation = exported(manager, directory)["data/observation"]
    return [(int(o[0, 0]), int(o[0, 1])) for o in observation]


def checkpoint_names(root: Path) -> list[str]:
    path = root / CHECKPOINTS
    return sorted(p.name for p in path.iterdir()) if path.exists() else []


def recorded_items(checkpoint: Path) -> int:
    metadata = next(checkpoint.glob("*checkpoint.json"))
    return int(json.loads(metadata.read_text())["num_items"])


# ----------------------------------------------------------------------------- spaces

SPACES = {
    "box": (spaces.Box(-1.0, 1.0, (3,), np.float32), spaces.Box(-1.0, 1.0, (2,), np.float32)),
    "discrete": (spaces.Discrete(5), spaces.Discrete(3)),
    "multidiscrete": (spaces.MultiDiscrete([3, 4]), spaces.MultiDiscrete([2, 5])),
    "multibinary": (spaces.MultiBinary(4), spaces.MultiBinary(3)),
    "dict": (
        spaces.Dict({"pos": spaces.Box(-1.0, 1.0, (2,), np.float32), "id": spaces.Discrete(4)}),
        spaces.Discrete(2),
    ),
    "tuple": (
        spaces.Tuple((spaces.Box(-1.0, 1.0, (2,), np.float32), spaces.Discrete(3))),
        spaces.Box(-1.0, 1.0, (1,), np.float32),
    ),
}


def _fit(value: Any, spec: Any) -> Any:
    """`value` (a sample of a space) in the shape and dtype of its spec."""

    def leaf(v: Any, s: Any) -> np.ndarray:
        dtype = np.dtype(getattr(s.dtype, "as_numpy_dtype", s.dtype))
        return np.asarray(v).reshape(tuple(s.shape)).astype(dtype)

    return tree.map_structure(leaf, value, spec)


def _same(sampled: Any, written: Any) -> None:
    for s, w in zip(tree.flatten(sampled), tree.flatten(written), strict=True):
        np.testing.assert_array_equal(np.asarray(s), w)


@pytest.mark.parametrize("kind", list(SPACES))
def test_spaces_round_trip_through_add_and_torch_batches(make, kind):
    observation_space, action_space = SPACES[kind]
    try:
        manager = make(observation_space=observation_space, action_space=action_space)
    except ConfigError as e:
        if "supports Box and Discrete" in str(e):
            pytest.skip(f"from_spaces does not take {kind} spaces yet (TF-free specs work): {e}")
        raise
    manager.create_replay_buffer()
    spec = manager.data_spec
    observation_space.seed(1)
    action_space.seed(2)
    writer = manager.transition_writer()
    written = []
    state = _fit(observation_space.sample(), spec.observation)
    for i in range(12):
        action = _fit(action_space.sample(), spec.action)
        next_state = _fit(observation_space.sample(), spec.observation)
        writer.add(state, action, float(i), next_state, i == 11)
        written.append((state, action, next_state))
        state = next_state
    assert manager.num_frames() == 12
    seen = set()
    with manager.torch_batches(16, transitions=True) as stream:
        for _ in range(20):
            batch = next(stream)
            for b, reward in enumerate(batch.rewards.tolist()):
                state, action, next_state = written[int(reward)]
                pick = lambda x, b=b: x[b]  # noqa: E731
                _same(tree.map_structure(pick, batch.states), state)
                _same(tree.map_structure(pick, batch.actions), action)
                _same(tree.map_structure(pick, batch.next_states), next_state)
                seen.add(int(reward))
            if len(seen) == 12:
                break
    assert seen == set(range(12))


# ---------------------------------------------------------------------------- storage


def test_memmap_storage_keeps_its_files_under_the_checkpoint_dir(make, tmp_path):
    root = tmp_path / "mm"
    manager = make(root, storage="memmap")
    manager.create_replay_buffer()
    write_episode(manager, 0, 7)
    files = [Path(d) / f for d, _, fs in os.walk(root / ".memmap") for f in fs]
    assert files, "no memory-mapped file under <checkpoint_dir>/.memmap"
    assert manager.num_frames() == 7
    batch = next(iter(manager.torch_batches(4, transitions=True)))
    np.testing.assert_array_equal(batch.states[:, 0].numpy(), 0)
    assert first_states(manager, tmp_path / "export") == [(0, i) for i in range(7)]
    manager.checkpoint()
    manager.close()

    loaded = make(root, storage="memmap")
    loaded.load_replay_buffer()
    assert first_states(loaded, tmp_path / "export2") == [(0, i) for i in range(7)]


# ---------------------------------------------------------------- checkpoint protocol


def _flip(pattern: str, fraction: float = 0.5) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        target = next(path.glob(pattern))
        data = bytearray(target.read_bytes())
        data[min(len(data) - 1, int(len(data) * fraction))] ^= 0x01
        target.write_bytes(bytes(data))

    return damage


def _truncate(pattern: str, fraction: float = 0.5) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        target = next(path.glob(pattern))
        data = target.read_bytes()
        target.write_bytes(data[: int(len(data) * fraction)])

    return damage


def _delete(pattern: str) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        next(path.glob(pattern)).unlink()

    return damage


DAMAGE = {
    "state byte flipped": _flip("*.state.safetensors"),
    "state header byte flipped": _flip("*.state.safetensors", 0.01),
    "state truncated": _truncate("*.state.safetensors"),
    "state short by 1 byte": _truncate("*.state.safetensors", 0.9999),
    "table metadata truncated": _truncate("table*.metadata.json"),
    "index deleted": _delete("local_checkpoint.json"),
    "DONE deleted": _delete("DONE"),
}


def two_checkpoints(make: Callable[..., ReplayBufferManager], root: Path) -> None:
    """ckpt-1 holds episode 0 (3 items), ckpt-2 also episode 1 (7 items in all)."""
    manager = make(root)
    manager.create_replay_buffer()
    write_episode(manager, 0, 3)
    manager.checkpoint()
    write_episode(manager, 1, 4)
    manager.checkpoint()
    manager.close()
    assert checkpoint_names(root) == ["ckpt-00000001", "ckpt-00000002"]


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_newest_checkpoint_is_moved_aside_and_the_previous_one_restores(
    make, tmp_path, caplog, damage
):
    root = tmp_path / "ckpt"
    two_checkpoints(make, root)
    DAMAGE[damage](root / CHECKPOINTS / "ckpt-00000002")

    with caplog.at_level(logging.WARNING):
        manager = make(root)
        manager.load_replay_buffer()
    warnings = " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert "ckpt-00000002" in warnings and "ckpt-00000001" in warnings, warnings
    moved = [p.name for p in (root / CORRUPT).iterdir()]
    assert len(moved) == 1 and moved[0].startswith("ckpt-00000002-"), moved
    assert checkpoint_names(root) == ["ckpt-00000001"]
    assert first_states(manager, tmp_path / "export") == [(0, 0), (0, 1), (0, 2)]

    # Checkpoints go on after the one moved aside.
    path = Path(manager.checkpoint())
    assert recorded_items(path) == 3
    manager.close()
    again = make(root)
    again.load_replay_buffer()
    assert again.num_frames() == 3


def test_all_checkpoints_damaged_raise_no_checkpoint_naming_them(make, tmp_path):
    root = tmp_path / "ckpt"
    two_checkpoints(make, root)
    for name in checkpoint_names(root):
        _flip("*.state.safetensors")(root / CHECKPOINTS / name)
    with pytest.raises(NoCheckpointError) as raised:
        make(root).load_replay_buffer()
    message = str(raised.value)
    assert "ckpt-00000001" in message and "ckpt-00000002" in message, message
    assert len(list((root / CORRUPT).iterdir())) == 2
    # The damaged data is never silently replaced by an empty buffer.
    with pytest.raises(CheckpointExistsError):
        make(root).create_replay_buffer()
    assert len(list((root / CORRUPT).iterdir())) == 2
    fresh = make(root)
    fresh.create_replay_buffer(overwrite=True)
    assert fresh.num_frames() == 0


def test_keep_checkpoints_retains_the_newest_two(make, tmp_path):
    root = tmp_path / "ckpt"
    manager = make(root, keep_checkpoints=2)
    manager.create_replay_buffer()
    for episode in range(4):
        write_episode(manager, episode, 2)
        manager.checkpoint()
    assert checkpoint_names(root) == ["ckpt-00000003", "ckpt-00000004"]
    assert recorded_items(root / CHECKPOINTS / "ckpt-00000004") == 8
    manager.close()
    loaded = make(root, keep_checkpoints=2)
    loaded.load_replay_buffer()
    assert loaded.num_frames() == 8


def test_a_directory_in_use_is_refused(make, tmp_path):
    root = tmp_path / "ckpt"
    first = make(root)
    first.create_replay_buffer()
    write_episode(first, 0, 2)
    first.checkpoint()
    with pytest.raises(CheckpointError, match="in use"):
        make(root).load_replay_buffer()
    with pytest.raises(CheckpointError, match="in use"):
        make(root).create_replay_buffer(overwrite=True)
    assert first.num_frames() == 2
    first.close()
    second = make(root)
    second.load_replay_buffer()
    assert second.num_frames() == 2


def test_a_missing_directory_has_no_checkpoint(make, tmp_path):
    with pytest.raises(NoCheckpointError):
        make(tmp_path / "missing").load_replay_buffer()
    assert not (tmp_path / "missing" / CHECKPOINTS).exists()


def test_a_foreign_directory_is_refused_and_left_alone(make, tmp_path):
    root = tmp_path / "theirs"
    root.mkdir()
    (root / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError) as raised:
        make(root).create_replay_buffer(overwrite=True)
    assert not isinstance(raised.value, NoCheckpointError)
    with pytest.raises(CheckpointError):
        make(root).load_replay_buffer()
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt"]
    assert (root / "notes.txt").read_text() == "mine"


def test_loading_with_another_spec_is_a_spec_mismatch(make, tmp_path):
    root = tmp_path / "ckpt"
    manager = make(root)
    manager.create_replay_buffer()
    write_episode(manager, 0, 2)
    manager.checkpoint()
    manager.close()
    wider = spaces.Box(-1.0, 1.0, (5,), np.float32)
    with pytest.raises(SpecMismatchError, match="observation"):
        make(root, observation_space=wider).load_replay_buffer()
    with pytest.raises(SpecMismatchError, match="sequence_length"):
        make(root, sequence_length=3).load_replay_buffer()
    # The refused loads changed nothing.
    again = make(root)
    again.load_replay_buffer()
    assert again.num_frames() == 2


class Tmpfs:
    """A small tmpfs with a ballast file that sets its free space."""

    def __init__(self, mount_point: Path) -> None:
        self.path = mount_point
        self.ballast = mount_point / "ballast"

    def free(self) -> int:
        stats = os.statvfs(self.path)
        return stats.f_bavail * stats.f_frsize

    def leave_free(self, free: int) -> None:
        self.release()
        to_fill = self.free() - free
        with open(self.ballast, "wb") as f, contextlib.suppress(OSError):
            while to_fill > 0:
                size = min(64 * BLOCK, to_fill)
                f.write(b"\0" * size)
                f.flush()
                to_fill -= size
        assert self.free() <= free + BLOCK, "the ballast did not fill the tmpfs"

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.ballast.unlink()


@pytest.fixture()
def tmpfs(tmp_path) -> Iterator[Tmpfs]:
    """A 1 MiB tmpfs (skips where mounting is not allowed); unmounted at teardown."""
    point = tmp_path / "tmpfs"
    point.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(point)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        pytest.skip(
            "a full disk needs a small tmpfs, and mount was refused here "
            f"({result.stderr.strip() or result.returncode}); run as root to cover it"
        )
    yield Tmpfs(point)
    if subprocess.run(["umount", str(point)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def test_a_checkpoint_on_a_full_disk_fails_cleanly_and_succeeds_once_space_is_back(
    make, tmpfs, tmp_path
):
    big = spaces.Box(-1000.0, 1000.0, (64,), np.float32)

    def fill(manager: ReplayBufferManager, count: int) -> None:
        writer = manager.transition_writer()
        for i in range(count):
            state = np.full(64, i, np.float32)
            writer.add(state, [0], 1.0, state + 1, i == count - 1)

    # The size of a checkpoint of the full buffer, measured on a normal disk.
    reference = make(tmp_path / "reference", observation_space=big)
    reference.create_replay_buffer()
    fill(reference, 100)
    full = Path(reference.checkpoint())
    full_blocks = sum(-(-p.stat().st_size // BLOCK) for p in full.iterdir() if p.is_file())
    reference.close()
    assert full_blocks >= 8

    root = tmpfs.path / "ckpt"
    manager = make(root, observation_space=big, keep_checkpoints=1)
    manager.create_replay_buffer()
    fill(manager, 10)
    good = Path(manager.checkpoint())
    good_files = sorted(p.name for p in good.iterdir())
    fill(manager, 100)
    assert manager.num_frames() == 100

    for blocks in [0, 1, 2, full_blocks // 2, full_blocks - 2]:
        tmpfs.leave_free(blocks * BLOCK)
        with pytest.raises(CheckpointError) as raised:
            manager.checkpoint()
        assert str(root) in str(raised.value), raised.value
        assert checkpoint_names(root) == [good.name], f"{blocks} free blocks: {raised.value}"
        assert sorted(p.name for p in good.iterdir()) == good_files
        staging = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(".reverb")]
        assert all(not any(s.iterdir()) for s in staging), "a failed checkpoint left files"
        assert manager.num_frames() == 100, "the buffer lost items"

    tmpfs.release()
    path = Path(manager.checkpoint())
    assert recorded_items(path) == 100
    assert checkpoint_names(root) == [path.name]
    manager.close()
    loaded = make(root, observation_space=big)
    loaded.load_replay_buffer()
    assert loaded.num_frames() == 100


BIG = spaces.Box(-1000.0, 1000.0, (64,), np.float32)
MEMMAP_CAPACITY = 400  # 224 KB of memory-mapped files (a closed manager keeps its mapping)


def memmap_files(root: Path) -> dict[str, int]:
    """Size of every file under `<root>/.memmap`, by path relative to it."""
    memmap = root / ".memmap"
    return {
        str(Path(d, f).relative_to(memmap)): Path(d, f).stat().st_size
        for d, _, fs in os.walk(memmap)
        for f in fs
    }


def test_memmap_storage_on_a_full_disk_is_a_config_error_before_any_item(make, tmpfs):
    root = tmpfs.path / "ckpt"
    options = dict(observation_space=BIG, storage="memmap", capacity=MEMMAP_CAPACITY)
    tmpfs.leave_free(16 * BLOCK)
    manager = make(root, **options)
    with pytest.raises(ConfigError, match="cannot reserve") as raised:
        manager.create_replay_buffer()
    message = str(raised.value)
    needed = int(message.split("cannot reserve ")[1].split(" bytes")[0])
    assert str(root / ".memmap") in message and "field" in message, message
    assert not memmap_files(root), "a refused table left memory-mapped files"

    tmpfs.release()
    manager = make(root, **options)
    manager.create_replay_buffer()
    sizes = memmap_files(root)
    assert sum(sizes.values()) == needed, (sizes, message)
    writer = manager.transition_writer()
    for i in range(5):
        writer.add(np.full(64, i, np.float32), [0], 1.0, np.full(64, i + 1, np.float32), i == 4)
    writer.flush()
    manager.checkpoint()
    manager.close()

    # Restoring onto a full disk: the same error, and the checkpoint is not taken for damaged.
    saved = checkpoint_names(root)
    tmpfs.leave_free(16 * BLOCK)
    with pytest.raises(ConfigError, match=f"cannot reserve {needed} bytes"):
        make(root, **options).load_replay_buffer()
    assert checkpoint_names(root) == saved
    assert not (root / CORRUPT).exists() or not any((root / CORRUPT).iterdir())
    tmpfs.release()
    loaded = make(root, **options)
    loaded.load_replay_buffer()
    assert loaded.num_frames() == 5


def test_memmap_storage_larger_than_the_free_space_takes_no_block_of_it(make, tmpfs, monkeypatch):
    """A reservation that fails part way holds the disk full meanwhile, for every other writer
    on it (a checkpoint of another buffer there fails then): storage that cannot fit is refused
    before any block is reserved."""
    root = tmpfs.path / "ckpt"
    tmpfs.leave_free(16 * BLOCK)
    reserved: list[int] = []
    allocate = os.posix_fallocate
    monkeypatch.setattr(
        os, "posix_fallocate", lambda fd, at, size: (reserved.append(size), allocate(fd, at, size))
    )
    manager = make(root, observation_space=BIG, storage="memmap", capacity=MEMMAP_CAPACITY)
    with pytest.raises(ConfigError, match="cannot reserve .* need more than is free") as raised:
        manager.create_replay_buffer()
    assert reserved == [], "blocks were reserved for storage that cannot fit"
    assert "field0.memmap" in str(raised.value)
    assert not memmap_files(root), "a refused table left memory-mapped files"


def test_a_memmap_load_whose_ring_cannot_grow_is_a_config_error_keeping_the_checkpoint(make, tmpfs):
    """Interleaved writers' items are restored each window whole (`capacity * 2` steps): on a
    disk that holds the table's first files but not the grown ones the load is refused with a
    `ConfigError`, the checkpoint is not taken for damaged, nothing is left in `.memmap`, and
    it loads once the disk has room."""
    root = tmpfs.path / "ckpt"
    options = dict(observation_space=BIG, storage="memmap", capacity=MEMMAP_CAPACITY)
    manager = make(root, **options)
    manager.create_replay_buffer()
    writers = [manager.transition_writer() for _ in range(2)]
    for i in range(MEMMAP_CAPACITY // 2 + 10):
        for w, writer in enumerate(writers):
            state = np.full(64, 1000 * w + i, np.float32)
            writer.add(state, [0], 1.0, state + 1, False)
    for writer in writers:
        writer.flush()
    path = Path(manager.checkpoint())
    saved = checkpoint_names(root)
    manager.close()
    assert not memmap_files(root)

    first = (MEMMAP_CAPACITY + 1) * 280  # the first files: `capacity + 1` steps of 280 bytes
    tmpfs.leave_free(first + 16 * BLOCK)
    loading = make(root, **options)
    with pytest.raises(ConfigError, match="cannot grow.*Nothing was inserted"):
        loading.load_replay_buffer()
    loading.close()
    assert checkpoint_names(root) == saved
    assert not (root / CORRUPT).exists() or not any((root / CORRUPT).iterdir())
    assert not memmap_files(root), "a refused load left memory-mapped files"
    tmpfs.release()
    loaded = make(root, **options)
    loaded.load_replay_buffer()
    assert loaded.num_frames() == recorded_items(path) == MEMMAP_CAPACITY


FILL_THE_DISK_THEN_WRITE = """
import os, sys
import numpy as np
from gymnasium import spaces
from replay_service import ReplayBufferManager, Timeouts

root, ballast, capacity = sys.argv[1], sys.argv[2], int(sys.argv[3])
manager = ReplayBufferManager.from_spaces(
    spaces.Box(-1000.0, 1000.0, (64,), np.float32), spaces.Discrete(2), checkpoint_dir=root,
    backend="local", storage="memmap", capacity=capacity,
    timeouts=Timeouts(connect=5.0, write=10.0, sample=1.0, checkpoint=60.0),
)
manager.create_replay_buffer()
writer = manager.transition_writer()


def write(first, count):
    for i in range(first, first + count):
        state = np.full(64, i, np.float32)
        writer.add(state, [i % 2], 1.0, state + 1, i % 10 == 9)
    writer.flush()


def check():
    batch = next(iter(manager.torch_batches(256, transitions=True)))
    states, following = batch.states.numpy(), batch.next_states.numpy()
    assert (states == states[:, :1]).all() and (following == states + 1).all(), "a wrong item"
    print("items", manager.num_frames(), "batch", tuple(batch.states.shape), flush=True)


write(0, 10)  # the first items are in: the storage exists
fd = os.open(ballast, os.O_WRONLY | os.O_CREAT, 0o600)
for size in (65536, 4096, 1):  # every free byte of the disk
    try:
        while True:
            os.write(fd, bytes(size))
    except OSError:
        pass
os.close(fd)
stats = os.statvfs(root)
print("free after filling", stats.f_bavail * stats.f_frsize, flush=True)
# Every slot written, the oldest ones twice: episodes of 10 transitions take 11 steps, more
# than the ring's `capacity + 1`, which cannot grow on the full disk.
write(10, capacity + 50)
check()
os.unlink(ballast)
write(capacity + 60, 2 * capacity)  # the ring grows again once written round
check()
manager.close()
"""


@pytest.mark.heavy
def test_memmap_storage_survives_the_disk_filling_after_the_table_was_created(tmpfs):
    """Files reserved, no write through the mapping can SIGBUS; a ring that must grow on the
    full disk logs a warning and evicts its oldest items instead (every item read back is one
    written), and grows to hold its capacity again once the disk has room."""
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            FILL_THE_DISK_THEN_WRITE,
            str(tmpfs.path / "ckpt"),
            str(tmpfs.ballast),
            str(MEMMAP_CAPACITY),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode >= 0, f"killed by signal {-result.returncode}: {output}"
    assert result.returncode == 0, output
    assert "free after filling 0" in output, output
    held = [int(line.split()[1]) for line in result.stdout.splitlines() if line[:5] == "items"]
    assert len(held) == 2 and 0.8 * MEMMAP_CAPACITY < held[0] < MEMMAP_CAPACITY, output
    assert held[1] == MEMMAP_CAPACITY, output
    assert "memory-mapped step ring cannot grow" in result.stderr, output
    assert "batch (256, 64)" in output, output


def test_periodic_checkpoints_run_in_the_background(make, tmp_path):
    root = tmp_path / "ckpt"
    manager = make(root, checkpoint_interval_s=0.2)
    manager.create_replay_buffer()
    write_episode(manager, 0, 5)
    written_at = checkpoint_names(root)[-1:]

    def newer_with_items() -> bool:
        names = checkpoint_names(root)
        return (
            bool(names)
            and names[-1:] != written_at
            and recorded_items(root / CHECKPOINTS / names[-1]) == 5
        )

    wait_for(newer_with_items, 10, "a periodic checkpoint holding the 5 items")
    manager.close()
    loaded = make(root)
    loaded.load_replay_buffer()
    assert first_states(loaded, tmp_path / "export") == [(0, i) for i in range(5)]


# --------------------------------------------------------------- Reverb-only features


REVERB_ONLY = {
    "lifo sampler": ({"sampling": SamplingConfig(sampler="lifo")}, "lifo"),
    "heap sampler": ({"sampling": SamplingConfig(sampler="max_heap")}, "max_heap"),
    "uniform remover": ({"sampling": SamplingConfig(remover="uniform")}, "remover"),
    "samples_per_insert": (
        {"sampling": SamplingConfig(samples_per_insert=2.0, min_size_to_sample=10)},
        "samples_per_insert",
    ),
    "server_address": ({"server_address": "localhost:1", "checkpoint_dir": None}, "remote"),
    "port": ({"port": 12345}, "port"),
}


@pytest.mark.parametrize("option", list(REVERB_ONLY))
def test_reverb_only_options_are_refused_naming_the_way_out(tmp_path, option):
    kwargs, named = REVERB_ONLY[option]
    kwargs = {"checkpoint_dir": str(tmp_path / "ckpt"), **kwargs}
    with pytest.raises(ConfigError) as raised:
        ReplayBufferManager.from_spaces(
            OBSERVATION, ACTION, capacity=10, backend="local", timeouts=FAST, **kwargs
        )
    message = str(raised.value)
    assert named in message and "reverb" in message.lower(), message
    assert not (tmp_path / "ckpt").exists(), "a refused manager touched the disk"


def test_reverb_only_calls_are_refused_naming_the_way_out(make):
    extra = TableConfig(name="other", capacity=10, sequence_length=2)
    manager = make(extra_tables=(extra,))
    manager.create_replay_buffer()
    calls = {
        "mixed_dataset": lambda: manager.mixed_dataset(4, {manager.table_name: 1, "other": 1}),
        "train_schedule": lambda: manager.train_schedule(4),
        "table_handle": lambda: manager.table_handle(),
        "num_steps": lambda: manager.get_dataset(4, num_steps=3),
    }
    for name, call in calls.items():
        with pytest.raises(ConfigError, match="backend='reverb'") as raised:
            call()
        assert name.split("_")[0] in str(raised.value), (name, raised.value)


# --------------------------------------------------------------------------- sampling


@pytest.mark.heavy
def test_sampling_below_min_size_fails_within_the_sample_timeout(make):
    timeouts = Timeouts(connect=5.0, write=10.0, sample=0.5, checkpoint=60.0)
    manager = make(timeouts=timeouts, sampling=SamplingConfig(min_size_to_sample=5))
    manager.create_replay_buffer()
    write_episode(manager, 0, 2)
    stream = manager.torch_batches(1)
    started = time.monotonic()
    with pytest.raises(BufferStateError, match="min_size_to_sample=5"):
        next(stream)
    elapsed = time.monotonic() - started
    assert 0.4 <= elapsed < 3.0, elapsed
    write_episode(manager, 1, 3)
    assert tuple(next(manager.torch_batches(1)).observation.shape) == (1, 2, 4)


def test_sampling_after_close_raises_manager_closed(make):
    manager = make()
    manager.create_replay_buffer()
    write_episode(manager, 0, 3)
    stream = manager.torch_batches(2)
    next(stream)
    manager.close()
    with pytest.raises(ManagerClosedError):
        next(stream)
    with pytest.raises(ManagerClosedError):
        manager.torch_batches(2)


def test_a_sampler_waiting_on_an_empty_table_fails_when_the_manager_closes(make):
    slow = Timeouts(connect=5.0, write=10.0, sample=30.0, checkpoint=60.0)
    manager = make(timeouts=slow)
    manager.create_replay_buffer()
    stream = manager.torch_batches(2)
    raised: list[BaseException] = []

    def sample() -> None:
        try:
            next(stream)
        except BaseException as e:
            raised.append(e)

    thread = threading.Thread(target=sample)
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive(), "sampling an empty table did not wait"
    started = time.monotonic()
    manager.close()
    thread.join(timeout=5)
    assert not thread.is_alive() and time.monotonic() - started < 5
    assert len(raised) == 1 and isinstance(raised[0], ManagerClosedError), raised


# ---------------------------------------------------------------------------- windows


def test_an_episode_of_five_steps_gives_three_windows_of_three(make, tmp_path):
    manager = make(sequence_length=3)
    manager.create_replay_buffer()
    write_episode(manager, 7, 4)  # 4 transitions: steps 0..3 and the boundary step 4
    tensors = exported(manager, tmp_path / "export")
    np.testing.assert_array_equal(
        tensors["data/observation"][:, :, 1], [[0, 1, 2], [1, 2, 3], [2, 3, 4]]
    )
    np.testing.assert_array_equal(tensors["data/observation"][:, :, 0], 7)
    np.testing.assert_array_equal(
        tensors["data/step_type"], [[FIRST, MID, MID], [MID, MID, MID], [MID, MID, LAST]]
    )
    np.testing.assert_array_equal(
        tensors["data/next_step_type"], [[MID, MID, MID], [MID, MID, LAST], [MID, LAST, FIRST]]
    )
    np.testing.assert_array_equal(tensors["data/reward"][:, :3], [[0, 1, 2], [1, 2, 3], [2, 3, 0]])
    np.testing.assert_array_equal(tensors["data/discount"][2], [1, 0, 1])
    # Actions alternate 0, 1; the boundary step's action is zeros.
    np.testing.assert_array_equal(tensors["data/action"][..., 0], [[0, 1, 0], [1, 0, 1], [0, 1, 0]])
    np.testing.assert_array_equal(tensors["priorities"], 1.0)


# ------------------------------------------------------------------- without the Reverb stack


def _reverb_imports() -> bool:
    from replay_service.backends import reverb_importable

    return reverb_importable()[0]


def test_auto_picks_local_where_reverb_does_not_import_and_reverb_only_names_say_so(
    tmp_path, caplog
) -> None:
    if _reverb_imports():
        pytest.skip("the Reverb stack imports here (Python 3.11 on Linux x86_64)")
    import replay_service

    with caplog.at_level(logging.WARNING):
        manager = ReplayBufferManager.from_spaces(
            OBSERVATION, ACTION, capacity=10, checkpoint_dir=tmp_path / "auto"
        )
    assert manager.backend == "local"
    with pytest.raises(ConfigError, match="backend='reverb'.*do not import here"):
        ReplayBufferManager.from_spaces(
            OBSERVATION, ACTION, capacity=10, checkpoint_dir=tmp_path / "r", backend="reverb"
        )
    with pytest.raises(ImportError, match="ShardedReplayBuffer needs dm-reverb.*backend='local'"):
        replay_service.ShardedReplayBuffer  # noqa: B018
    with manager:
        manager.create_replay_buffer()
        with pytest.raises(ConfigError, match="needs TensorFlow"):
            manager.get_dataset(4)
    result = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "replay-server")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "replay-server needs dm-reverb" in result.stderr


def test_a_gymnasium_vector_env_with_discrete_actions_fills_and_restores(tmp_path) -> None:
    import gymnasium

    envs = gymnasium.make_vec("CartPole-v1", num_envs=3)
    kwargs = {"capacity": 5_000, "checkpoint_dir": tmp_path / "vec", "backend": "local"}
    manager = ReplayBufferManager.from_spaces(
        envs.single_observation_space, envs.single_action_space, **kwargs
    )
    with manager:
        manager.create_replay_buffer()
        writer = manager.gym_vector_writer(envs)
        observations, _ = envs.reset(seed=0)
        envs.action_space.seed(0)
        writer.reset(observations)
        resets = 0
        ended = np.zeros(3, bool)
        for _ in range(60):
            actions = envs.action_space.sample()  # int64 [3]: one scalar per env
            resets += int(ended.sum())  # NEXT_STEP autoreset: these steps are not transitions
            observations, rewards, terminated, truncated, infos = envs.step(actions)
            writer.add(actions, observations, rewards, terminated, truncated, infos)
            ended = terminated | truncated
        items = manager.num_frames()
        # Reset steps are never stored; an open episode's last transition may wait for the
        # step that follows it.
        assert 60 * 3 - resets - 3 <= items <= 60 * 3 - resets
        batch = next(iter(manager.torch_batches(16, transitions=True)))
        assert batch.actions.shape == (16, 1)
        assert set(batch.actions.flatten().tolist()) <= {0, 1}
        manager.checkpoint()
    envs.close()
    with ReplayBufferManager.from_spaces(
        envs.single_observation_space, envs.single_action_space, **kwargs
    ) as restored:
        restored.load_replay_buffer()
        assert restored.num_frames() == items


def drawn_together(batch_size: int) -> int:
    """Batches of `batch_size` CartPole transitions a local stream draws per table call."""
    return min(local_sampling.DRAW_BATCHES, local_sampling.DRAW_ITEMS // batch_size)


def test_batches_without_info_count_every_draw(make, tmp_path):
    manager = make()
    manager.create_replay_buffer()
    write_episode(manager, 0, 1)  # one item: every draw of every batch is that item
    draws = drawn_together(256)
    assert draws > 3
    with manager.torch_batches(256, transitions=True, prefetch=0) as stream:
        for _ in range(3):
            next(stream)
    # Counted as drawn: the batches drawn ahead too, as a Reverb server counts prefetched ones.
    drawn = 256 * draws
    assert exported(manager, tmp_path / "export")["times_sampled"].tolist() == [drawn]
    with manager.torch_batches(256, transitions=True, with_info=True, prefetch=0) as stream:
        _, info = next(stream)
    assert info.times_sampled.tolist() == [2 * drawn] * 256


@pytest.mark.parametrize(
    ("sampler", "draws"),
    [("uniform", drawn_together(64)), ("prioritized", 1)],
    ids=["uniform", "prioritized"],
)
def test_small_uniform_batches_are_drawn_together(make, tmp_path, sampler, draws):
    drawn = 64 * draws
    manager = make(sampling=SamplingConfig(sampler=sampler))
    manager.create_replay_buffer()
    write_episode(manager, 0, 1)
    with manager.torch_batches(64, with_info=True, prefetch=0) as stream:
        batch, info = next(stream)
        assert tuple(batch.observation.shape) == (64, 2, 4)
        assert tuple(info.key.shape) == (64,)
        assert exported(manager, tmp_path / "first")["times_sampled"].tolist() == [drawn]
        write_episode(manager, 1, 1)  # a drawn uniform batch does not see it; the next draw does
        episodes = set()
        for _ in range(draws + 8):
            batch, info = next(stream)
            episodes.update(batch.observation[:, 0, 0].tolist())
            size = int(info.table_size[0])
            assert info.table_size.tolist() == [size] * 64 and size in (1, 2)
        assert episodes == {0.0, 1.0}
        manager.close()
        with pytest.raises(ManagerClosedError):
            next(stream)


def test_transitions_read_from_single_steps_match_the_written_ones(make):
    """Transitions are read step by step from the ring (`Packer.steps`), interleaved writers'
    items too: each is the written transition, flags included."""
    manager = make(capacity=400)
    manager.create_replay_buffer()
    writers = [manager.transition_writer(), manager.transition_writer()]
    lengths = {0: 30, 1: 45, 2: 20, 3: 25}
    truncated_episodes = {1, 2}
    # Writer 0 writes episodes 0 then 2, writer 1 episodes 1 then 3; they take turns by step.
    steps = [
        [(episode, i) for episode in (w, w + 2) for i in range(lengths[episode])] for w in (0, 1)
    ]
    for turn in range(max(len(s) for s in steps)):
        for writer, own in zip(writers, steps, strict=True):
            if turn < len(own):
                episode, i = own[turn]
                state = np.array([episode, i, 0, 0], np.float32)
                end = i == lengths[episode] - 1
                writer.add(
                    state,
                    [i % 2],
                    float(i),
                    state + NEXT,
                    end and episode not in truncated_episodes,
                    end and episode in truncated_episodes,
                )
    for writer in writers:
        writer.flush()
    assert len(manager) == sum(lengths.values())
    seen = set()
    with manager.torch_batches(64, transitions=True, prefetch=0) as stream:
        for _ in range(40):
            batch = next(stream)
            states = batch.states.numpy()
            np.testing.assert_array_equal(batch.next_states.numpy(), states + NEXT)
            episode, index = states[:, 0].astype(int), states[:, 1].astype(int)
            np.testing.assert_array_equal(batch.actions.numpy()[:, 0], index % 2)
            np.testing.assert_array_equal(batch.rewards.numpy(), index)
            last = index == np.array([lengths[e] for e in episode]) - 1
            truncated = np.isin(episode, list(truncated_episodes))
            np.testing.assert_array_equal(batch.dones.numpy(), last & ~truncated)
            np.testing.assert_array_equal(batch.truncated.numpy(), last & truncated)
            assert batch.states.is_contiguous() and batch.next_states.is_contiguous()
            seen.update(zip(episode.tolist(), index.tolist(), strict=True))
    assert len(seen) > 100  # most of the 120 items came out


def test_batches_drawn_ahead_are_dropped_when_the_table_is_cleared(make):
    manager = make()
    manager.create_replay_buffer()
    write_episode(manager, 0, 1)
    with manager.torch_batches(64, prefetch=0) as stream:
        assert set(next(stream).observation[:, 0, 0].tolist()) == {0.0}
        manager.clear()  # the stream holds more batches of episode 0, now removed
        write_episode(manager, 1, 1)
        for _ in range(5):
            assert set(next(stream).observation[:, 0, 0].tolist()) == {1.0}


def test_large_items_are_drawn_one_batch_at_a_time(make, tmp_path):
    frames = spaces.Box(0, 255, (84, 84, 4), np.uint8)
    manager = make(observation_space=frames, capacity=4)
    manager.create_replay_buffer()
    writer = manager.transition_writer()
    frame = np.zeros((84, 84, 4), np.uint8)
    writer.add(frame, 0, 1.0, frame, True)
    with manager.torch_batches(64, transitions=True, prefetch=0) as stream:
        assert tuple(next(stream).states.shape) == (64, 84, 84, 4)
    assert exported(manager, tmp_path / "export")["times_sampled"].tolist() == [64]


@pytest.mark.parametrize(
    ("draws", "slots"), [(1, 5), (256, 40_000), (4096, 40_000), (4096, 50), (999, 3)]
)
def test_draw_counts_equal_numpy_add_at(draws, slots):
    """A table counts the draws of a batch as `np.add.at` would, slots drawn several times
    included."""
    from replay_service.backends.local.table import _count_draws

    rng = np.random.default_rng(draws + slots)
    counts = rng.integers(0, 9, slots).astype(np.int32)
    expected = counts.copy()
    for _ in range(5):
        drawn = rng.integers(0, slots, draws)
        _count_draws(counts, drawn)
        np.add.at(expected, drawn, 1)
        np.testing.assert_array_equal(counts, expected)


def test_a_numpy_batch_size_is_taken_and_a_transitions_flag_must_be_a_bool(make):
    manager = make()
    manager.create_replay_buffer()
    write_episode(manager, 0, 3)
    sizes = np.array([4, 8])  # a batch size read from an array or a config is np.int64
    with manager.torch_batches(sizes[0], transitions=True) as stream:
        assert tuple(next(stream).states.shape) == (4, 4)
    with pytest.raises(ConfigError, match="transitions must be True or False, got 'no'"):
        manager.torch_batches(8, transitions="no")
    with pytest.raises(ConfigError, match="batch_size must be a positive integer, got 4.0"):
        manager.torch_batches(4.0)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("options", [{}, {"compression": "lz4"}, {"storage": "memmap"}])
def test_a_writer_stores_the_values_of_add_time_when_the_caller_reuses_its_arrays(
    make, kind: str, options: dict[str, Any]
) -> None:
    # Vectorised environments and torch loops fill one observation array in place per step.
    if "compression" in options:
        pytest.importorskip("lz4", reason="the compression extra is not installed")
    manager = make(**options)
    manager.create_replay_buffer()
    writer = manager.transition_writer()
    state, next_state = np.zeros(4, np.float32), np.zeros(4, np.float32)
    if kind == "torch":
        import torch

        state, next_state = torch.zeros(4), torch.zeros(4)
    for episode in range(2):
        for i in range(5):
            state[:] = float(10 * episode + i)
            next_state[:] = float(10 * episode + i + 1)
            writer.add(state, 0, float(10 * episode + i), next_state, i == 4)
    writer.flush()
    data = manager._backend.read_items(manager.table_config).data
    observations, rewards = np.asarray(data[1]), np.asarray(data[4])
    # Each item's first step holds the state given with its reward, its second the next one.
    np.testing.assert_array_equal(observations[:, 0, 0], rewards[:, 0])
    np.testing.assert_array_equal(observations[:, 1, 0], rewards[:, 0] + 1)


def test_bfloat16_tensors_are_cast_to_the_spec_as_float64_arrays_are(make) -> None:
    # numpy has no bfloat16: such a tensor is widened to float32, then cast within its kind.
    import torch

    manager = make()
    manager.create_replay_buffer()
    writer = manager.transition_writer()
    for i in range(3):
        state = torch.full((4,), 0.5 * i, dtype=torch.bfloat16)
        writer.add(state, 0, float(i), state + 0.5, i == 2)
    data = manager._backend.read_items(manager.table_config).data
    np.testing.assert_array_equal(
        np.asarray(data[1])[:, :, 0], [[0.0, 0.5], [0.5, 1.0], [1.0, 1.5]]
    )

"""A local table that cannot move into shared memory (a small /dev/shm: Docker's default is
64 MB) for DataLoader workers: `data_loader(num_workers=N)` fails with a `ConfigError` naming the
bytes needed, the bytes free in /dev/shm and the ways out, and the table is exactly as before:
writes (wrapping the ring), torch batches, epochs, checkpoints, restores and exports still hold
every item.

The failure is torch's own, raised where torch allocates shared memory
(`Tensor.share_memory_`, which raises "unable to allocate shared memory(shm) ..." when
/dev/shm is full); tests/system/backends/local/test_small_shm.py runs the same with a real
1 MiB /dev/shm.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from gymnasium import spaces

from replay_service import ConfigError, ReplayBufferManager, Timeouts
from replay_service.backends.local import sharing

pytestmark = pytest.mark.local

FAST = Timeouts(connect=5.0, write=10.0, sample=5.0, checkpoint=60.0)
OBSERVATION = spaces.Box(-1e6, 1e6, (4,), np.float32)
ACTION = spaces.Discrete(2)
NEXT = np.array([0, 1, 0, 0], np.float32)
CAPACITY = 64
EPISODE = 20
SHM_ERROR = (
    "unable to allocate shared memory(shm) for file </torch_1_1_0>: No space left on device (28)"
)


@pytest.fixture()
def make(tmp_path) -> Iterator[Callable[..., ReplayBufferManager]]:
    """Local managers of a Box(4)/Discrete(2) spec; every one is closed at teardown."""
    made: list[ReplayBufferManager] = []

    def factory(name: str = "ckpt", *, create: bool = True, **options: Any) -> ReplayBufferManager:
        options.setdefault("capacity", CAPACITY)
        options.setdefault("timeouts", FAST)
        manager = ReplayBufferManager.from_spaces(
            OBSERVATION, ACTION, checkpoint_dir=str(tmp_path / name), backend="local", **options
        )
        made.append(manager)
        if create:
            manager.create_replay_buffer()
        return manager

    yield factory
    for manager in made:
        manager.close()


def write(writer: Any, episode: int) -> None:
    """An episode of `EPISODE` transitions, state `[episode, index, 0, 0]`."""
    for index in range(EPISODE):
        state = np.array([episode, index, 0, 0], np.float32)
        writer.add(state, [index % 2], float(index), state + NEXT, index == EPISODE - 1)


def newest(episodes: int) -> set[tuple[int, int]]:
    """The `(episode, index)` of the `CAPACITY` newest transitions of `episodes` episodes."""
    every = [(e, i) for e in range(episodes) for i in range(EPISODE)]
    return set(every[-CAPACITY:])


def ids(states: torch.Tensor) -> list[tuple[int, int]]:
    """`(episode, index)` of each transition of a batch, its next state checked."""
    array = states.numpy()
    return [(int(e), int(i)) for e, i in array[:, :2]]


def epoch_items(manager: ReplayBufferManager) -> list[tuple[int, int]]:
    """Every item of the table, once, through `epoch_batches`."""
    found: list[tuple[int, int]] = []
    for batch in manager.epoch_batches(16, transitions=True, seed=0):
        np.testing.assert_array_equal(batch.next_states.numpy(), batch.states.numpy() + NEXT)
        found += ids(batch.states)
    return found


def fail_share(monkeypatch: pytest.MonkeyPatch, at: int) -> list[int]:
    """Makes the `at`-th call of `Tensor.share_memory_` (1-based; 0: every call) raise torch's
    RuntimeError of a full /dev/shm; returns the list counting the calls."""
    calls: list[int] = []
    real = torch.Tensor.share_memory_

    def share_memory_(self: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if at == 0 or len(calls) == at:
            raise RuntimeError(SHM_ERROR)
        return real(self)

    monkeypatch.setattr(torch.Tensor, "share_memory_", share_memory_)
    return calls


def check_usable(make: Callable[..., ReplayBufferManager], manager: ReplayBufferManager, tmp_path):
    """After the failed move: writes wrap the ring, and torch batches, epochs, an export and
    its import hold every item; a checkpoint is taken (`check_restore` reads it)."""
    writer = manager.transition_writer()
    for episode in range(1, 12):  # 220 transitions into 64 slots: the ring wraps
        write(writer, episode)
    held = newest(12)
    assert manager.num_frames() == CAPACITY
    batch = next(iter(manager.torch_batches(512, transitions=True)))
    np.testing.assert_array_equal(batch.next_states.numpy(), batch.states.numpy() + NEXT)
    assert set(ids(batch.states)) <= held
    items = epoch_items(manager)
    assert sorted(items) == sorted(held)
    manager.checkpoint()
    manager.export(tmp_path / "export")
    imported = make("imported", create=False)
    imported.import_buffer(tmp_path / "export")
    assert sorted(epoch_items(imported)) == sorted(held)


def check_restore(make: Callable[..., ReplayBufferManager], manager: ReplayBufferManager) -> None:
    """Closes `manager`; its last checkpoint restores every item of `check_usable`."""
    manager.close()
    restored = make("ckpt", create=False)
    restored.load_replay_buffer()
    assert sorted(epoch_items(restored)) == sorted(newest(12))


@pytest.mark.heavy
@pytest.mark.parametrize("at", [1, 2, 0], ids=["ring", "metadata", "every"])
def test_failed_move_to_shared_memory_is_clear_and_changes_nothing(
    make, monkeypatch, tmp_path, at
) -> None:
    manager = make()
    write(manager.transition_writer(), 0)
    dataset = manager.torch_dataset(8, transitions=True)
    calls = fail_share(monkeypatch, at)
    with pytest.raises(ConfigError) as raised:
        dataset.data_loader(num_workers=1)
    assert calls, "the fault was never reached"
    message = str(raised.value)
    assert "shared memory" in message and re.search(r"/dev/shm has \d+ bytes free", message)
    needed = re.search(r"needs (\d+) bytes", message)
    assert needed and int(needed.group(1)) > CAPACITY * 2 * OBSERVATION.shape[0] * 4, message
    assert "num_workers=0" in message and "--shm-size" in message
    assert "No space left on device" in message
    monkeypatch.undo()
    check_usable(make, manager, tmp_path)
    # Shared memory is there again: the same dataset's workers sample the held items.
    loader = dataset.data_loader(num_workers=1)
    batches = iter(loader)
    for _ in range(3):
        batch = next(batches)
        assert set(ids(batch.states)) <= newest(12)
    del batches, loader
    check_restore(make, manager)


@pytest.mark.heavy
def test_too_little_free_shared_memory_is_refused_before_allocating(
    make, monkeypatch, tmp_path
) -> None:
    """/dev/shm's free bytes are read first: a table that does not fit is refused before any
    shared memory is taken."""
    manager = make()
    write(manager.transition_writer(), 0)
    real_free = sharing.free_bytes
    monkeypatch.setattr(
        sharing,
        "free_bytes",
        lambda directory: 4096 if directory == sharing.SHM_DIR else real_free(directory),
    )
    calls = fail_share(monkeypatch, 0)
    with pytest.raises(ConfigError, match=r"/dev/shm has 4096 bytes free"):
        manager.torch_dataset(8, transitions=True).data_loader(num_workers=2)
    assert not calls, "shared memory was allocated although it could not fit"
    monkeypatch.undo()
    check_usable(make, manager, tmp_path)
    check_restore(make, manager)

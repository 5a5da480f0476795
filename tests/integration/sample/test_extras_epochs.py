"""What users of the buffers this project replaces expect, on both backends.

Extra per-step fields declared with `from_spaces(extras=...)` (Velora's `hidden_dim` and
`add(..., hidden)`), `len(manager)` (Velora's `len(buffer)`), and epoch passes over the stored
items (pytorchrl's `generate_batches(num_mini_batch, mini_batch_size, num_epochs)`).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from gymnasium import spaces

from replay_service import (
    BufferStateError,
    ConfigError,
    ManagerClosedError,
    ReplayBufferManager,
    SpecMismatchError,
)

pytestmark = pytest.mark.heavy

BACKENDS = ("reverb", "local")
ACTION = spaces.Discrete(2)
HIDDEN = 8
EXTRAS = {"hidden": ((HIDDEN,), np.float32), "log_prob": ((), np.float32)}


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture()
def make(backend: str, make_from_spaces: Any) -> Callable[..., ReplayBufferManager]:
    """`from_spaces` managers of the parametrized backend (conftest's `make_from_spaces`)."""
    return functools.partial(make_from_spaces, backend)


def state(episode: int, index: int) -> np.ndarray:
    """The observation `[episode, index, 0, 0]`, unique per step."""
    return np.array([episode, index, 0, 0], np.float32)


def hidden_of(episode: int, index: int) -> np.ndarray:
    return np.full(HIDDEN, episode * 100 + index, np.float32)


def write(writer: Any, episodes: int, length: int, *, extras: bool = True) -> None:
    """`episodes` episodes of `length` transitions; each carries extras derived from its state."""
    for episode in range(episodes):
        for i in range(length):
            kwargs = {"hidden": hidden_of(episode, i), "log_prob": -float(i)} if extras else {}
            writer.add(
                state(episode, i), i % 2, 1.0, state(episode, i + 1), i == length - 1, **kwargs
            )
    writer.flush()


def first_states(batch: Any) -> list[tuple[int, int]]:
    """`(episode, index)` of each item's first step (a trajectory batch `[B, T, 4]`)."""
    rows = batch.observation[:, 0, :2].cpu().numpy().astype(int)
    return [(int(a), int(b)) for a, b in rows]


# ------------------------------------------------------------------------------------ extras


def test_extras_declared_from_spaces_are_written_and_sampled_everywhere(make):
    manager = make(extras=EXTRAS)
    assert set(manager.data_spec.policy_info) == {"hidden", "log_prob"}
    manager.create_replay_buffer()
    write(manager.transition_writer(), episodes=2, length=4)

    batch = next(iter(manager.torch_batches(16, transitions=True)))
    assert set(batch.hiddens) == {"hidden", "log_prob"}
    assert batch.hiddens["hidden"].shape == (16, HIDDEN)
    assert batch.hiddens["hidden"].dtype == torch.float32
    for row, hidden, log_prob in zip(
        batch.states.numpy(),
        batch.hiddens["hidden"].numpy(),
        batch.hiddens["log_prob"].numpy(),
        strict=True,
    ):
        episode, index = int(row[0]), int(row[1])
        np.testing.assert_array_equal(hidden, hidden_of(episode, index))
        assert log_prob == -index

    trajectory = next(iter(manager.torch_dataset(8)))
    assert trajectory.policy_info["hidden"].shape == (8, 2, HIDDEN)

    trajectories, _ = next(iter(manager.get_dataset(8)))
    first = trajectories.observation.numpy()[:, 0]
    hidden = trajectories.policy_info["hidden"].numpy()[:, 0]
    for row, values in zip(first, hidden, strict=True):
        np.testing.assert_array_equal(values, hidden_of(int(row[0]), int(row[1])))


def test_extras_take_gymnasium_spaces_and_add_multi_takes_them_as_keywords(make):
    manager = make(extras={"hidden": spaces.Box(-1, 1, (3,), np.float32), "option": ACTION})
    manager.create_replay_buffer()
    writer = manager.transition_writer()
    states = np.stack([state(0, 0), state(1, 0)])
    nexts = np.stack([state(0, 1), state(1, 1)])
    writer.add_multi(
        states,
        np.array([0, 1]),
        np.array([1.0, 1.0]),
        nexts,
        np.array([False, True]),
        final_states=nexts,
        hidden=np.ones((2, 3), np.float32),
        option=np.array([[1], [0]]),
    )
    writer.flush()
    batch = next(iter(manager.torch_batches(4, transitions=True)))
    assert batch.hiddens["option"].dtype == torch.int64
    assert batch.hiddens["option"].shape == (4, 1)
    np.testing.assert_array_equal(batch.hiddens["hidden"].numpy(), np.ones((4, 3)))


@pytest.mark.parametrize(
    "extras, match",
    [
        ({"reward": ((), np.float32)}, "'reward' clashes"),
        ({"state": ((), np.float32)}, "'state' clashes"),
        ({"policy_info": ((), np.float32)}, "'policy_info' clashes"),
        ({"log prob": ((), np.float32)}, "'log prob' must be a Python identifier"),
        ({"hidden": ((-1,), np.float32)}, r"extra 'hidden': bad spec \(\(-1,\)"),
        ({"hidden": ((4,), "str")}, "extra 'hidden': bad spec"),
        ({"hidden": (4, np.float32, 1)}, "extra 'hidden': expected a"),
        ({"hidden": np.zeros(4)}, "extra 'hidden': expected a"),
        ({"obs": spaces.Dict({"a": ACTION})}, "extra 'obs': a Dict or Tuple space"),
        ([("hidden", ((4,), np.float32))], "extras must be a dict"),
    ],
)
def test_bad_extras_are_refused_naming_the_field(make, extras, match):
    with pytest.raises(ConfigError, match=match):
        make(extras=extras)


def test_add_refuses_missing_unknown_and_misshapen_extras(make):
    manager = make(extras=EXTRAS)
    manager.create_replay_buffer()
    writer = manager.transition_writer()
    args = (state(0, 0), 0, 1.0, state(0, 1), False)
    hidden = hidden_of(0, 0)
    with pytest.raises(SpecMismatchError, match=r"extra\(s\) \['hidden', 'log_prob'\] required"):
        writer.add(*args)
    with pytest.raises(SpecMismatchError, match=r"extra\(s\) \['log_prob'\] required"):
        writer.add(*args, hidden=hidden)
    with pytest.raises(SpecMismatchError, match=r"unknown extra\(s\) \['value'\]"):
        writer.add(*args, hidden=hidden, log_prob=0.0, value=1.0)
    with pytest.raises(SpecMismatchError, match=r"'extras/hidden': expected float32\[8\], got"):
        writer.add(*args, hidden=np.zeros(3, np.float32), log_prob=0.0)
    with pytest.raises(SpecMismatchError, match=r"'extras/log_prob': expected float32\[\]"):
        writer.add(*args, hidden=hidden, log_prob=np.zeros(2, np.float32))
    with pytest.raises(SpecMismatchError, match=r"extra\(s\) \['log_prob'\] required"):
        writer.add_multi(*(np.stack([a]) for a in args), hidden=np.stack([hidden]))
    writer.flush()
    assert manager.num_frames() == 0  # nothing refused was written
    write(writer, episodes=1, length=2)
    assert manager.num_frames() == 2

    plain = make("plain")
    plain.create_replay_buffer()
    with pytest.raises(SpecMismatchError, match="the data spec declares no extras"):
        plain.transition_writer().add(*args, log_prob=0.0)


# ------------------------------------------------------------------------ sizes and ceilings

# Sizes no machine holds: a step of 4 TB, and rings of 40 TB (RAM) and 8 PB (disk).
HUGE_EXTRA = {"x": ((10**6, 10**6), np.float32)}
WIDE = spaces.Box(-1.0, 1.0, (10**4,), np.float32)
WIDER = spaces.Box(-1.0, 1.0, (10**6,), np.float32)


def test_a_huge_extra_is_refused_before_anything_is_allocated(make, tmp_path):
    with pytest.raises(ConfigError) as raised:
        make(extras=HUGE_EXTRA)
    message = str(raised.value)
    assert "one item of this data spec takes 8000000000080 bytes (7.3 TiB: 2 steps of " in message
    assert "'policy_info/x' [1000000, 1000000] float32: 4000000000000 bytes" in message
    assert re.search(r"more than the \d+ bytes \(.*\) of memory available", message)
    assert f"the capacity, 500 items, would hold {1000 * 4000000000040} bytes" in message
    assert not (tmp_path / "ckpt").exists()


def assert_no_room_on_disk(start: Callable[[], Any], scratch_root: Any) -> None:
    """`start()` refuses memory-mapped tables that the disk of `scratch_root` cannot hold."""
    with pytest.raises(ConfigError) as raised:
        start()
    message = str(raised.value)
    assert re.search(r"cannot reserve \d+ bytes \(.*\) on disk for the memory-mapped", message)
    assert f"in '{scratch_root}' (" in message and "need more than is free" in message
    assert "'observation' [1000000] float32: 4000000 bytes" in message
    assert "field0.memmap" in message


def test_local_tables_larger_than_memory_or_disk_are_refused_naming_the_field(
    make_from_spaces, tmp_path
):
    manager = make_from_spaces("local", observation=WIDE, capacity=10**9)
    with pytest.raises(ConfigError) as raised:
        manager.create_replay_buffer()
    message = str(raised.value)
    needed = int(re.search(r"need (\d+) bytes .* of memory \(storage='memory'\)", message)[1])
    assert needed >= (10**9 + 1) * 40000
    assert re.search(r"but \d+ bytes \(.*\) are available: \d+ bytes per step", message)
    assert "'observation' [10000] float32: 40000 bytes" in message
    assert "table 'uniform_table': 1000000001 steps for capacity 1000000000" in message
    assert "storage='memmap'" in message  # the way out
    assert not (tmp_path / "ckpt").exists()

    manager = make_from_spaces("local", observation=WIDER, capacity=10**9, storage="memmap")
    assert_no_room_on_disk(manager.create_replay_buffer, tmp_path / "ckpt" / ".memmap")
    # A directory that holds a buffer is refused alike when it loads, and keeps the buffer.
    small = make_from_spaces("local", observation=WIDER, capacity=4)
    small.create_replay_buffer()
    small.checkpoint()
    small.close()
    assert_no_room_on_disk(manager.load_replay_buffer, tmp_path / "ckpt" / ".memmap")
    assert os.listdir(tmp_path / "ckpt" / "checkpoints") == ["ckpt-00000001"]
    assert make_from_spaces("local", observation=WIDER, capacity=4).load_replay_buffer()

    # A data spec given to the manager itself is checked the same way.
    from replay_service.specs.nests import data_spec_for_spaces

    spec = data_spec_for_spaces(WIDE, ACTION)
    direct = ReplayBufferManager(spec, 10**9, str(tmp_path / "direct"), backend="local")
    with pytest.raises(ConfigError, match=r"'observation' \[10000\] float32: 40000 bytes"):
        direct.create_replay_buffer()
    direct.close()
    assert not (tmp_path / "direct").exists()


# --------------------------------------------------------------------------------------- len


def test_len_is_the_primary_tables_size_and_a_manager_stays_truthy(make):
    manager = make()
    assert bool(manager) is True
    with pytest.raises(BufferStateError, match="create_replay_buffer"):
        len(manager)
    manager.create_replay_buffer()
    assert len(manager) == 0 and bool(manager) is True
    write(manager.transition_writer(), episodes=2, length=3, extras=False)
    # Each episode of 3 transitions is 4 steps: 3 windows of 2 steps.
    assert len(manager) == 6 == manager.num_frames()
    manager.clear()
    assert len(manager) == 0
    manager.close()
    assert bool(manager) is True
    with pytest.raises(ManagerClosedError):
        len(manager)


# ------------------------------------------------------------------------------------ epochs


def test_epoch_batches_hold_every_item_once_per_epoch_shuffled(make):
    manager = make(extras=EXTRAS)
    manager.create_replay_buffer()
    write(manager.transition_writer(), episodes=5, length=6)  # 30 items
    stored = len(manager)
    assert stored == 30
    epochs = manager.epoch_batches(7, num_epochs=3, seed=1)
    assert len(epochs) == 3 * 5
    batches = list(epochs)
    assert len(batches) == 15
    assert [len(first_states(b)) for b in batches[:5]] == [7, 7, 7, 7, 2]
    orders = []
    for epoch in range(3):
        epoch_batches = batches[epoch * 5 : (epoch + 1) * 5]
        order = [key for batch in epoch_batches for key in first_states(batch)]
        assert sorted(order) == sorted({(e, i) for e in range(5) for i in range(6)})
        orders.append(order)
    assert len({tuple(o) for o in orders}) == 3  # each epoch a new permutation
    assert orders[0] != sorted(orders[0])  # shuffled, not insertion order
    # Extras come along with their items.
    batch = batches[0]
    for row, hidden in zip(
        batch.observation[:, 0].numpy(), batch.policy_info["hidden"][:, 0], strict=True
    ):
        np.testing.assert_array_equal(hidden.numpy(), hidden_of(int(row[0]), int(row[1])))
    # The same seed gives the same batches; the pass did not consume the table.
    again = [first_states(b) for b in manager.epoch_batches(7, num_epochs=3, seed=1)]
    assert again == [first_states(b) for b in batches]
    assert len(manager) == stored

    dropped = list(manager.epoch_batches(7, num_epochs=2, drop_last=True, transitions=True))
    assert len(dropped) == 8 and all(b.states.shape == (7, 4) for b in dropped)
    assert set(dropped[0].hiddens) == {"hidden", "log_prob"}


def test_epoch_batches_leave_the_users_checkpoints_as_they_were(make, tmp_path):
    from replay_service import CheckpointStore

    manager = make(keep_checkpoints=1)
    manager.create_replay_buffer()
    write(manager.transition_writer(), episodes=2, length=5, extras=False)
    mine = manager.checkpoint()
    store = CheckpointStore(tmp_path / "ckpt")
    before = [c.path for c in store.checkpoints()]
    assert before == [mine]
    write(manager.transition_writer(), episodes=1, length=5, extras=False)
    for _ in range(3):  # each pass reads a snapshot of all 15 items
        seen = sum(len(first_states(b)) for b in manager.epoch_batches(4, seed=0))
        assert seen == 15
    # keep_checkpoints=1 pruned nothing for the passes; the newest is still the user's.
    assert [c.path for c in store.checkpoints()] == before
    manager.close()
    again = make(keep_checkpoints=1)
    again.load_replay_buffer()
    assert len(again) == 10  # what the user's checkpoint holds


def test_epoch_batches_refuse_bad_options_and_an_empty_table(make):
    manager = make(sequence_length=3)
    with pytest.raises(BufferStateError, match="create_replay_buffer"):
        manager.epoch_batches(4)
    manager.create_replay_buffer()
    with pytest.raises(BufferStateError, match="holds no items"):
        manager.epoch_batches(4)
    write(manager.transition_writer(), episodes=1, length=4, extras=False)
    for kwargs, match in [
        ({"batch_size": 0}, "batch_size must be a positive integer, got 0"),
        ({"batch_size": 2, "num_epochs": 0}, "num_epochs must be a positive integer, got 0"),
        ({"batch_size": 2, "seed": -1}, "seed must be a non-negative integer or None, got -1"),
        ({"batch_size": 2, "drop_last": "yes"}, "drop_last must be True or False, got 'yes'"),
        ({"batch_size": 2, "table": "nope"}, "nope"),
        ({"batch_size": 2, "device": "gpu:x"}, "device must be a torch device"),
        ({"batch_size": 99, "drop_last": True}, "leaves no batch"),
        ({"batch_size": 2, "transitions": True}, "transitions=True needs sequence_length=2"),
    ]:
        with pytest.raises(ConfigError, match=match):
            manager.epoch_batches(**kwargs)

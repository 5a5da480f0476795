"""The local backend's storage on a torch device (`device=`).

Every test runs with `device="cpu"` given explicitly (the device code path: torch tensors
written and gathered by index, no numpy views) and on CUDA where it is available. A table on a
device must sample exactly what a host table samples (same seed, same inserts), return its
tensors on that device, and checkpoint and export the same host files.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gymnasium import spaces
from safetensors.numpy import load_file

from replay_service import ConfigError, ReplayBufferManager, Timeouts

pytestmark = pytest.mark.local

FAST = Timeouts(connect=5.0, write=10.0, sample=2.0, checkpoint=60.0)
OBSERVATION = spaces.Box(-1e6, 1e6, (4,), np.float32)
ACTION = spaces.Discrete(2)
NEXT = np.array([0, 1, 0, 0], np.float32)

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(), reason="CUDA is not available on this machine"
        ),
    ),
]


@pytest.fixture()
def make(tmp_path) -> Iterator[Callable[..., ReplayBufferManager]]:
    """Local managers of a Box(4)/Discrete(2) spec; every one is closed at teardown."""
    made: list[ReplayBufferManager] = []

    def factory(name: str, **options: Any) -> ReplayBufferManager:
        options.setdefault("capacity", 50)
        options.setdefault("timeouts", FAST)
        manager = ReplayBufferManager.from_spaces(
            OBSERVATION, ACTION, checkpoint_dir=str(tmp_path / name), backend="local", **options
        )
        made.append(manager)
        return manager

    yield factory
    for manager in made:
        manager.close()


def fill(manager: ReplayBufferManager, episodes: int = 6, writers: int = 3) -> None:
    """Interleaved writers (scattered windows, a growing ring), episodes of random length."""
    order = random.Random(0)
    live = [manager.transition_writer() for _ in range(writers)]
    steps = {w: 0 for w in range(writers)}
    episode = {w: w for w in range(writers)}
    while min(episode.values()) < episodes:
        w = order.randrange(writers)
        if episode[w] >= episodes:
            continue
        index = steps[w]
        state = np.array([episode[w], index, 0, 0], np.float32)
        done = order.random() < 0.1
        live[w].add(state, [index % 2], float(index), state + NEXT, done)
        steps[w] = 0 if done else index + 1
        if done:
            episode[w] += writers


def exported(manager: ReplayBufferManager, directory: Path) -> dict[str, np.ndarray]:
    state_path, _ = manager.export(directory)
    return load_file(state_path)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sequence_length", [2, 4])
def test_a_device_table_samples_what_a_host_table_samples(make, device, sequence_length):
    host = make("host", seed=5, sequence_length=sequence_length)
    placed = make("placed", seed=5, sequence_length=sequence_length, device=device)
    for manager in (host, placed):
        manager.create_replay_buffer()
        fill(manager)
    expected = torch.device(device).type
    for _, (want, want_info), (got, got_info) in zip(
        range(5),
        host.torch_batches(32, with_info=True),
        placed.torch_batches(32, with_info=True),
        strict=False,
    ):
        assert got.observation.device.type == expected
        assert got.observation.shape == (32, sequence_length, 4)
        np.testing.assert_array_equal(got.observation.cpu().numpy(), want.observation.numpy())
        np.testing.assert_array_equal(got.reward.cpu().numpy(), want.reward.numpy())
        np.testing.assert_array_equal(got_info.key.numpy(), want_info.key.numpy())
    # Transitions come back on the device too.
    batch = next(iter(placed.torch_batches(8, transitions=True))) if sequence_length == 2 else None
    if batch is not None:
        assert batch.states.device.type == expected
        np.testing.assert_array_equal(
            batch.next_states.cpu().numpy(), batch.states.cpu().numpy() + NEXT
        )


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoints_and_exports_are_the_host_files(make, tmp_path, device):
    host = make("host", seed=1, sequence_length=3)
    placed = make("placed", seed=1, sequence_length=3, device=device)
    for manager in (host, placed):
        manager.create_replay_buffer()
        fill(manager)
    want = exported(host, tmp_path / "host-export")
    got = exported(placed, tmp_path / "placed-export")
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # A checkpoint written from the device loads on the host, and back on the device.
    placed.checkpoint()
    placed.close()
    for options in ({}, {"device": device}):
        again = make("placed", seed=1, sequence_length=3, **options)
        again.load_replay_buffer()
        restored = exported(again, tmp_path / f"again-{len(options)}")
        for name in want:
            np.testing.assert_array_equal(restored[name], want[name], err_msg=name)
        again.close()


def worker_batches(manager: ReplayBufferManager) -> list[Any]:
    """Four transition batches of `manager`, filled, from a DataLoader with two workers."""
    manager.create_replay_buffer()
    fill(manager)
    loader = manager.torch_dataset(16, transitions=True).data_loader(num_workers=2)
    return [batch for _, batch in zip(range(4), loader, strict=False)]


def test_workers_sample_a_cpu_device_table(make):
    for batch in worker_batches(make("workers", device="cpu", seed=0)):
        states = batch.states.numpy()
        np.testing.assert_array_equal(batch.next_states.numpy(), states + NEXT)
        np.testing.assert_array_equal(batch.rewards.numpy(), states[:, 1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available on this machine")
@pytest.mark.parametrize("device", [None, "cpu"])
def test_workers_sample_a_host_table_after_the_learner_initialized_cuda(make, device):
    """A learner on the GPU (CUDA initialized) with a host table: the forked DataLoader workers
    must not touch CUDA (asking a tensor whether it is pinned did: "initialization error")."""
    torch.zeros(1, device="cuda")
    assert torch.cuda.is_initialized()
    for batch in worker_batches(make(f"host-workers-{device}", device=device, seed=0)):
        states = batch.states.numpy()
        np.testing.assert_array_equal(batch.next_states.numpy(), states + NEXT)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available on this machine")
def test_workers_refuse_a_cuda_table(make):
    manager = make("cuda-workers", device="cuda")
    manager.create_replay_buffer()
    with pytest.raises(ConfigError, match="lives on device 'cuda:0'"):
        manager.torch_dataset(16).data_loader(num_workers=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available on this machine")
def test_cuda_without_cuda_is_refused_at_construction(make):
    with pytest.raises(ConfigError, match="device='cuda' was asked for, but CUDA is not available"):
        make("nocuda", device="cuda")


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("meta", "storage lives on 'cpu' or a CUDA device"),
        ("garbage", "device must be a torch device such as 'cpu'"),
        (3.5, "device must be a torch device"),
    ],
)
def test_devices_that_hold_no_table_are_refused(make, device, message):
    with pytest.raises(ConfigError, match=message):
        make("bad", device=device)


def test_memmap_storage_refuses_a_device(make):
    with pytest.raises(ConfigError, match="device='cpu' needs storage='memory'"):
        make("memmap", device="cpu", storage="memmap")


def test_reverb_refuses_a_device(tmp_path):
    pytest.importorskip("reverb", reason="the Reverb stack is not installed (Python 3.12)")
    with pytest.raises(ConfigError, match=r"device='cpu'.*backend='local'"):
        ReplayBufferManager.from_spaces(
            OBSERVATION,
            ACTION,
            capacity=10,
            checkpoint_dir=str(tmp_path / "reverb"),
            backend="reverb",
            device="cpu",
        )

"""Every sampling call's batch size has a ceiling, checked before anything is allocated, and
every `device=` is checked at the call, on both backends.

A batch size above `MAX_BATCH_SIZE`, or whose batch needs more than half the available memory,
is a `ConfigError` naming the parameter, the value, the bytes needed and the ceiling; the
largest size the memory allows is accepted. Devices that hold no data ("meta") or are not on
this machine ("mps", "cuda" without CUDA) are refused naming the devices available. The buffer
samples every item afterwards.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from replay_service import ConfigError, ReplayBufferManager, TableConfig
from replay_service.config import batch_limits as sizes

pytestmark = pytest.mark.heavy

BACKENDS = ["local", "reverb"]
RECENT = "recent"
ITEMS = 40
HUGE = 10**9
# With this much memory available, batches may take half of it: a ceiling well below
# `MAX_BATCH_SIZE` items for these items (a few dozen bytes each).
AVAILABLE = 1 << 30


def state(episode: int, index: int) -> np.ndarray:
    return np.array([episode, index, 0, 0], np.float32)


@pytest.fixture()
def build(make_from_spaces) -> Callable[[str], ReplayBufferManager]:
    """Buffers of `ITEMS` transitions in their primary table and in table "recent"."""

    def factory(backend: str) -> ReplayBufferManager:
        made = make_from_spaces(
            backend,
            capacity=100,
            extra_tables=[TableConfig(name=RECENT, capacity=100, sequence_length=2)],
        )
        made.create_replay_buffer()
        writer = made.transition_writer()
        for episode in range(4):
            for i in range(10):
                writer.add(state(episode, i), i % 2, 1.0, state(episode, i + 1), i == 9)
        writer.flush()
        return made

    return factory


def weights(manager: ReplayBufferManager) -> dict[str, float]:
    return {manager.table_name: 1.0, RECENT: 1.0}


# Entry point name -> (parameter named in the error, call with a batch size). Each call only
# builds its stream or dataset (nothing is sampled).
ENTRY_POINTS: dict[str, tuple[str, Callable[[ReplayBufferManager, int], Any]]] = {
    "torch_batches": ("batch_size", lambda m, n: m.torch_batches(n)),
    "torch_batches_transitions": (
        "batch_size",
        lambda m, n: m.torch_batches(n, transitions=True, prefetch=2),
    ),
    "torch_dataset": ("batch_size", lambda m, n: m.torch_dataset(n, transitions=True)),
    "mixed_torch_batches": ("batch_size", lambda m, n: m.mixed_torch_batches(n, weights(m))),
    "get_dataset": ("batch_size", lambda m, n: m.get_dataset(n)),
    "as_dataset": (
        "sample_batch_size",
        lambda m, n: m.get_replay_buffer_and_observer()[0].as_dataset(sample_batch_size=n),
    ),
    "epoch_batches": ("batch_size", lambda m, n: m.epoch_batches(n)),
    "recent_batches": ("batch_size", lambda m, n: m.recent_batches(n, 4, c_min=10)),
    "mixed_dataset": ("batch_size", lambda m, n: m.mixed_dataset(n, weights(m))),
}
# The calls a backend has (the others are refused for the backend, whatever the size).
LOCAL_ONLY = {"recent_batches"}
REVERB_ONLY = {"mixed_dataset"}


def cases() -> list[Any]:
    found = []
    for backend in BACKENDS:
        for name in ENTRY_POINTS:
            if (backend == "local" and name in REVERB_ONLY) or (
                backend == "reverb" and name in LOCAL_ONLY
            ):
                continue
            found.append(pytest.param(backend, name, id=f"{backend}-{name}"))
    return found


def still_samples(manager: ReplayBufferManager) -> None:
    """The buffer holds and samples its items."""
    assert manager.num_frames() == ITEMS
    batch = next(iter(manager.torch_batches(64, transitions=True)))
    np.testing.assert_array_equal(batch.next_states[:, 1].numpy(), batch.states[:, 1].numpy() + 1)
    items = sorted(
        (int(a), int(b))
        for epoch in manager.epoch_batches(16, transitions=True)
        for a, b in epoch.states[:, :2].tolist()
    )
    assert items == [(e, i) for e in range(4) for i in range(10)]


def close(made: Any) -> None:
    if hasattr(made, "close"):
        made.close()


@pytest.mark.parametrize(("backend", "entry"), cases())
def test_a_huge_batch_size_is_refused_before_allocating(build, backend, entry) -> None:
    manager = build(backend)
    parameter, call = ENTRY_POINTS[entry]
    with pytest.raises(ConfigError) as raised:
        call(manager, HUGE)
    message = str(raised.value)
    assert f"{parameter}={HUGE}" in message, message
    assert f"largest batch size, {sizes.MAX_BATCH_SIZE}" in message, message
    assert re.search(r"needs \d+ bytes", message), message
    still_samples(manager)


@pytest.mark.parametrize(("backend", "entry"), cases())
def test_the_largest_batch_the_memory_allows_is_accepted_and_one_more_refused(
    build, backend, entry, monkeypatch
) -> None:
    manager = build(backend)
    parameter, call = ENTRY_POINTS[entry]
    monkeypatch.setattr(sizes, "available_memory", lambda: AVAILABLE)
    if entry == "epoch_batches":
        # A pass holds at most the table's items: any size up to the fixed ceiling fits.
        close(call(manager, sizes.MAX_BATCH_SIZE))
        with pytest.raises(ConfigError, match=f"{parameter}={sizes.MAX_BATCH_SIZE + 1} "):
            call(manager, sizes.MAX_BATCH_SIZE + 1)
        still_samples(manager)
        return
    with pytest.raises(ConfigError) as raised:
        call(manager, sizes.MAX_BATCH_SIZE)
    message = str(raised.value)
    assert f"{parameter}={sizes.MAX_BATCH_SIZE} is too large for this machine's memory" in message
    assert f"ceiling of {AVAILABLE // 2} bytes" in message and f"{AVAILABLE} bytes" in message
    largest = int(re.search(rf"use {parameter} <= (\d+)", message).group(1))
    assert sizes.SMALL_BATCH_BYTES // 100 < largest < sizes.MAX_BATCH_SIZE
    close(call(manager, largest))
    with pytest.raises(ConfigError, match=f"{parameter}={largest + 1} is too large"):
        call(manager, largest + 1)
    still_samples(manager)


DEVICE_CALLS: dict[str, Callable[[ReplayBufferManager, str], Any]] = {
    "torch_batches": lambda m, d: m.torch_batches(8, device=d),
    "mixed_torch_batches": lambda m, d: m.mixed_torch_batches(8, weights(m), device=d),
    "epoch_batches": lambda m, d: m.epoch_batches(8, device=d),
    "recent_batches": lambda m, d: m.recent_batches(8, 4, c_min=10, device=d),
}
MISSING = ["meta", "mps", "cuda:7"] + ([] if torch.cuda.is_available() else ["cuda"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("device", MISSING)
def test_devices_without_data_or_not_here_are_refused_at_the_call(build, backend, device) -> None:
    manager = build(backend)
    for name, call in DEVICE_CALLS.items():
        if name in LOCAL_ONLY and backend != "local":
            continue
        with pytest.raises(ConfigError) as raised:
            call(manager, device)
        message = str(raised.value)
        assert f"device={device!r}" in message and "available here: ['cpu'" in message, (
            name,
            message,
        )
    still_samples(manager)


@pytest.mark.local
@pytest.mark.parametrize("device", ["meta", "mps", "cuda:7"])
def test_local_storage_devices_not_here_are_refused(make_from_spaces, device) -> None:
    with pytest.raises(ConfigError, match=rf"device={device!r}.*available here: \['cpu'"):
        make_from_spaces("local", name="bad", device=device)

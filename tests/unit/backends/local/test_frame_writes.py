"""`frame_writes`: a frame-stacked local table stores each step's newest frame once with the
serials of its earlier frames, and gives back the stacks it was written, episode starts and
zero (unknown final) stacks included."""

from __future__ import annotations

import numpy as np
import pytest

from replay_service.backends.local.codecs import MEMORY_MARGIN, SLOT_OVERHEAD
from replay_service.backends.local.frame_writes import continues_previous
from replay_service.backends.local.table import LocalTable
from replay_service.config.options import TableConfig
from replay_service.errors import ConfigError
from replay_service.specs import sizes

pytestmark = pytest.mark.local

K = 3
FIELDS = [
    {"path": "observation", "dtype": "uint8", "shape": [K, 2, 2]},
    {"path": "reward", "dtype": "float32", "shape": []},
]


def stack(newest: int) -> np.ndarray:
    """The stack whose frames are filled with `newest - 2`, `newest - 1`, `newest` (clipped
    at 1: an episode starting at frame 1 repeats it, gymnasium's reset padding)."""
    return np.stack([np.full((2, 2), max(1, newest - K + 1 + i), np.uint8) for i in range(K)])


def test_windows_inserted_whole_store_one_frame_per_step_and_read_back_exactly() -> None:
    table = LocalTable(TableConfig("t", 16, 2, frame_stack=K), FIELDS, seed=0)
    assert table.frames is not None and table.frames.frame == (1, 2, 2)
    windows = np.stack([np.stack([stack(i), stack(i + 1)]) for i in range(1, 7)])
    rewards = np.arange(12, dtype=np.float32).reshape(6, 2)
    table.insert([windows, rewards], np.ones(6))
    data, _, _ = table.items()
    np.testing.assert_array_equal(data[0], windows)
    np.testing.assert_array_equal(data[1], rewards)
    # The windows share no step (their rewards differ), but each one's first stack continues
    # a step written before (the first one's is padded): 2 rows of one frame each per window.
    assert table._written == 6 * 2
    assert table.step_bytes == 2 * 2 + 4


def test_a_zero_stack_reads_back_as_zeros_and_the_next_stack_after_it_is_its_own() -> None:
    table = LocalTable(TableConfig("t", 8, 2, frame_stack=K), FIELDS, seed=0)
    zero = np.zeros_like(stack(1))
    windows = np.stack([np.stack([stack(5), zero]), np.stack([stack(1), stack(2)])])
    table.insert([windows, np.zeros((2, 2), np.float32)], np.ones(2))
    data, _, _ = table.items()
    np.testing.assert_array_equal(data[0], windows)


def test_an_insert_counts_the_earlier_frames_it_encodes_under_the_lock(monkeypatch) -> None:
    fields = [{**FIELDS[0], "shape": [K, 16, 16]}, FIELDS[1]]
    table = LocalTable(TableConfig("t", 16, 2, frame_stack=K), fields, seed=0, compression="lz4")
    frames = np.random.default_rng(0).integers(1, 256, (K + 1, 16, 16), np.uint8)
    # A window from the middle of an episode (no padded first stack, no writer's stream):
    # its first stack's K-1 earlier frames are written, and encoded under the lock, too.
    steps = [[frames[:K], np.float32(0)], [frames[1:], np.float32(1)]]
    encoded = table._encode_steps(steps, 2)
    window = sum(len(p) + SLOT_OVERHEAD for p in encoded.values())
    monkeypatch.setattr(sizes, "available_memory", lambda: MEMORY_MARGIN + window + 64)
    with pytest.raises(ConfigError, match=r"table 't' cannot store \d+ more bytes"):
        table.insert_window(steps, 1.0)
    assert table.size == 0 and table._written == 0  # refused whole
    monkeypatch.setattr(sizes, "available_memory", lambda: MEMORY_MARGIN + (1 << 20))
    table.insert_window(steps, 1.0)
    held = table._columns[0].nbytes
    assert table._written == K + 1 and held <= table._budget.limit
    np.testing.assert_array_equal(table.items()[0][0][0], np.stack([frames[:K], frames[1:]]))


def test_continues_previous_finds_windows_shifted_by_one_step() -> None:
    steps = np.arange(10, dtype=np.int64)
    windows = np.stack([steps[i : i + 3] for i in (0, 1, 2, 5, 6, 0)])  # [6, 3]
    other = windows * 10
    assert continues_previous([windows, other], 3).tolist() == [
        False, True, True, False, True, False,
    ]  # fmt: skip
    other[2, 0] = -1  # a field that differs breaks the chain
    assert continues_previous([windows, other], 3).tolist() == [
        False, True, False, False, True, False,
    ]  # fmt: skip
    assert continues_previous([windows[:, :1]], 1).tolist() == [False] * 6

"""`ring_fit`: how many steps a table's step ring is made with, and the refusal of rings that
cannot fit in memory or on disk, before anything is allocated."""

from __future__ import annotations

import re

import pytest

from replay_service.backends.local.ring_fit import check_tables_fit, ring_steps
from replay_service.config.options import TableConfig
from replay_service.errors import ConfigError

pytestmark = pytest.mark.local

SMALL = [
    {"path": "observation", "dtype": "float32", "shape": [4]},
    {"path": "reward", "dtype": "float32", "shape": []},
]
WIDE = [
    {"path": "observation", "dtype": "float32", "shape": [1000]},
    {"path": "reward", "dtype": "float32", "shape": []},
]
FRAMES = [
    {"path": "observation", "dtype": "uint8", "shape": [4, 84, 84]},
    {"path": "reward", "dtype": "float32", "shape": []},
]


@pytest.mark.parametrize(
    ("capacity", "length", "storage", "k", "steps"),
    [
        (100, 1, "memory", None, 100),
        (100, 2, "memory", None, 101),
        (100, 2, "memmap", None, 200),
        (100, 2, "memory", 4, 104),  # the first step's 3 earlier frames
        (100, 2, "memmap", 4, 500),
    ],
)
def test_ring_steps_hold_capacity_windows_and_their_earlier_frames(
    capacity: int, length: int, storage: str, k: int | None, steps: int
) -> None:
    assert ring_steps(capacity, length, storage, k) == steps


def test_rings_that_fit_in_memory_pass(tmp_path) -> None:
    assert check_tables_fit([TableConfig("t", 1000, 2)], SMALL, "memory", str(tmp_path)) is None


def test_a_ring_larger_than_memory_is_refused_naming_the_bytes_per_step_and_the_table(
    tmp_path,
) -> None:
    capacity = 2_000_000_000  # 4,004 bytes a step: 8 TB
    with pytest.raises(ConfigError) as raised:
        check_tables_fit([TableConfig("big", capacity, 1)], WIDE, "memory", str(tmp_path))
    message = str(raised.value)
    assert "4004 bytes per step" in message
    assert f"table 'big': {capacity} steps for capacity {capacity}" in message
    assert "storage='memmap'" in message


def test_a_frame_stack_counts_each_step_s_newest_frame_and_the_serials_of_the_others(
    tmp_path,
) -> None:
    capacity = 2_000_000_000
    config = TableConfig("frames", capacity, 1, frame_stack=4)
    with pytest.raises(ConfigError) as raised:
        check_tables_fit([config], FRAMES, "memory", str(tmp_path))
    # One 84x84 frame, the reward and 3 int64 serials, not the 4-frame stack.
    per_step = 84 * 84 + 4 + 8 * 3
    assert re.search(rf"\b{per_step} bytes per step", str(raised.value))
    assert "frames stored once (frame_stack=4)" in str(raised.value)


def test_memory_mapped_rings_larger_than_the_disk_are_refused_naming_the_directory(
    tmp_path,
) -> None:
    root = tmp_path / ".memmap"
    with pytest.raises(ConfigError, match=r"cannot reserve \d+ bytes .* on disk") as raised:
        check_tables_fit([TableConfig("t", 2_000_000_000, 1000)], SMALL, "memmap", str(root))
    assert str(root) in str(raised.value)
    assert not root.exists()  # nothing was made

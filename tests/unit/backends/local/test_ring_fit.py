"""`ring_fit`: how many steps a table's step ring is made with, and the refusal of rings that
cannot fit in memory or on disk, before anything is allocated."""

from __future__ import annotations

import re

import pytest

from replay_service.backends.local.codecs import SLOT_OVERHEAD, estimated_bytes
from replay_service.backends.local.ring_fit import check_tables_fit, ring_steps
from replay_service.config.options import TableConfig
from replay_service.errors import ConfigError
from replay_service.specs import sizes

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
    ("capacity", "length", "k", "steps"),
    [
        (100, 1, None, 100),
        (100, 2, None, 101),
        (100, 2, 4, 104),  # the first step's 3 earlier frames
    ],
)
def test_ring_steps_hold_capacity_windows_and_their_earlier_frames(
    capacity: int, length: int, k: int | None, steps: int
) -> None:
    """In RAM and in files ("memmap") alike: each step once."""
    assert ring_steps(capacity, length, k) == steps


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
        check_tables_fit([TableConfig("t", 2_000_000_000, 1000)], WIDE, "memmap", str(root))
    assert str(root) in str(raised.value)
    assert not root.exists()  # nothing was made


@pytest.mark.parametrize("k", [None, 4])
def test_memory_mapped_rings_need_each_step_once_on_disk(tmp_path, k: int | None) -> None:
    """The disk must hold `capacity + span - 1` steps, as RAM would: a transition table's or
    a frame-stacked one's files (each step's newest frame) are not sized for windows that
    share no step."""
    capacity = 2_000_000_000
    fields = [
        {"path": "observation", "dtype": "float32", "shape": [1000] if k is None else [k, 1000]},
        {"path": "reward", "dtype": "float32", "shape": []},
    ]
    config = TableConfig("t", capacity, 2, frame_stack=k)
    with pytest.raises(ConfigError) as raised:
        check_tables_fit([config], fields, "memmap", str(tmp_path / ".memmap"))
    needed = int(str(raised.value).split("cannot reserve ")[1].split(" bytes")[0])
    span = 2 + (k - 1 if k else 0)
    assert needed == (capacity + span - 1) * 4004, raised.value


ATARI = [  # a DQN transition step of Breakout, frame_stack=4
    {"path": "observation", "dtype": "uint8", "shape": [4, 84, 84]},
    {"path": "action", "dtype": "int64", "shape": []},
    {"path": "reward", "dtype": "float32", "shape": []},
    {"path": "discount", "dtype": "float32", "shape": []},
    {"path": "step_type", "dtype": "int32", "shape": []},
]


@pytest.mark.heavy
@pytest.mark.parametrize("compression", ["lz4", "zstd"])
def test_a_compressed_million_step_atari_ring_fits_where_its_raw_frames_would_not(
    tmp_path, monkeypatch, compression: str
) -> None:
    monkeypatch.setattr(sizes, "available_memory", lambda: 4 << 30)  # 4 GiB
    tables = [TableConfig("atari", 1_000_000, 2, frame_stack=4)]
    with pytest.raises(ConfigError, match="7100 bytes per step"):  # raw frames: 7.1 GB
        check_tables_fit(tables, ATARI, "memory", str(tmp_path))
    # Counted at the estimate: 7056 / 8 + SLOT_OVERHEAD per frame, about 0.97 GB in all.
    assert check_tables_fit(tables, ATARI, "memory", str(tmp_path), compression) is None
    frame = 7056 // 8 + SLOT_OVERHEAD
    assert estimated_bytes(7056, compression) == frame
    # Too little memory even for the estimate: refused, naming the estimate.
    monkeypatch.setattr(sizes, "available_memory", lambda: 512 << 20)
    with pytest.raises(ConfigError) as raised:
        check_tables_fit(tables, ATARI, "memory", str(tmp_path), compression)
    message = str(raised.value)
    assert f"{frame + 44} bytes per step" in message  # 20 B of fields, 24 B of serials
    assert f"compressed ({compression!r}), counted at an estimated 1/8" in message


def test_compressed_fields_are_counted_only_from_1_kib_and_none_at_their_raw_bytes(
    tmp_path, monkeypatch
) -> None:
    # WIDE: a 4000-byte field (compressed) and a 4-byte one (plain); SMALL: nothing compressed.
    steps = 1000
    monkeypatch.setattr(sizes, "available_memory", lambda: steps * (500 + SLOT_OVERHEAD + 4))
    table = [TableConfig("t", steps, 1)]
    assert check_tables_fit(table, WIDE, "memory", str(tmp_path), "lz4") is None
    with pytest.raises(ConfigError, match="4004 bytes per step"):
        check_tables_fit(table, WIDE, "memory", str(tmp_path))
    with pytest.raises(ConfigError, match=f"{4004 + SLOT_OVERHEAD} bytes per step"):
        check_tables_fit(table, WIDE, "memory", str(tmp_path), "none")
    monkeypatch.setattr(sizes, "available_memory", lambda: steps * 20 - 1)
    with pytest.raises(ConfigError, match="20 bytes per step"):
        check_tables_fit(table, SMALL, "memory", str(tmp_path), "lz4")

"""`specs.sizes`: bytes per step and per item, the memory available, and the item-size check."""

from __future__ import annotations

import pytest

from replay_service.config.options import TableConfig
from replay_service.errors import ConfigError
from replay_service.specs import sizes
from replay_service.specs.sizes import (
    FieldSize,
    check_item_fits,
    field_sizes,
    human,
    largest_fields,
    step_bytes,
)

FIELDS = [
    {"path": "observation", "dtype": "float32", "shape": [84, 84, 3]},
    {"path": "action", "dtype": "int64", "shape": []},
    {"path": "reward", "dtype": "float32", "shape": []},
    {"path": "mask", "dtype": "bool", "shape": [None, 2]},
]


def test_field_sizes_count_unknown_dimensions_as_one_and_unknown_dtypes_as_zero():
    found = field_sizes([*FIELDS, {"path": "text", "dtype": "string", "shape": [5]}])
    assert [f.nbytes for f in found] == [84 * 84 * 3 * 4, 8, 4, 2, 0]
    assert found[3] == FieldSize("mask", (None, 2), "bool", 2)
    assert step_bytes(FIELDS) == 84 * 84 * 3 * 4 + 14
    huge = field_sizes([{"path": "x", "dtype": "float64", "shape": [10**10, 10**10]}])
    assert huge[0].nbytes == 8 * 10**20  # Python integers: no overflow


def test_field_size_describes_itself_for_an_error():
    assert FieldSize("mask", (None, 2), "bool", 2).describe() == "'mask' [?, 2] bool: 2 bytes"
    assert FieldSize("r", (), "float32", 4).describe() == "'r' [] float32: 4 bytes"


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (3 << 20, "3.0 MiB"),
        (5 << 60, "5120.0 PiB"),
    ],
)
def test_human_uses_binary_units_up_to_pib(nbytes, text):
    assert human(nbytes) == text


def test_largest_fields_names_at_most_three_largest_first():
    assert largest_fields(FIELDS) == (
        "'observation' [84, 84, 3] float32: 84672 bytes, 'action' [] int64: 8 bytes, "
        "'reward' [] float32: 4 bytes (and 1 smaller)"
    )
    assert largest_fields(FIELDS[1:3]) == "'action' [] int64: 8 bytes, 'reward' [] float32: 4 bytes"


def write(path, text):
    path.write_text(text, encoding="ascii")
    return str(path)


@pytest.fixture()
def memory_files(tmp_path, monkeypatch):
    """Points the module at fake /proc/meminfo and cgroup files (none exist at first)."""
    v2 = tmp_path / "v2"
    v1 = tmp_path / "v1"
    v2.mkdir()
    v1.mkdir()
    monkeypatch.setattr(sizes, "_MEMINFO", str(tmp_path / "meminfo"))
    monkeypatch.setattr(sizes, "_CGROUP_V2", (str(v2 / "memory.max"), str(v2 / "memory.current")))
    monkeypatch.setattr(
        sizes, "_CGROUP_V1", (str(v1 / "memory.limit_in_bytes"), str(v1 / "memory.usage_in_bytes"))
    )
    return tmp_path


def test_available_memory_is_meminfo_lowered_to_what_the_cgroup_leaves(memory_files):
    write(memory_files / "meminfo", "MemTotal: 9000 kB\nMemAvailable: 1000 kB\n")
    assert sizes.available_memory() == 1000 * 1024
    write(memory_files / "v2" / "memory.max", "600000\n")
    write(memory_files / "v2" / "memory.current", "500000\n")
    assert sizes.available_memory() == 100000
    write(memory_files / "v2" / "memory.stat", "anon 1\ninactive_file 300000\n")
    assert sizes.available_memory() == 400000  # inactive file cache counts as free
    write(memory_files / "v2" / "memory.current", "900000\n")
    write(memory_files / "v2" / "memory.stat", "")
    assert sizes.available_memory() == 0  # over the limit: nothing left, never negative


@pytest.mark.parametrize("limit", ["max\n", str(1 << 62)])
def test_an_unlimited_cgroup_falls_through_to_v1_then_meminfo(memory_files, limit):
    write(memory_files / "meminfo", "MemAvailable: 1000 kB\n")
    write(memory_files / "v2" / "memory.max", limit)
    write(memory_files / "v2" / "memory.current", "5\n")
    assert sizes.available_memory() == 1024000
    write(memory_files / "v1" / "memory.limit_in_bytes", "2000\n")
    write(memory_files / "v1" / "memory.usage_in_bytes", "500\n")
    write(memory_files / "v1" / "memory.stat", "total_inactive_file 100\n")
    assert sizes.available_memory() == 1600


def test_available_memory_without_files_asks_sysconf_or_is_unknown(memory_files, monkeypatch):
    monkeypatch.setattr(sizes.os, "sysconf", lambda name: {"SC_AVPHYS_PAGES": 3}.get(name, 4096))
    assert sizes.available_memory() == 3 * 4096
    write(memory_files / "meminfo", "MemAvailable: not-a-number kB\n")
    assert sizes.available_memory() == 3 * 4096

    def no_sysconf(name):
        raise ValueError(name)

    monkeypatch.setattr(sizes.os, "sysconf", no_sysconf)
    assert sizes.available_memory() is None


def test_check_item_fits_accepts_an_item_that_fits_and_when_memory_is_unknown(monkeypatch):
    tables = [TableConfig(capacity=10, sequence_length=2)]
    monkeypatch.setattr(sizes, "available_memory", lambda: 2 * step_bytes(FIELDS))
    check_item_fits(FIELDS, tables)
    monkeypatch.setattr(sizes, "available_memory", lambda: None)
    check_item_fits([{"path": "x", "dtype": "float64", "shape": [10**9, 10**9]}], tables)


def test_check_item_fits_names_the_item_the_fields_and_the_memory(monkeypatch):
    per_step = step_bytes(FIELDS)
    monkeypatch.setattr(sizes, "available_memory", lambda: 3 * per_step - 1)
    tables = [
        TableConfig(capacity=10, sequence_length=2),
        TableConfig(name="long", capacity=5, sequence_length=3),
    ]
    with pytest.raises(ConfigError) as raised:
        check_item_fits(FIELDS, tables)
    message = str(raised.value)
    assert message.startswith(
        f"one item of this data spec takes {3 * per_step} bytes (248.1 KiB: 3 steps of "
        f"{per_step} bytes), more than the {3 * per_step - 1} bytes"
    )
    assert f"the capacity, 10, 5 items, would hold {35 * per_step} bytes" in message
    assert "'observation' [84, 84, 3] float32: 84672 bytes" in message

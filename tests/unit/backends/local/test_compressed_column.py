"""`compressed_column`: a `CompressedColumn`'s slots are overwritten, put, counted, remapped
as the ring grows and round-trip through a checkpoint's flat arrays; its `PayloadBudget`
refuses what the memory cannot hold."""

from __future__ import annotations

import numpy as np
import pytest

from codec_cases import NAMES, SHAPE, frames
from replay_service.backends.local import codecs, compressed_column
from replay_service.backends.local.compressed_column import CompressedColumn
from replay_service.errors import CheckpointError, ConfigError

pytestmark = pytest.mark.local


@pytest.mark.parametrize("name", NAMES)
def test_an_overwritten_slot_reads_its_new_value(name: str) -> None:
    first, second = frames(8, seed=4), frames(8, seed=5)
    column = CompressedColumn(8, SHAPE, np.uint8, name)
    column.write(np.arange(8), first)
    column.write(np.array([2, 5, 5]), second[[0, 1, 2]])  # a repeated slot keeps the last
    expected = first.copy()
    expected[2], expected[5] = second[0], second[2]
    np.testing.assert_array_equal(column.read(np.arange(8)), expected)


@pytest.mark.parametrize("name", NAMES)
def test_put_fills_one_slot_and_counts_its_bytes(name: str) -> None:
    values = frames(3, seed=6)
    column = CompressedColumn(4, SHAPE, np.uint8, name)
    payloads = column.encode(values)
    column.put(1, payloads[0])
    column.put(1, payloads[1])  # an overwrite replaces the payload's bytes
    column.put(3, payloads[2])
    assert column.payload_bytes == len(payloads[1]) + len(payloads[2])
    assert column.nbytes == column.payload_bytes + 2 * codecs.SLOT_OVERHEAD + 2 * 8
    np.testing.assert_array_equal(column.read(np.array([1, 3])), values[1:])


@pytest.mark.parametrize("name", NAMES)
def test_nbytes_counts_payloads_and_slots(name: str) -> None:
    column = CompressedColumn(10, SHAPE, np.uint8, name)
    assert column.nbytes == 10 * 8 and column.payload_bytes == 0
    payloads = column.encode(frames(4))
    column.store(np.arange(4), payloads)
    held = sum(len(p) for p in payloads)
    assert column.payload_bytes == held
    assert column.nbytes == held + 4 * codecs.SLOT_OVERHEAD + 6 * 8
    column.store(np.array([0]), payloads[1:2])  # an overwrite replaces the payload's bytes
    assert column.payload_bytes == held - len(payloads[0]) + len(payloads[1])
    column.clear()
    assert column.nbytes == 10 * 8 and column.payload_bytes == 0
    with pytest.raises(ValueError, match="never written"):
        column.read(np.array([0]))


@pytest.mark.parametrize("name", NAMES)
def test_the_state_round_trips_through_flat_arrays(name: str) -> None:
    values = frames(6)
    column = CompressedColumn(9, SHAPE, np.uint8, name)
    column.write(np.array([0, 1, 2, 4, 7, 8]), values)
    payload, offsets = column.to_arrays()
    assert payload.dtype == np.uint8 and payload.ndim == 1 and len(payload) == column.payload_bytes
    assert offsets.shape == (10,) and offsets[3] == offsets[4]  # slot 3 is empty
    restored = CompressedColumn(9, SHAPE, np.uint8, name)
    restored.from_arrays(payload.copy(), offsets.copy())
    assert restored.nbytes == column.nbytes
    slots = np.array([0, 1, 2, 4, 7, 8])
    np.testing.assert_array_equal(restored.read(slots), values)
    with pytest.raises(ValueError, match=r"slots \[3\]"):
        restored.read(np.array([3]))


def test_a_state_that_does_not_fit_is_refused_and_changes_nothing() -> None:
    column = CompressedColumn(3, SHAPE, np.uint8, "none")
    column.write(np.arange(3), frames(3))
    payload, offsets = column.to_arrays()
    for bad_payload, bad_offsets, match in [
        (payload, offsets[:-1], "3 slots needs"),
        (payload.astype(np.int16), offsets, "uint8 payload"),
        (payload[:-1], offsets, "do not divide"),
        (payload, offsets[[0, 2, 1, 3]], "decreasing: True"),
    ]:
        with pytest.raises(CheckpointError, match=match):
            column.from_arrays(bad_payload, bad_offsets)
    np.testing.assert_array_equal(column.read(np.arange(3)), frames(3))


def test_a_growing_ring_remaps_its_slots() -> None:
    values = frames(4)
    column = CompressedColumn(4, SHAPE, np.uint8, "none")
    column.write(np.arange(4), values)
    column.remap(np.array([2, 3, 0]), 6)
    assert len(column) == 6
    np.testing.assert_array_equal(column.read(np.arange(3)), values[[2, 3, 0]])
    assert column.payload_bytes == 3 * values[0].nbytes
    with pytest.raises(ValueError, match="never written"):
        column.read(np.array([3]))


def test_the_payload_budget_looks_at_the_memory_only_past_its_grant(monkeypatch) -> None:
    looks: list[int] = []
    available = [compressed_column.MEMORY_MARGIN + (8 << 20)]

    def memory() -> int:
        looks.append(available[0])
        return available[0]

    monkeypatch.setattr(compressed_column.sizes, "available_memory", memory)
    budget = compressed_column.PayloadBudget()
    budget.check(0, 1000, "table 't'")  # first insert: looks, grants 1 MiB beyond it
    assert len(looks) == 1 and budget.limit == 1000 + compressed_column.MIN_GRANT
    budget.check(500_000, 500_000, "table 't'")  # within the grant: no look
    assert len(looks) == 1
    budget.check(80 << 20, 1000, "table 't'")  # past it: grants an eighth of what is held ...
    assert len(looks) == 2 and budget.limit == (80 << 20) + 1000 + (8 << 20) - 1000
    available[0] = compressed_column.MEMORY_MARGIN + 999  # ... at most what leaves the margin free
    with pytest.raises(ConfigError) as raised:
        budget.check(90 << 20, 1000, "table 't'")
    message = str(raised.value)
    assert "table 't' cannot store 1000 more bytes of compressed payloads" in message
    assert f"needs {compressed_column.MEMORY_MARGIN + 1000} bytes" in message
    assert f"but {compressed_column.MEMORY_MARGIN + 999} bytes" in message
    assert "nothing was written" in message
    monkeypatch.setattr(
        compressed_column.sizes, "available_memory", lambda: None
    )  # unknown: granted
    budget.check(90 << 20, 1000, "table 't'")
    assert budget.limit > 90 << 20


def test_the_payload_budget_counts_what_every_owner_holds_until_one_is_dropped(
    monkeypatch,
) -> None:
    looks: list[int] = []

    def memory() -> int:
        looks.append(1)
        return compressed_column.MEMORY_MARGIN + (1 << 30)

    class Table:
        pass

    monkeypatch.setattr(compressed_column.sizes, "available_memory", memory)
    budget = compressed_column.PayloadBudget()
    first, second = Table(), Table()
    budget.check(0, 1000, "table 'a'", owner=first)  # looks: grants MIN_GRANT beyond
    limit = 1000 + compressed_column.MIN_GRANT
    assert len(looks) == 1 and budget.limit == limit
    budget.check(0, limit - 1000, "table 'b'", owner=second)  # both fit the grant
    assert len(looks) == 1
    budget.check(limit - 1000, 1, "table 'b'", owner=second)  # 'a' holds 1000: past it
    assert len(looks) == 2
    limit = budget.limit
    held = limit - 1000  # what 'b' may hold while 'a' holds 1000
    budget.check(held - 1, 1, "table 'b'", owner=second)
    assert len(looks) == 2
    budget.check(held, 1, "table 'b'", owner=second)  # 1000 + held + 1 > limit
    assert len(looks) == 3
    limit = budget.limit
    del first  # freed here: nothing else refers to it
    budget.check(limit - 1, 1, "table 'b'", owner=second)  # alone now: 'a' counts no more
    assert len(looks) == 3
    budget.check(limit, 1, "table 'b'", owner=second)
    assert len(looks) == 4

"""`config.batch_limits.require_batch_size`: the fixed ceiling and the memory a batch needs.

`tests/integration/sample/test_batch_bounds.py` checks every sampling call of both backends.
"""

from __future__ import annotations

import pytest

from replay_service.config import batch_limits
from replay_service.config.batch_limits import (
    MAX_BATCH_SIZE,
    SAMPLE_INFO_BYTES,
    SMALL_BATCH_BYTES,
    require_batch_size,
)
from replay_service.errors import ConfigError


@pytest.fixture()
def memory(monkeypatch):
    """Sets the memory available (reading it is counted)."""
    reads = []

    def set_available(value):
        def available():
            reads.append(value)
            return value

        monkeypatch.setattr(batch_limits, "available_memory", available)
        return reads

    return set_available


@pytest.mark.parametrize("value", [0, -1, True, 2.0, "8"])
def test_a_batch_size_must_be_a_positive_integer(value):
    with pytest.raises(
        ConfigError, match=f"^batch_size must be a positive integer, got {value!r}$"
    ):
        require_batch_size("batch_size", value, 4)


def test_small_batches_are_accepted_without_reading_the_memory(memory):
    reads = memory(0)
    largest_small = SMALL_BATCH_BYTES // (100 + SAMPLE_INFO_BYTES) - 1
    assert require_batch_size("batch_size", largest_small, 100) == largest_small
    assert reads == []


def test_above_the_fixed_ceiling_is_refused_whatever_the_memory(memory):
    reads = memory(None)
    assert require_batch_size("n", MAX_BATCH_SIZE, 0) == MAX_BATCH_SIZE  # unknown: accepted
    assert reads == [None]
    with pytest.raises(ConfigError) as raised:
        require_batch_size("n", MAX_BATCH_SIZE + 1, 4, what="table 'recent'")
    assert str(raised.value) == (
        f"n={MAX_BATCH_SIZE + 1} is above the largest batch size, {MAX_BATCH_SIZE}: a batch of "
        f"{MAX_BATCH_SIZE + 1} items of table 'recent' (40 bytes each) needs "
        f"{(MAX_BATCH_SIZE + 1) * 40} bytes; sample batches of at most {MAX_BATCH_SIZE} items"
    )


def test_a_batch_may_take_half_the_available_memory_and_the_error_gives_the_largest(memory):
    item = 1 << 20
    per_item = item + SAMPLE_INFO_BYTES
    available = 1000 * per_item
    memory(available)
    assert require_batch_size("batch_size", 500, item) == 500
    with pytest.raises(ConfigError) as raised:
        require_batch_size("batch_size", 501, item)
    message = str(raised.value)
    assert message.startswith(
        f"batch_size=501 is too large for this machine's memory: a batch of 501 items "
        f"({per_item} bytes each) needs {501 * per_item} bytes, above the ceiling of "
        f"{available // 2} bytes (0.5 of the {available} bytes available"
    )
    assert message.endswith("use batch_size <= 500")


def test_held_caps_the_items_a_pass_holds(memory):
    item = 16 << 20  # 5 items are above SMALL_BATCH_BYTES: the memory is compared
    memory(10 * (item + SAMPLE_INFO_BYTES))
    assert require_batch_size("batch_size", 10**6, item, held=5) == 10**6
    with pytest.raises(ConfigError, match="a batch of 6 items"):
        require_batch_size("batch_size", 10**6, item, held=6)


def test_negative_item_bytes_count_as_zero_and_a_tiny_memory_still_suggests_one(memory):
    memory(1)
    big = SMALL_BATCH_BYTES // SAMPLE_INFO_BYTES + 1
    with pytest.raises(ConfigError, match=r"\(36 bytes each\).*use k <= 1$"):
        require_batch_size("k", big, -100)

"""`slots.Slots`: which slots a local table holds, their order, keys and uniform draws. Every
behaviour runs against both implementations; what only one of them does is tested apart."""

from __future__ import annotations

import numpy as np
import pytest

from replay_service import SamplingConfig, TableConfig
from replay_service.backends.local.slots import ListSlots, RingSlots, Slots, slots_for

pytestmark = pytest.mark.local

KINDS = [RingSlots, ListSlots]


def fill(slots: Slots, count: int) -> tuple[list[int], list[int]]:
    """Inserts `count` items one by one, evicting the oldest when full, as a table does;
    returns every slot and key handed out."""
    handed, keys = [], []
    for _ in range(count):
        if slots.size == slots.capacity:
            slots.remove_oldest(1)
        slot, key = slots.allocate(1)
        handed.append(int(slot[0]))
        keys.append(int(key[0]))
    return handed, keys


@pytest.mark.parametrize("kind", KINDS)
def test_keys_of_the_tables_of_one_buffer_never_coincide(kind):
    tables = [kind(8, 3, offset) for offset in range(3)]
    handed = []
    for slots in tables:
        slots_one = [slots.allocate_one() for _ in range(4)]
        slots_many, keys_many = slots.allocate(3)
        keys = [k for _, k in slots_one] + keys_many.tolist()
        assert keys == sorted(keys)
        np.testing.assert_array_equal(
            slots.keys(np.array([s for s, _ in slots_one] + slots_many.tolist())), keys
        )
        handed.append(keys)
    assert len({k for keys in handed for k in keys}) == 3 * 7
    for index, slots in enumerate(tables):
        for other, keys in enumerate(handed):
            _, held = slots.find(np.array(keys, dtype=np.uint64))
            assert held[-slots.size :].all() == (index == other)
            assert not held.any() or index == other
            assert all(slots.holds(k) for k in keys[-slots.size :]) == (index == other)
    with pytest.raises(ValueError, match="offset"):
        kind(5, 2, 2)


@pytest.mark.parametrize("kind", KINDS)
def test_keys_are_unique_and_name_their_slots(kind):
    slots = kind(5)
    handed, keys = fill(slots, 23)
    assert len(set(keys)) == 23 and min(keys) >= 1
    assert keys == sorted(keys)  # they grow with the insertion order
    found, held = slots.find(np.array(keys, dtype=np.uint64))
    np.testing.assert_array_equal(found, handed)
    np.testing.assert_array_equal(held, [False] * 18 + [True] * 5)
    np.testing.assert_array_equal(slots.keys(np.array(handed[-5:])), keys[-5:])


@pytest.mark.parametrize("kind", KINDS)
def test_oldest_newest_and_order_follow_the_insertions(kind):
    slots = kind(6)
    handed, _ = fill(slots, 15)
    np.testing.assert_array_equal(slots.ordered(), handed[-6:])
    np.testing.assert_array_equal(slots.oldest(2), handed[-6:-4])
    assert sorted(slots.newest(3).tolist()) == sorted(handed[-3:])
    assert sorted(slots.newest(9).tolist()) == sorted(handed[-6:])
    np.testing.assert_array_equal(slots.remove_oldest(2), handed[-6:-4])
    np.testing.assert_array_equal(slots.ordered(), handed[-4:])
    assert slots.size == 4


@pytest.mark.parametrize("kind", KINDS)
def test_draws_land_on_held_slots_only_and_reach_each_of_them(kind):
    slots = kind(50)
    handed, _ = fill(slots, 70)
    slots.remove_oldest(10)
    held = set(handed[-40:])
    drawn = slots.draw(np.random.default_rng(0), 40_000)
    counts = np.bincount(drawn, minlength=50)
    assert set(np.flatnonzero(counts).tolist()) == held
    assert counts[list(held)].min() > 1000 / 2  # about 1,000 each


@pytest.mark.parametrize("kind", KINDS)
def test_a_cleared_table_holds_nothing_and_never_reuses_a_key(kind):
    slots = kind(4)
    _, before = fill(slots, 6)
    slots.clear()
    assert slots.size == 0 and len(slots.ordered()) == 0
    assert not slots.find(np.array(before, dtype=np.uint64))[1].any()
    _, after = fill(slots, 6)
    assert not set(before) & set(after)
    assert slots.holds(after[-1]) and not slots.holds(after[0])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("key", [0, 1 << 64, -3])
def test_keys_that_no_table_hands_out_are_not_held(kind, key):
    slots = kind(3)
    fill(slots, 2)
    assert not slots.holds(key)


@pytest.mark.parametrize("kind", KINDS)
def test_a_held_items_number_with_another_slot_is_no_key_of_it(kind):
    slots = kind(5)
    _, keys = fill(slots, 12)
    forged = [k for k in range(1, keys[-1] + 5) if k not in keys]
    assert not any(slots.holds(k) for k in forged)
    assert not slots.find(np.array(forged, dtype=np.uint64))[1].any()
    assert all(slots.holds(k) for k in keys[-5:])


def test_list_slots_remove_out_of_order_and_keep_the_order_of_the_rest():
    slots = ListSlots(6)
    handed, keys = fill(slots, 6)
    slots.remove(np.array([handed[2], handed[4]]))
    np.testing.assert_array_equal(slots.ordered(), [handed[i] for i in (0, 1, 3, 5)])
    np.testing.assert_array_equal(slots.oldest(3), [handed[i] for i in (0, 1, 3)])
    new, new_keys = slots.allocate(2)  # the freed slots are taken again, with new keys
    assert sorted(new.tolist()) == sorted([handed[2], handed[4]])
    assert not slots.holds(keys[2]) and slots.holds(int(new_keys[0]))
    np.testing.assert_array_equal(slots.ordered()[-2:], new)


def test_ring_slots_refuse_to_free_any_but_the_oldest():
    slots = RingSlots(6)
    handed, _ = fill(slots, 9)
    with pytest.raises(AssertionError, match="oldest"):
        slots.remove(np.array([handed[-1]]))
    slots.remove(np.array([handed[4], handed[3]]))  # the two oldest, in any order
    np.testing.assert_array_equal(slots.ordered(), handed[-4:])


@pytest.mark.parametrize(
    "sampler, max_times_sampled, kind",
    [
        ("uniform", 0, RingSlots),
        ("prioritized", 0, RingSlots),
        ("fifo", 1, RingSlots),  # removes the oldest
        ("fifo", 0, RingSlots),
        ("uniform", 3, ListSlots),
        ("prioritized", 2, ListSlots),
    ],
)
def test_a_table_gets_ring_slots_unless_it_removes_items_out_of_order(
    sampler, max_times_sampled, kind
):
    config = TableConfig(
        "t", 10, 2, sampling=SamplingConfig(sampler=sampler, max_times_sampled=max_times_sampled)
    )
    assert type(slots_for(config)) is kind

"""`LocalTable` used directly: what it refuses, eviction, its samplers, priorities,
`max_times_sampled`, timeouts, closing, resets and restores."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replay_service.backends.local.table import LocalTable, check_device, check_local_table
from replay_service.config.options import SamplingConfig, TableConfig
from replay_service.errors import BufferStateError, ConfigError, ManagerClosedError

pytestmark = pytest.mark.local

FIELDS = [
    {"path": "x", "dtype": "float32", "shape": [2]},
    {"path": "n", "dtype": "int64", "shape": []},
]
LENGTH = 2


def make(capacity: int = 4, seed: int = 0, **sampling: object) -> LocalTable:
    config = TableConfig("t", capacity, LENGTH, sampling=SamplingConfig(**sampling))
    return LocalTable(config, FIELDS, seed=seed)


def items(values: list[int]) -> list[np.ndarray]:
    """One item per value v: steps (v, v + 0.5), x = [step, -step], n = v."""
    steps = np.array([[v, v + 0.5] for v in values], np.float32)
    return [np.stack([steps, -steps], axis=-1), np.repeat(np.array(values)[:, None], LENGTH, 1)]


def held(table: LocalTable) -> list[int]:
    return [int(v) for v in table.items()[0][1][:, 0]]


@pytest.mark.parametrize(
    ("sampling", "match"),
    [
        ({"sampler": "max_heap"}, r"table 't': sampler 'max_heap' needs backend='reverb'"),
        ({"remover": "lifo"}, r"table 't': remover 'lifo' needs backend='reverb'"),
        ({"samples_per_insert": 2.0}, r"table 't': samples_per_insert=2\.0 .* needs backend"),
    ],
)
def test_reverb_only_sampling_is_refused_naming_the_table_and_option(sampling, match) -> None:
    with pytest.raises(ConfigError, match=match):
        check_local_table(TableConfig("t", 4, 1, sampling=SamplingConfig(**sampling)))


@pytest.mark.parametrize(
    ("device", "match"),
    [("nonsense", r"device must be a torch device .* got 'nonsense'"), ("meta", "not on 'meta'")],
)
def test_devices_that_hold_no_table_are_refused(device: str, match: str) -> None:
    assert check_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match=match):
        check_device(device)


def test_an_unknown_storage_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"storage must be one of .* got 'disk'"):
        LocalTable(TableConfig("t", 4, LENGTH), FIELDS, storage="disk")


def test_a_full_table_evicts_its_oldest_items_and_keys_are_never_reused() -> None:
    table = make()
    first = table.insert(items([0, 1, 2]), np.ones(3))
    second = table.insert(items([3, 4, 5]), np.ones(3))
    assert held(table) == [2, 3, 4, 5]
    assert (table.size, table.inserts, table.evictions) == (4, 6, 2)
    assert len(set(first.tolist() + second.tolist())) == 6
    data, priorities, times = table.items()
    np.testing.assert_array_equal(data[0][0], [[2, -2], [2.5, -2.5]])
    np.testing.assert_array_equal(priorities, np.ones(4))
    np.testing.assert_array_equal(times, np.zeros(4))


def test_a_sample_gives_whole_windows_and_their_info() -> None:
    table = make()
    keys = table.insert(items([7, 8]), np.ones(2))
    data, info = table.sample(32, timeout=1.0)
    assert data[0].shape == (32, LENGTH, 2) and data[1].shape == (32, LENGTH)
    for key, x, n in zip(info["key"], data[0], data[1], strict=True):
        value = {int(keys[0]): 7, int(keys[1]): 8}[int(key)]
        assert n.tolist() == [value, value]
        assert x[:, 0].tolist() == [value, value + 0.5]
    np.testing.assert_array_equal(info["probability"], np.full(32, 0.5))
    np.testing.assert_array_equal(info["table_size"], np.full(32, 2))
    assert table.samples == 32
    counts = [int((info["key"] == key).sum()) for key in keys]
    assert table.items()[2].tolist() == counts  # every draw counted


def test_prioritized_sampling_follows_updated_priorities_and_ignores_unknown_keys() -> None:
    table = make(sampler="prioritized", priority_exponent=1.0)
    keys = table.insert(items([0, 1, 2]), np.ones(3))
    updated = table.update_priorities({int(keys[0]): 0.0, int(keys[1]): 3.0, 10**6: 5.0, 0: 1.0})
    assert updated == 2
    data, info = table.sample(400, timeout=1.0)
    drawn = data[1][:, 0].numpy()
    assert 0 not in drawn  # priority 0: never drawn
    assert 0.65 < np.mean(drawn == 1) < 0.85  # 3 of 4
    np.testing.assert_allclose(info["probability"][drawn == 1], 0.75)
    np.testing.assert_array_equal(table.items()[1], [0.0, 3.0, 1.0])


def test_a_fifo_table_with_max_times_sampled_one_is_a_queue() -> None:
    table = make(sampler="fifo", max_times_sampled=1)
    table.insert(items([0, 1, 2]), np.ones(3))
    data, info = table.sample(2, timeout=1.0)
    assert data[1][:, 0].tolist() == [0, 1]
    assert info["times_sampled"].tolist() == [1, 1]
    assert held(table) == [2]
    assert table.sample(1, timeout=1.0)[0][1][:, 0].tolist() == [2]
    with pytest.raises(BufferStateError, match=r"within 0\.05 s: it holds 0 items"):
        table.sample(1, timeout=0.05)


def test_sampling_below_min_size_times_out_naming_the_counts() -> None:
    table = make(min_size_to_sample=3)
    table.insert(items([0, 1]), np.ones(2))
    with pytest.raises(
        BufferStateError, match=r"table 't' within 0\.05 s: it holds 2 items .*min_size_to_sample=3"
    ):
        table.sample(1, timeout=0.05)


def test_a_closed_table_fails_samplers_and_keeps_its_items_readable() -> None:
    table = make()
    table.insert(items([0, 1]), np.ones(2))
    table.close()
    with pytest.raises(ManagerClosedError, match="table 't' was closed"):
        table.sample(1, timeout=1.0)
    with pytest.raises(ManagerClosedError):
        table.read_newest(1, 1, np.random.default_rng(0))
    assert held(table) == [0, 1]


def test_read_newest_draws_from_the_newest_window_and_counts_nothing() -> None:
    table = make()
    with pytest.raises(BufferStateError, match="table 't' holds no items"):
        table.read_newest(1, 2, np.random.default_rng(0))
    table.insert(items([0, 1, 2, 3]), np.ones(4))
    data = table.read_newest(100, 2, np.random.default_rng(0))
    assert set(data[1][:, 0].tolist()) == {2, 3}
    assert table.samples == 0 and not table.items()[2].any()


def test_reset_empties_the_table_and_new_keys_follow_the_old_ones() -> None:
    table = make()
    old = table.insert(items([0, 1]), np.ones(2))
    table.reset()
    assert (table.size, table.resets, table.deletes) == (0, 1, 2)
    assert held(table) == []
    new = table.insert(items([5]), np.ones(1))
    assert int(new[0]) not in old.tolist()
    assert held(table) == [5]


def test_restore_refills_an_empty_table_as_saved_and_refuses_a_filled_one() -> None:
    table = make(sampler="prioritized")
    keys = table.insert(items([0, 1, 2]), np.ones(3))
    table.update_priorities({int(keys[1]): 2.5})
    table.sample(5, timeout=1.0)
    saved = table.items()
    restored = make(sampler="prioritized")
    restored.restore(*saved)
    (data, priorities, times), (data2, priorities2, times2) = saved, restored.items()
    for x, y in zip([*data, priorities, times], [*data2, priorities2, times2], strict=True):
        np.testing.assert_array_equal(x, y)
    assert priorities.tolist() == [1.0, 2.5, 1.0] and times.sum() == 5
    assert restored.inserts == 0  # restored, not inserted
    with pytest.raises(BufferStateError, match="table 't' is not empty"):
        restored.restore(*saved)

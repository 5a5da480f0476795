"""`sample.mixing.MixedSampleSource`: every item of a mixed batch comes from the table its
seeded draw picked, with that table's own info, in the order the table's source sampled it;
chunks left over carry to the next batch and are dropped after a `clear()`. The sources are
counting sources of this file (the manager-level mix is tested in test_warm_up.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from replay_service.errors import ConfigError, ManagerClosedError
from replay_service.sample.batches import item_packer
from replay_service.sample.mixing import MixedSampleInfo, MixedSampleSource
from replay_service.specs.arrays import ArraySpec

KEY_BASE = 2**63 + 5  # keys above int64's range, as Reverb's uint64 keys are


class CountingSource:
    """A table whose items are 0, 1, 2...: `x` = `table * 1000 + n`, key `KEY_BASE + n`."""

    table_name = "t"
    sequence_length = 1

    def __init__(self, table: int) -> None:
        self.signature = {"x": ArraySpec((1,), np.float32)}
        self.table = table
        self.drawn = 0
        self.requests: list[int] = []
        self.cleared = 0
        self.closed: ManagerClosedError | None = None

    def clears(self) -> int:
        return self.cleared

    def closed_error(self) -> ManagerClosedError | None:
        return self.closed

    def torch_samples(
        self, batch_size: int, *, num_workers: Any, convert: Any, pack: Any, with_info: bool
    ) -> Iterator[tuple[Any, Any]]:
        self.requests.append(batch_size)
        while True:
            n = torch.arange(self.drawn, self.drawn + batch_size)
            self.drawn += batch_size
            x = (self.table * 1000 + n).to(torch.float32).reshape(batch_size, 1, 1)
            info = None
            if with_info:
                keys = torch.tensor([KEY_BASE + int(i) for i in n], dtype=torch.uint64)
                info = (
                    keys,
                    torch.full([batch_size], 0.5, dtype=torch.float64),
                    torch.full([batch_size], 10 + self.table, dtype=torch.int64),
                    torch.ones(batch_size, dtype=torch.float64),
                    torch.ones(batch_size, dtype=torch.int32),
                )
            yield pack(pack.prepare([x])), info


def mix(weights: dict[str, float], seed: int | None = 0, **sources: CountingSource):
    total = sum(weights.values())
    return MixedSampleSource(
        sources,
        {name: w / total for name, w in weights.items()},
        {name: i for i, name in enumerate(weights)},
        seed=seed,
    )


def batches(source: MixedSampleSource, count: int, batch_size: int = 8, **kwargs):
    stream = source.torch_samples(batch_size, **kwargs)
    return [next(stream) for _ in range(count)]


def test_items_come_from_their_tables_in_sampled_order_with_their_info():
    a, b = CountingSource(0), CountingSource(1)
    source = mix({"a": 3.0, "b": 1.0}, a=a, b=b)
    assert source.info_type is MixedSampleInfo and source.table_name == "a+b"
    seen: dict[int, list[int]] = {0: [], 1: []}
    for data, info in batches(source, 20):
        key, _, table_size, _, _, table = info
        assert key.dtype == torch.uint64 and table.dtype == torch.int64
        x = data["x"].reshape(-1).to(torch.int64)
        assert torch.equal(x // 1000, table)  # the data's table is the one the info names
        assert torch.equal(table_size, 10 + table)
        keys = key.view(torch.int64).numpy().view(np.uint64)
        for t in (0, 1):
            rows = x[table == t] % 1000
            assert [KEY_BASE + int(i) for i in rows] == keys[(table == t).numpy()].tolist()
            seen[t] += rows.tolist()
    for t in (0, 1):  # every item once, in order: leftovers of a chunk are used by later batches
        assert seen[t] == list(range(len(seen[t])))
    assert 0.6 < len(seen[0]) / 160 < 0.9
    assert (a.requests, b.requests) == ([6], [2])  # ceil(8 * p) items per chunk


def test_a_seed_repeats_the_choice_of_tables():
    def tables(seed):
        source = mix({"a": 1.0, "b": 1.0}, seed=seed, a=CountingSource(0), b=CountingSource(1))
        return [info[-1].tolist() for _, info in batches(source, 5)]

    assert tables(3) == tables(3)
    assert tables(3) != tables(4)


def test_positions_follow_the_weights_order_and_zero_weight_tables_are_left_out():
    b = CountingSource(1)
    source = MixedSampleSource({"b": b}, {"b": 1.0}, {"b": 2}, seed=0)
    (data, info), *_ = batches(source, 1)
    assert info[-1].tolist() == [2] * 8
    assert data["x"].reshape(-1).tolist() == [1000.0 + i for i in range(8)]


def test_without_info_only_the_data_is_yielded():
    source = mix({"a": 1.0, "b": 1.0}, a=CountingSource(0), b=CountingSource(1))
    for data, info in batches(source, 3, with_info=False):
        assert info is None and data["x"].shape == (8, 1, 1)


def test_convert_and_pack_apply_to_the_mixed_batch():
    source = mix({"a": 1.0, "b": 1.0}, a=CountingSource(0), b=CountingSource(1))
    pack = item_packer({"y": ArraySpec((1,), np.float32)})
    (data, _), *_ = batches(source, 1, convert=lambda t: t * 2, pack=pack)
    assert set(data) == {"y"}
    assert all(v % 2 == 0 for v in data["y"].reshape(-1).tolist())


def test_items_drawn_before_a_clear_are_dropped():
    a, b = CountingSource(0), CountingSource(1)
    source = mix({"a": 1.0, "b": 1.0}, seed=0, a=a, b=b)
    stream = source.torch_samples(4)
    _, info = next(stream)  # each source drew a chunk of 2; the batch used 4 of those items
    assert sorted(info[-1].tolist()) != [0, 0, 1, 1]  # so one table has items left over
    a.drawn = b.drawn = 100  # what the sources sample after the clear
    a.cleared += 1
    for _ in range(3):
        data, _ = next(stream)
        assert all(x % 1000 >= 100 for x in data["x"].reshape(-1).tolist())


def test_closed_error_is_the_first_closed_sources():
    a, b = CountingSource(0), CountingSource(1)
    source = mix({"a": 1.0, "b": 1.0}, a=a, b=b)
    assert source.closed_error() is None
    b.closed = ManagerClosedError("b closed")
    assert source.closed_error() is b.closed
    a.closed = ManagerClosedError("a closed")
    assert source.closed_error() is a.closed


@pytest.mark.parametrize("seed", [-1, 1.5, True, "7"])
def test_a_bad_seed_is_refused_naming_it(seed):
    with pytest.raises(ConfigError, match="seed") as raised:
        mix({"a": 1.0}, seed=seed, a=CountingSource(0))
    assert repr(seed) in str(raised.value)

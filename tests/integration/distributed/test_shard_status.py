"""A sharded buffer's status: every shard's tables read from real Reverb servers, the sharded
table's totals, the report's text, and `on_every_shard`'s order and errors."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
import reverb

from replay_service.distributed.shard_status import (
    format_sharded_status,
    on_every_shard,
    sharded_status,
)
from replay_service.errors import ServerUnavailableError, SpecMismatchError

TABLE = "uniform_table"


def _table(name: str, max_size: int, sampler: object) -> reverb.Table:
    return reverb.Table(
        name=name,
        sampler=sampler,
        remover=reverb.selectors.Fifo(),
        max_size=max_size,
        rate_limiter=reverb.rate_limiters.MinSize(1),
    )


@pytest.fixture(scope="module")
def shards() -> Iterator[list[str]]:
    """Two servers serving TABLE (uniform 10 and prioritized 20 items, 3 and 5 inserted), the
    second also an `other` table."""
    servers = [
        reverb.Server([_table(TABLE, 10, reverb.selectors.Uniform())]),
        reverb.Server(
            [
                _table(TABLE, 20, reverb.selectors.Prioritized(0.8)),
                _table("other", 7, reverb.selectors.Uniform()),
            ]
        ),
    ]
    addresses = [f"localhost:{server.port}" for server in servers]
    for address, count in zip(addresses, (3, 5), strict=True):
        client = reverb.Client(address)
        for i in range(count):
            client.insert([np.float32(i)], {TABLE: 1.0})
    yield addresses
    for server in servers:
        server.stop()


def test_totals_sum_the_shards_counters_and_join_their_distinct_selectors(shards) -> None:
    status = sharded_status(shards, TABLE, timeout=5.0)
    assert [s.address for s in status.shards] == shards
    assert [[t.name for t in s.tables] for s in status.shards] == [[TABLE], ["other", TABLE]]
    total = status.total
    assert (total.name, total.size, total.capacity, total.inserts) == (TABLE, 8, 30, 8)
    assert total.sampler == "uniform/prioritized(exponent=0.8)"
    assert total.remover == "fifo"  # the same on both shards: named once


def test_a_shard_without_the_table_is_named_with_its_tables(shards) -> None:
    with pytest.raises(SpecMismatchError, match=rf"shard '{shards[0]}' has no table 'other'"):
        sharded_status(shards, "other", timeout=5.0)


def test_the_report_gives_the_totals_then_every_shards_tables(shards) -> None:
    text = format_sharded_status(sharded_status(shards, TABLE, timeout=5.0)).splitlines()
    assert text[0].startswith(f"sharded buffer, 2 shard(s), total table {TABLE}: 8/30 items")
    assert text[1] == f"  shard 0 {shards[0]}"
    assert text[2].startswith(f"    table {TABLE}: 3/10 items, 3 inserts")
    assert text[3] == f"  shard 1 {shards[1]}"
    assert [line.split(":")[0] for line in text[4:]] == ["    table other", f"    table {TABLE}"]


@pytest.mark.heavy
def test_a_shard_that_does_not_answer_is_an_unavailable_error(shards) -> None:
    from replay_service.backends.reverb.connection import pick_free_port

    with pytest.raises(ServerUnavailableError):
        sharded_status([shards[0], f"localhost:{pick_free_port()}"], TABLE, timeout=0.3)


def test_on_every_shard_runs_in_parallel_and_keeps_shard_order() -> None:
    barrier = threading.Barrier(3, timeout=5)

    def call(index: int, shard: str) -> str:
        barrier.wait()  # all three at once, or the barrier breaks
        return f"{index}{shard}"

    assert on_every_shard(["a", "b", "c"], call) == ["0a", "1b", "2c"]


def test_on_every_shard_raises_the_lowest_failing_shards_error(caplog) -> None:
    def call(index: int, shard: str) -> str:
        if index:
            raise ValueError(f"shard {shard} broke")
        return shard

    with pytest.raises(ValueError, match="shard b broke"):
        on_every_shard(["a", "b", "c"], call)
    assert "shard 2 failed too: shard c broke" in caplog.text
    assert on_every_shard(["only"], lambda i, s: (i, s)) == [(0, "only")]

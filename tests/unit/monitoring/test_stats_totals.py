"""`stats`: a sharded table's totals and the ratios every `TableStats` carries, and the JSON
shape `BufferStats.to_json()` writes (no server: the tables are built by hand).
Imports no TensorFlow, TF-Agents or Reverb.
"""

from __future__ import annotations

import dataclasses

import pytest

from replay_service.errors import ConfigError
from replay_service.monitoring.report import TableReport, table_line
from replay_service.monitoring.stats import (
    BufferStats,
    RateLimiterStats,
    TableStats,
    samples_per_insert,
    total_table,
)

pytestmark = pytest.mark.local

STATS_KEYS = {
    "name",
    "size",
    "capacity",
    "fill_ratio",
    "inserts",
    "samples",
    "inserts_per_s",
    "samples_per_s",
    "samples_per_insert",
    "window_samples_per_insert",
    "rate_limiter",
    "layout",
}


def limiter(blocked: float | None, diff: float) -> RateLimiterStats:
    """A shard's rate limiter: inserts blocked 100 ms, samples 50 ms."""
    return RateLimiterStats(
        samples_per_insert=2.0,
        min_diff=None,
        max_diff=10.0,
        min_size_to_sample=4,
        diff=diff,
        insert_blocked_ms=100,
        sample_blocked_ms=50,
        insert_blocked_fraction=blocked,
        sample_blocked_fraction=blocked,
    )


def shard(
    size: int, inserts: int, samples: int, rate: float | None, layout: str | None
) -> TableStats:
    """Shard stats of table "t" (capacity 100) with these counts, rates and layout."""
    return TableStats(
        name="t",
        size=size,
        capacity=100,
        fill_ratio=size / 100,
        inserts=inserts,
        samples=samples,
        inserts_per_s=rate,
        samples_per_s=None if rate is None else 2 * rate,
        samples_per_insert=samples / inserts,
        window_samples_per_insert=2.0,
        rate_limiter=limiter(None if rate is None else 0.5, 1.0),
        layout=layout,
    )


def test_samples_per_insert_is_none_before_the_first_insert() -> None:
    assert samples_per_insert(3, 2) == 1.5
    assert samples_per_insert(0, 0) is None


def test_total_table_sums_the_shards_and_recomputes_the_ratios() -> None:
    total = total_table("t", [shard(30, 40, 10, 4.0, "nested"), shard(50, 60, 90, 6.0, "nested")])
    assert total == TableStats(
        name="t",
        size=80,
        capacity=200,
        fill_ratio=0.4,
        inserts=100,
        samples=100,
        inserts_per_s=10.0,
        samples_per_s=20.0,
        samples_per_insert=1.0,
        window_samples_per_insert=2.0,
        rate_limiter=dataclasses.replace(
            limiter(0.5, 2.0), insert_blocked_ms=200, sample_blocked_ms=100
        ),
        layout="nested",
    )


def test_a_shard_without_a_rate_or_inserts_leaves_them_unknown() -> None:
    empty = dataclasses.replace(shard(0, 1, 0, None, None), inserts=0, samples_per_insert=None)
    total = total_table("t", [empty, shard(10, 10, 5, 1.0, "packed")])
    assert total.inserts_per_s is None and total.window_samples_per_insert is None
    assert total.samples_per_insert == 0.5
    assert total.layout == "None/packed"
    only = total_table("t", [empty])
    assert only.samples_per_insert is None and only.fill_ratio == 0.0


def test_total_table_of_no_shards_is_refused() -> None:
    with pytest.raises(ConfigError, match="no shard stats to sum for table 't'"):
        total_table("t", [])


def test_the_stats_json_has_no_fields_of_the_status_report() -> None:
    """`TableStats` and `TableReport` stay two types: the stats JSON keeps its keys."""
    stats = BufferStats("host:1", 0.0, None, (shard(1, 1, 1, 1.0, "nested"),), None)
    (table,) = stats.to_json()["tables"]
    assert set(table) == STATS_KEYS
    report = TableReport("t", 1, 4, 2, 3, "uniform", "fifo")
    assert report.samples_per_insert == 1.5
    assert table_line(report) == (
        "table t: 1/4 items, 2 inserts, 3 samples, samples/insert 1.50, sampler uniform, "
        "remover fifo, layout none"
    )
    assert "samples/insert n/a" in table_line(dataclasses.replace(report, inserts=0))

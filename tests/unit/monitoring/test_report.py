"""`monitoring.report`: each table's counters and selectors as `replay-server status` prints
them, from the `TableInfo`s a server gives (built here, no server), and the last checkpoint.

`tests/unit/monitoring/test_stats_totals.py` checks `table_line` and the shard totals.
"""

from __future__ import annotations

import json

import pytest
import tensorflow as tf
from reverb.cc import schema_pb2
from reverb.reverb_types import TableInfo

from replay_service.monitoring import report
from replay_service.monitoring.report import TableReport, format_status, server_status
from replay_service.storage.directory import CHECKPOINT_META_FILE, CHECKPOINTS_DIR, STORE_FILE
from replay_service.storage.files import DONE_FILE
from replay_service.storage.metadata import FORMAT, StoreMetadata

Options = schema_pb2.KeyDistributionOptions


def info(name: str, sampler: Options, remover: Options, signature=None, **counts) -> TableInfo:
    limiter = schema_pb2.RateLimiterInfo(
        insert_stats=schema_pb2.RateLimiterCallStats(completed=counts.get("inserts", 0)),
        sample_stats=schema_pb2.RateLimiterCallStats(completed=counts.get("samples", 0)),
    )
    return TableInfo(
        name=name,
        sampler_options=sampler,
        remover_options=remover,
        max_size=counts.get("capacity", 10),
        max_times_sampled=0,
        rate_limiter_info=limiter,
        signature=signature,
        current_size=counts.get("size", 0),
        num_episodes=0,
        num_deleted_episodes=0,
        num_unique_samples=0,
        table_worker_time=schema_pb2.TableWorkerTime(),
    )


@pytest.fixture()
def served(monkeypatch):
    """Makes `server_status` read the given infos, recording the address and timeout."""
    asked = {}

    def serve(infos):
        monkeypatch.setattr(report, "connect", lambda address, timeout: (address, timeout))

        def server_info(client, timeout):
            asked["client"], asked["timeout"] = client, timeout
            return {i.name: i for i in infos}

        monkeypatch.setattr(report, "server_info", server_info)
        return asked

    return serve


def test_server_status_reads_each_tables_counters_sorted_by_name(served):
    fifo = Options(fifo=True, is_deterministic=True)
    prioritized = Options(prioritized=Options.Prioritized(priority_exponent=0.6))
    packed = tf.TensorSpec([2, 40], tf.uint8)
    asked = served(
        [
            info("b", prioritized, fifo, packed, size=3, capacity=8, inserts=5, samples=9),
            info("a", Options(uniform=True), Options(heap=Options.Heap(min_heap=True))),
            info("c", Options(heap=Options.Heap(min_heap=False)), Options(lifo=True), {}),
        ]
    )
    tables = server_status("host:1", timeout=2.5)
    assert asked == {"client": ("host:1", 2.5), "timeout": 2.5}
    assert tables == [
        TableReport("a", 0, 10, 0, 0, "uniform", "min_heap", "none"),
        TableReport("b", 3, 8, 5, 9, "prioritized(exponent=0.6)", "fifo", "packed"),
        TableReport("c", 0, 10, 0, 0, "max_heap", "lifo", "nested"),
    ]
    assert tables[1].samples_per_insert == pytest.approx(1.8)


def test_a_selector_without_a_kind_is_unknown(served):
    served([info("t", Options(), Options(is_deterministic=True))])
    (table,) = server_status("host:1")
    assert (table.sampler, table.remover) == ("unknown", "unknown")


def test_format_status_lists_tables_and_says_where_the_checkpoint_is_unknown():
    tables = [TableReport("t", 1, 4, 2, 3, "uniform", "fifo", "nested")]
    assert format_status("host:1", tables, None).splitlines() == [
        "server host:1",
        "  table t: 1/4 items, 2 inserts, 3 samples, samples/insert 1.50, sampler uniform, "
        "remover fifo, layout nested",
        "  last checkpoint: unknown (pass --checkpoint_dir to read it)",
    ]


def test_format_status_reads_the_last_checkpoint_of_the_directory(tmp_path):
    assert format_status("h:1", [], str(tmp_path)).splitlines()[-1] == "  last checkpoint: none"
    (tmp_path / STORE_FILE).write_text(json.dumps(StoreMetadata("t", 2, 10, []).to_json()))
    for sequence, items in ((1, 3), (2, 7)):
        path = tmp_path / CHECKPOINTS_DIR / f"ckpt-{sequence:08d}"
        path.mkdir(parents=True)
        (path / DONE_FILE).write_text("")
        meta = {"format": FORMAT, "created_at": f"day {sequence}", "num_items": items}
        (path / CHECKPOINT_META_FILE).write_text(json.dumps(meta))
    assert format_status("h:1", [], str(tmp_path)).splitlines() == [
        "server h:1",
        f"  last checkpoint: {path} (day 2, 7 items)",
    ]

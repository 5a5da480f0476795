"""`stats()`: fill level, rates, rate limiter blocking and the last checkpoint, on real servers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import reverb

from conftest import FAST_TIMEOUTS, REPO, collect, wait_for_adoption
from replay_service import BufferStateError, ReplayBufferManager, SamplingConfig
from replay_service.distributed.shard_config import ShardedConfig
from replay_service.distributed.sharding import ShardedReplayBuffer
from replay_service.monitoring.stats import StatsTracker, scalars

TABLE = "uniform_table"


def _bytes_on_disk(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(path, name))
        for name in os.listdir(path)
        if not name.endswith(".json")
    )


@pytest.mark.heavy
def test_manager_stats_report_size_rates_samples_and_checkpoint(make_manager, env, policy):
    manager = make_manager()
    with pytest.raises(BufferStateError, match="create_replay_buffer"):
        manager.stats()
    _, observer = manager.create_replay_buffer()
    started = time.monotonic()
    collect(env, policy, observer, 60)
    size = manager.num_frames()
    list(manager.py_client.sample(TABLE, num_samples=25, emit_timesteps=False))
    time.sleep(0.5)
    path = manager.checkpoint()
    stats = manager.stats()
    elapsed = time.monotonic() - started

    table = stats.table(TABLE)
    assert (table.size, table.capacity, table.inserts) == (size, 1000, size)
    assert table.samples == 25
    assert table.fill_ratio == pytest.approx(size / 1000)
    assert table.samples_per_insert == pytest.approx(25 / size)
    # Every insert and sample happened inside the window, which began at create_replay_buffer.
    assert stats.window_s is not None and stats.window_s >= elapsed - 0.05
    assert table.inserts_per_s == pytest.approx(size / stats.window_s)
    assert table.samples_per_s == pytest.approx(25 / stats.window_s)
    assert table.window_samples_per_insert == pytest.approx(25 / size)
    assert table.rate_limiter.samples_per_insert == 1.0
    assert table.rate_limiter.diff == size - 25

    checkpoint = stats.checkpoint
    assert checkpoint is not None and checkpoint.path == path
    assert checkpoint.num_items == size
    assert checkpoint.bytes == _bytes_on_disk(path) > 0
    assert checkpoint.duration_s is not None and 0 < checkpoint.duration_s < 30
    assert abs(checkpoint.timestamp - time.time()) < 30

    flat = scalars(stats)
    assert flat[f"{TABLE}/size"] == size
    assert flat["checkpoint/bytes"] == checkpoint.bytes
    json.dumps(stats.to_json())  # serializable as it is


@pytest.mark.heavy
def test_rates_cover_only_the_recent_window(make_manager, env, policy):
    manager = make_manager()
    _, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 40)
    first = manager.num_frames()
    tracker = StatsTracker(manager.py_client, timeout=5.0, window_s=0.6, min_span_s=0.3)
    tracker.read()
    time.sleep(0.8)  # the writes above fall out of the window; nothing new is written
    quiet = tracker.read().table(TABLE)
    assert quiet.inserts == first and quiet.inserts_per_s == 0.0
    assert quiet.window_samples_per_insert is None


@pytest.mark.heavy
def test_rate_limiter_blocking_is_reported(make_manager, env, policy):
    manager = make_manager(sampling=SamplingConfig(min_size_to_sample=50))
    manager.create_replay_buffer()
    client = reverb.Client(manager.server_address)
    blocked = threading.Thread(
        target=lambda: list(client.sample(TABLE, num_samples=1, emit_timesteps=False)),
        daemon=True,
    )
    before = manager.stats().table(TABLE).rate_limiter
    assert before.sample_blocked_ms == 0
    blocked.start()  # waits for 50 items: the rate limiter holds it back
    time.sleep(1.5)
    after = manager.stats().table(TABLE).rate_limiter
    assert after.min_size_to_sample == 50
    assert after.sample_blocked_ms >= 1000
    assert after.sample_blocked_fraction is not None and after.sample_blocked_fraction > 0.3
    assert after.insert_blocked_ms == 0
    _, observer = manager.get_replay_buffer_and_observer()
    collect(env, policy, observer, 60)  # releases the blocked sample
    blocked.join(timeout=10)
    assert not blocked.is_alive()


def test_sharded_stats_sum_the_shards(make_manager, data_spec, env, policy, tmp_path):
    shards = [make_manager(checkpoint_dir=str(tmp_path / f"shard{i}")) for i in range(2)]
    for shard in shards:
        shard.create_replay_buffer()
    config = ShardedConfig(addresses=tuple(s.server_address for s in shards))
    with ShardedReplayBuffer(config, data_spec, capacity=1000).load() as sharded:
        collect(env, policy, sharded.observer(0), 30)
        collect(env, policy, sharded.observer(1), 50)
        sizes = [shard.num_frames() for shard in shards]
        stats = sharded.stats()
    assert [s.table(TABLE).size for s in stats.shards] == sizes
    assert stats.total.size == stats.total.inserts == sum(sizes)
    assert stats.total.capacity == 2000
    assert stats.total.inserts_per_s == pytest.approx(
        sum(s.table(TABLE).inserts_per_s for s in stats.shards)
    )
    assert all(s.table(TABLE).inserts_per_s > 0 for s in stats.shards)
    assert json.loads(json.dumps(stats.to_json()))["total"]["size"] == sum(sizes)


@pytest.mark.heavy
def test_status_json_of_a_running_server(start_server, tmp_path, env, policy, data_spec):
    _, address = start_server("--checkpoint_interval_s=0")
    collector = ReplayBufferManager(
        data_spec, 100_000, server_address=address, timeouts=FAST_TIMEOUTS
    )
    try:
        _, observer = collector.load_replay_buffer()
        collect(env, policy, observer, 30)
        count = collector.num_frames()
        collector.checkpoint()
    finally:
        collector.close()
    wait_for_adoption(tmp_path / "server_ckpt")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "replay_service.cli.serve",
            "status",
            "--json",
            "--rate_span_s=0.5",
            f"--address={address}",
            f"--checkpoint_dir={tmp_path / 'server_ckpt'}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    stats = json.loads(result.stdout)
    (table,) = stats["tables"]
    assert (table["name"], table["size"], table["capacity"]) == (TABLE, count, 100_000)
    assert table["layout"] == "nested"  # a new replay-server's table
    assert table["inserts"] == count and table["inserts_per_s"] == 0.0
    assert stats["window_s"] == pytest.approx(0.5, abs=0.3)
    assert stats["checkpoint"]["num_items"] == count
    assert stats["checkpoint"]["path"].endswith("ckpt-00000001")
    assert stats["checkpoint"]["bytes"] == _bytes_on_disk(stats["checkpoint"]["path"])

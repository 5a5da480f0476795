"""Shards and collectors as Ray actors on a local Ray instance; a shard killed and restarted."""

from __future__ import annotations

import os
import signal
import time

import pytest

ray = pytest.importorskip("ray", reason="needs the 'ray' extra (ray[default])")

from conftest import CARTPOLE_CONFIG, FAST_TIMEOUTS, REPO
from replay_service.distributed.ray_cluster import start_collector, start_shards
from replay_service.distributed.sharding import ShardedReplayBuffer

CAPACITY = 100_000  # configs/cartpole.toml
INTERVAL_S = 1.0


@pytest.fixture()
def local_ray():
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "2"}},
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_killed_shard_restarts_from_its_checkpoint_without_losing_confirmed_items(
    local_ray, tmp_path, data_spec
):
    shards = start_shards(
        CARTPOLE_CONFIG,
        2,
        tmp_path / "shards",
        checkpoint_interval_s=INTERVAL_S,
        num_cpus=0.5,
        start_timeout_s=180,
    )
    try:
        config = shards.config
        assert config.num_shards == 2 and len(set(config.addresses)) == 2
        collectors = [
            start_collector(config, i, data_spec, CAPACITY, timeouts=FAST_TIMEOUTS, num_cpus=0.5)
            for i in range(2)
        ]
        confirmed = ray.get([c.collect.remote(200) for c in collectors], timeout=180)
        assert all(n > 0 for n in confirmed)
        before = shards.wait_ready(0)
        assert before["restored_from"] is None  # started empty

        # Documented loss window: one checkpoint interval plus one checkpoint. Wait past it,
        # so every item confirmed above must be in a checkpoint, then kill shard 0's process.
        time.sleep(INTERVAL_S + 2.0)
        os.kill(before["pid"], signal.SIGKILL)
        after = shards.wait_restarted(0, before["pid"], timeout=180)
        assert after["address"] == config.addresses[0]  # same port: the config stays valid
        assert after["restored_from"] is not None
        assert after["restored_items"] == confirmed[0]

        with ShardedReplayBuffer(config, data_spec, CAPACITY, timeouts=FAST_TIMEOUTS).load() as b:
            assert b.shard_sizes() == dict(zip(config.addresses, confirmed, strict=True))
        # The old collector's connection died with the server; a new one writes to the
        # restarted shard (in the CPUs the old ones free).
        for collector in collectors:
            ray.kill(collector)
        fresh = start_collector(
            config, 0, data_spec, CAPACITY, timeouts=FAST_TIMEOUTS, num_cpus=0.5
        )
        assert ray.get(fresh.collect.remote(50), timeout=120) > confirmed[0]
    finally:
        finals = shards.stop(timeout=120)
    assert all(path is not None and "ckpt-" in path for path in finals)

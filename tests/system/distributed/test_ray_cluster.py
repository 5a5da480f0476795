"""Shards and collectors as Ray actors on a local Ray instance of 2 CPUs: the recipe of
docs/operations.md, a shard killed and restarted, actors that Ray cannot place."""

from __future__ import annotations

import os
import re
import signal
import time
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="needs the 'ray' extra (ray[default])")

from conftest import CARTPOLE_CONFIG, FAST_TIMEOUTS, REPO
from readme_blocks import DOCS, doc_block, shrink
from replay_service import ReplayBufferManager
from replay_service.distributed.ray_cluster import start_collector, start_shards
from replay_service.distributed.shard_config import ShardedConfig
from replay_service.distributed.sharding import ShardedReplayBuffer
from replay_service.errors import ConfigError, ReplayServiceError, ServerUnavailableError

CAPACITY = 100_000  # configs/cartpole.toml
INTERVAL_S = 1.0
# A laptop-sized Ray instance, whatever this machine has.
RAY_INIT_KWARGS = {
    "num_cpus": 2,
    "include_dashboard": False,
    "log_to_driver": False,
    "runtime_env": {"env_vars": {"PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "2"}},
}


@pytest.fixture()
def local_ray():
    ray.init(**RAY_INIT_KWARGS)
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


@pytest.mark.slow
@pytest.mark.timeout(400, method="thread")  # ray.get ignores SIGALRM
def test_readme_ray_recipe_runs_on_two_cpus(tmp_path: Any, monkeypatch: Any) -> None:
    # Two shards and four collectors on 2 CPUs: with a whole CPU reserved per actor, the
    # collectors were never placed and ray.get waited forever.
    monkeypatch.chdir(REPO)  # the recipe names configs/cartpole.toml
    root = tmp_path / "replay"
    code = shrink(
        doc_block(DOCS / "operations.md", "## Ray"),
        {
            "ray.init()": f"ray.init(**{RAY_INIT_KWARGS!r})",
            '"runs/ray/replay"': repr(str(root)),
            "collect.remote(1000)": "collect.remote(60)",
        },
    )
    namespace: dict[str, Any] = {}
    try:
        exec(compile(code, str(DOCS / "operations.md"), "exec"), namespace)
    finally:
        ray.shutdown()
    sizes = namespace["sizes"]
    assert list(sizes) == list(namespace["shards"].config.addresses)
    assert all(n > 0 for n in sizes.values())
    # shards.stop() left every shard's items in its final checkpoint.
    for i, size in enumerate(sizes.values()):
        with ReplayBufferManager(
            namespace["data_spec"], CAPACITY, checkpoint_dir=str(root / f"shard-{i}")
        ) as manager:
            manager.load_replay_buffer()
            assert manager.num_frames() == size


def test_shard_that_ray_cannot_place_fails_within_its_bound(local_ray, tmp_path):
    began = time.monotonic()
    with pytest.raises(ServerUnavailableError) as caught:
        start_shards(CARTPOLE_CONFIG, 2, tmp_path / "shards", num_cpus=3, start_timeout_s=5)
    assert time.monotonic() - began < 30
    message = str(caught.value)
    for part in ("shard 0", "shard 1", "5 s", "{'CPU': 3.0}", "'CPU': 2.0", "num_cpus"):
        assert part in message
    assert not (tmp_path / "shards").exists() or not any((tmp_path / "shards").iterdir())
    # The pending actors were killed: the CPUs are free for shards that fit.
    assert ray.available_resources().get("CPU") == 2.0


def test_a_bad_start_timeout_is_refused_before_any_actor_starts(local_ray, tmp_path, data_spec):
    config = ShardedConfig(addresses=("localhost:1", "localhost:2"))
    for timeout in (float("nan"), -1, 0, None, float("inf"), True, "5"):
        expected = rf"start_timeout_s must be a finite number > 0 .*got {re.escape(repr(timeout))}"
        with pytest.raises(ConfigError, match=expected):
            start_shards(CARTPOLE_CONFIG, 2, tmp_path / "shards", start_timeout_s=timeout)
        with pytest.raises(ConfigError, match=expected):
            start_collector(config, 0, data_spec, CAPACITY, start_timeout_s=timeout)
    assert not (tmp_path / "shards").exists()
    assert ray.available_resources().get("CPU") == 2.0  # no actor holds a reservation


def test_collector_that_ray_cannot_place_fails_within_its_bound(local_ray, data_spec):
    config = ShardedConfig(addresses=("localhost:1", "localhost:2"))
    began = time.monotonic()
    with pytest.raises(ReplayServiceError) as caught:
        start_collector(config, 3, data_spec, CAPACITY, num_cpus=2.5, start_timeout_s=3)
    assert time.monotonic() - began < 30
    message = str(caught.value)
    for part in ("collector 3 (shard localhost:2)", "3 s", "{'CPU': 2.5}", "'CPU': 2.0"):
        assert part in message

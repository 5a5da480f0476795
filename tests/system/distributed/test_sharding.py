"""A buffer sharded over several real `replay-server` subprocesses on loopback ports."""

from __future__ import annotations

import collections
import os
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest
import reverb
import tensorflow as tf
from tf_agents.trajectories import trajectory as trajectory_lib

from conftest import CARTPOLE_CONFIG, CONFIGS, ServerProcess
from replay_service import (
    BufferStateError,
    CheckpointExistsError,
    ConfigError,
    ManagerClosedError,
    ServerUnavailableError,
    Timeouts,
)
from replay_service.backends.reverb.connection import pick_free_port
from replay_service.backends.reverb.sampling_errors import EMPTY_BUFFER_MESSAGE
from replay_service.distributed.shard_config import ShardedConfig, load_sharded_config
from replay_service.distributed.shard_status import format_sharded_status
from replay_service.distributed.sharding import (
    ShardedReplayBuffer,
    block_size,
    find_adopted_checkpoint,
)
from replay_service.storage.files import DONE_FILE

TABLE = "uniform_table"
CAPACITY = 100_000  # configs/cartpole.toml
NUM_SHARDS = 3
TIMEOUTS = Timeouts(connect=10.0, write=10.0, sample=1.0, checkpoint=60.0)
ADOPT_WAIT_S = 15.0
WRITE_LIMIT_S = 5.0  # 1000 items take well under a second
MID = 1


class Shard:
    """One running shard server."""

    def __init__(self, process: ServerProcess, address: str, checkpoint_dir: str) -> None:
        self.process = process
        self.address = address
        self.checkpoint_dir = checkpoint_dir

    def size(self) -> int:
        """Items in the table, read with a plain Reverb client."""
        return int(reverb.Client(self.address).server_info(timeout=5)[TABLE].current_size)

    def observation_values(self, num_samples: int = 300) -> set[float]:
        """observation[0] of sampled items, read with a plain Reverb client."""
        samples = reverb.Client(self.address).sample(TABLE, num_samples, emit_timesteps=False)
        return {float(np.asarray(s.data[1])[0, 0]) for s in samples}


def _launch(root: str, name: str) -> Shard:
    port = pick_free_port()
    checkpoint_dir = os.path.join(root, name)
    process = ServerProcess(
        f"--config={CARTPOLE_CONFIG}",
        f"--port={port}",
        f"--checkpoint_dir={checkpoint_dir}",
        "--checkpoint_interval_s=0",
    )
    return Shard(process, f"localhost:{port}", checkpoint_dir)


def _stop(shards: list[Shard]) -> None:
    for shard in shards:
        if shard.process.proc.poll() is None:
            shard.process.proc.kill()
        shard.process.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[list[Shard]]:
    """NUM_SHARDS shard servers plus one more that a test may kill, all started at once."""
    root = str(tmp_path_factory.mktemp("shards"))
    shards = [_launch(root, f"shard{i}") for i in range(NUM_SHARDS + 1)]
    try:
        for shard in shards:
            shard.process.wait_listening()
        yield shards
    finally:
        _stop(shards)


@pytest.fixture()
def shards(servers, data_spec) -> Iterator[ShardedReplayBuffer]:
    """A sharded buffer over the first NUM_SHARDS servers, emptied first."""
    config = ShardedConfig(tuple(s.address for s in servers[:NUM_SHARDS]))
    buffer = ShardedReplayBuffer(config, data_spec, CAPACITY, timeouts=TIMEOUTS)
    with buffer.create(overwrite=True):
        yield buffer


def step(value: float) -> trajectory_lib.Trajectory:
    """A CartPole-shaped step whose observation is `value` everywhere (one endless episode)."""
    return trajectory_lib.Trajectory(
        step_type=np.int32(MID),
        observation=np.full([4], value, np.float32),
        action=np.int64(0),
        policy_info=(),
        next_step_type=np.int32(MID),
        reward=np.float32(0.0),
        discount=np.float32(1.0),
    )


def write(shards: ShardedReplayBuffer, collector_id: int, items: int) -> None:
    """Writes `items` 2-step items through collector `collector_id`'s observer."""
    observer = shards.observer(collector_id)
    for _ in range(items + 1):
        observer(step(float(collector_id)))
    observer.flush()


def shard_of_samples(dataset: tf.data.Dataset, batches: int) -> collections.Counter:
    """Counts sampled items by the shard they came from (collector id % NUM_SHARDS)."""
    counts: collections.Counter = collections.Counter()
    for batch, _ in dataset.take(batches):
        counts.update(int(v) % NUM_SHARDS for v in batch.observation[:, 0, 0].numpy())
    return counts


# ------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"addresses": ["localhost:8000", "localhost:8000"]}, "'localhost:8000' twice"),
        ({"addresses": ["localhost:8000", "LOCALHOST:8000"]}, "'LOCALHOST:8000' twice"),
        ({"addresses": ["localhost"]}, "'localhost' is not a server address"),
        ({"addresses": ["localhost:port"]}, "'localhost:port' is not a server address"),
        ({"addresses": [":8000"]}, "':8000' is not a server address"),
        ({"addresses": ["localhost:70000"]}, "'localhost:70000' is not a server address"),
        ({"addresses": ["local host:8000"]}, "'local host:8000' is not a server address"),
        ({"addresses": [8000]}, "8000 is not a server address"),
        ({"addresses": []}, "at least one server, got []"),
        ({"addresses": "localhost:8000"}, "must be a list of 'host:port' strings"),
        ({}, "needs addresses"),
        ({"addresses": ["localhost:8000"], "shards": 2}, "unknown key sharding.'shards' (value 2)"),
    ],
)
def test_bad_sharding_sections_name_the_value(section, message):
    with pytest.raises(ConfigError) as info:
        ShardedConfig.from_dict(section, "test.toml")
    assert message in str(info.value)
    assert "test.toml" in str(info.value)


def test_toml_files_and_collector_mapping(tmp_path):
    config = load_sharded_config(os.path.join(CONFIGS, "sharded.toml"))
    assert config.num_shards >= 2
    path = tmp_path / "shards.toml"
    path.write_text('[sharding]\naddresses = ["localhost:8000", "127.0.0.1:8001", "[::1]:8002"]\n')
    config = load_sharded_config(path)
    assert config.addresses == ("localhost:8000", "127.0.0.1:8001", "[::1]:8002")
    assert [config.shard_index(i) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert config.address_for(4) == "127.0.0.1:8001"
    with pytest.raises(ConfigError, match="collector_id must be an integer >= 0, got -1"):
        config.shard_index(-1)
    path.write_text('[sharding]\naddresses = ["localhost:8000"]\nbogus = "x"\n')
    with pytest.raises(ConfigError, match=r"unknown key sharding.'bogus' \(value 'x'\)"):
        load_sharded_config(path)
    path.write_text("[server]\nport = 1\n")
    with pytest.raises(ConfigError, match=r"no \[sharding\] table"):
        load_sharded_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_sharded_config(tmp_path / "missing.toml")


# ------------------------------------------------------------------------------ servers


def test_collectors_spread_by_id_and_datasets_follow_shard_sizes(shards, servers):
    started = time.monotonic()
    for collector_id, items in ((0, 400), (3, 200), (1, 300), (2, 100)):
        write(shards, collector_id, items)
    # Without GRPC_POLL_STRATEGY=epoll1 (set when replay_service is imported), writing to the third
    # server of a process waited 5 s per flush for gRPC's backup poller.
    assert time.monotonic() - started < WRITE_LIMIT_S
    assert [s.size() for s in servers[:NUM_SHARDS]] == [600, 300, 100]
    assert servers[0].observation_values() == {0.0, 3.0}
    assert servers[1].observation_values() == {1.0}
    assert servers[2].observation_values() == {2.0}
    assert shards.shard_sizes() == dict(zip(shards.addresses, [600, 300, 100], strict=True))
    assert shards.num_frames() == 1000

    counts = shard_of_samples(shards.get_dataset(batch_size=100, seed=1), batches=20)
    assert set(counts) == {0, 1, 2}
    total = sum(counts.values())
    for shard, expected in ((0, 0.6), (1, 0.3), (2, 0.1)):
        assert abs(counts[shard] / total - expected) < 0.08, counts  # > 7 standard deviations


def test_reweighting_picks_up_a_shard_filled_later(shards):
    write(shards, 0, 200)
    dataset = shards.get_dataset(batch_size=50, reweight_every=2, seed=2)
    iterator = iter(dataset)
    first, _ = next(iterator)
    assert set(first.observation[:, 0, 0].numpy()) == {0.0}
    time.sleep(1.5)  # longer than Timeouts.sample: an unused empty shard must not fail
    write(shards, 1, 200)
    seen = set()
    for _ in range(10):
        batch, _ = next(iterator)
        seen.update(batch.observation[:, 0, 0].numpy())
    assert seen == {0.0, 1.0}
    fixed = shard_of_samples(shards.get_dataset(batch_size=50), batches=4)
    assert set(fixed) == {0, 1}


def test_an_empty_sharded_buffer_fails_like_a_single_server(shards):
    dataset = shards.get_dataset(batch_size=8)
    started = time.monotonic()
    with pytest.raises(tf.errors.InvalidArgumentError, match=EMPTY_BUFFER_MESSAGE):
        next(iter(dataset))
    assert time.monotonic() - started < 30


def test_status_totals_are_the_sum_of_the_shards(shards):
    write(shards, 0, 30)
    write(shards, 1, 20)
    next(iter(shards.get_dataset(batch_size=10)))
    status = shards.status()
    assert [s.address for s in status.shards] == list(shards.addresses)
    tables = [next(t for t in s.tables if t.name == TABLE) for s in status.shards]
    assert [t.size for t in tables] == [30, 20, 0]
    assert status.total.size == 50 == sum(t.size for t in tables)
    assert status.total.capacity == NUM_SHARDS * CAPACITY
    assert status.total.inserts == sum(t.inserts for t in tables)
    assert status.total.samples == sum(t.samples for t in tables) >= 10
    text = format_sharded_status(status)
    assert f"{NUM_SHARDS} shard(s), total table {TABLE}: 50/{NUM_SHARDS * CAPACITY} items" in text
    for index, address in enumerate(shards.addresses):
        assert f"shard {index} {address}" in text


def test_checkpoint_reaches_every_shard_under_one_id(shards, servers):
    write(shards, 0, 10)
    write(shards, 2, 5)
    record = shards.checkpoint("run-7-step-1000")
    assert record.checkpoint_id == "run-7-step-1000"
    assert list(record.paths) == list(shards.addresses)
    for shard in servers[:NUM_SHARDS]:
        path = record.paths[shard.address]
        assert path.startswith(shard.checkpoint_dir)
        deadline = time.monotonic() + ADOPT_WAIT_S
        while (adopted := find_adopted_checkpoint(shard.checkpoint_dir, path)) is None:
            assert time.monotonic() < deadline, f"{shard.address} did not adopt {path}"
            time.sleep(0.2)
        assert os.path.isfile(os.path.join(adopted.path, DONE_FILE))
        assert adopted.metadata.table_name == TABLE
        for _, _, files in os.walk(shard.checkpoint_dir):
            assert not any("run-7" in name for name in files)
    generated = shards.checkpoint()
    assert generated.checkpoint_id.startswith("sharded-")
    assert generated.checkpoint_id != record.checkpoint_id
    assert generated.to_json()["paths"] == dict(generated.paths)
    with pytest.raises(ConfigError, match="checkpoint_id must be a non-empty string, got ''"):
        shards.checkpoint("")


def test_lifecycle_errors(servers, data_spec):
    config = ShardedConfig((servers[0].address, servers[1].address))
    buffer = ShardedReplayBuffer(config, data_spec, CAPACITY, timeouts=TIMEOUTS)
    with pytest.raises(BufferStateError, match="call load"):
        buffer.observer(0)
    buffer.create(overwrite=True)
    write(buffer, 1, 3)
    with pytest.raises(BufferStateError, match="already attached"):
        buffer.load()
    buffer.close()
    buffer.close()
    with pytest.raises(ManagerClosedError):
        buffer.num_frames()
    again = ShardedReplayBuffer(config, data_spec, CAPACITY, timeouts=TIMEOUTS)
    with pytest.raises(CheckpointExistsError, match=servers[1].address):
        again.create()
    with ShardedReplayBuffer(config, data_spec, CAPACITY, timeouts=TIMEOUTS).load() as loaded:
        assert loaded.shard_sizes() == {servers[0].address: 0, servers[1].address: 3}


@pytest.mark.slow  # waits out the connect timeout three times: about 30 s
def test_a_shard_that_is_down_is_named_within_the_timeout(servers, data_spec):
    nobody = f"localhost:{pick_free_port()}"
    config = ShardedConfig((servers[0].address, nobody))
    started = time.monotonic()
    with pytest.raises(ServerUnavailableError, match=nobody):
        ShardedReplayBuffer(config, data_spec, CAPACITY, timeouts=TIMEOUTS).load()
    assert time.monotonic() - started < TIMEOUTS.connect + 10

    victim = servers[NUM_SHARDS]
    config = ShardedConfig((servers[0].address, victim.address))
    with ShardedReplayBuffer(config, data_spec, CAPACITY, timeouts=TIMEOUTS).load() as buffer:
        victim.process.proc.send_signal(signal.SIGKILL)
        victim.process.proc.wait(timeout=30)
        for call in (buffer.status, buffer.num_frames):
            started = time.monotonic()
            with pytest.raises(ServerUnavailableError, match=victim.address):
                call()
            assert time.monotonic() - started < TIMEOUTS.connect + 10


@pytest.mark.parametrize(
    ("batch_size", "block"), [(256, 16), (100, 5), (64, 4), (48, 3), (31, 1), (7, 1), (1, 1)]
)
def test_the_mixture_draws_a_shard_per_block_that_divides_the_batch(batch_size, block):
    assert block_size(batch_size) == block
    assert batch_size % block == 0 and batch_size // block >= min(batch_size, 16)

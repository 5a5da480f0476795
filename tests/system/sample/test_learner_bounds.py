"""Learners fail, not hang, when their server is lost: every sampling path, real servers.

A `replay-server` subprocess is killed (SIGKILL, SIGTERM) under iterators of every sampling
path, or an embedded manager is closed under them; `next()` must raise our error (or a
`tf.errors` error naming the server and the table) within `liveness.liveness_bound`.

The iterators live, and the servers die under them, in a child process (`run_child`):
Reverb's sampler retries a dead address forever and its iterator's destructor waits for it.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import tensorflow as tf

from conftest import child_main, child_request, collect, run_child
from replay_service import (
    ManagerClosedError,
    ReplayBufferManager,
    ServerUnavailableError,
    Timeouts,
)
from replay_service.backends.reverb.liveness import (
    MANAGER_CLOSED_MESSAGE,
    SERVER_LOST_MESSAGE,
    liveness_bound,
)
from replay_service.distributed.shard_config import ShardedConfig
from replay_service.distributed.sharding import ShardedReplayBuffer

# A regression must fail, not hang CI.
pytestmark = pytest.mark.timeout(180)

TABLE = "uniform_table"  # configs/cartpole.toml
CAPACITY = 100_000
TIMEOUTS = Timeouts(connect=2.0, write=2.0, sample=1.0, checkpoint=60.0)
BOUND = liveness_bound(TIMEOUTS.sample, TIMEOUTS.connect)
# The point is "does not hang": room for a loaded 2-core machine on top of the bound.
SLACK_S = 10.0
# After close() a dataset fails at its next watch round (a tenth of a second).
CLOSED_BOUND_S = 1.0
BATCH = 4
PATH_NAMES = (
    "get_dataset",
    "as_dataset",
    "mixed_dataset",
    "torch_batches",
    "torch_batches(prefetch=0)",
    "torch_dataset",
)


def test_the_documented_bound_holds_for_these_timeouts() -> None:
    assert (
        liveness_bound(TIMEOUTS.sample, TIMEOUTS.connect) <= 2 * TIMEOUTS.sample + TIMEOUTS.connect
    )
    default = Timeouts()
    assert liveness_bound(default.sample, default.connect) <= 2 * default.sample + default.connect


def time_to_error(iterator: Iterator[Any]) -> tuple[float, BaseException]:
    """Calls `next()` until it raises (prefetched batches come first); returns how long."""
    start = time.monotonic()
    try:
        while True:
            next(iterator)
    except Exception as e:  # the error under test
        return time.monotonic() - start, e


def sampling_paths(
    manager: ReplayBufferManager, replay_buffer: Any
) -> dict[str, tuple[Iterator[Any], type[BaseException], str]]:
    """One running iterator per sampling path, each with the error it must end with."""
    paths = {
        "get_dataset": (
            iter(manager.get_dataset(BATCH)),
            tf.errors.InvalidArgumentError,
            SERVER_LOST_MESSAGE,
        ),
        "as_dataset": (
            iter(replay_buffer.as_dataset(sample_batch_size=BATCH, num_steps=2)),
            tf.errors.InvalidArgumentError,
            SERVER_LOST_MESSAGE,
        ),
        "mixed_dataset": (
            iter(manager.mixed_dataset(BATCH, {TABLE: 1.0})),
            tf.errors.InvalidArgumentError,
            SERVER_LOST_MESSAGE,
        ),
        "torch_batches": (iter(manager.torch_batches(BATCH)), ServerUnavailableError, ""),
        "torch_batches(prefetch=0)": (
            iter(manager.torch_batches(BATCH, prefetch=0)),
            ServerUnavailableError,
            "",
        ),
        "torch_dataset": (iter(manager.torch_dataset(BATCH)), ServerUnavailableError, ""),
    }
    assert tuple(paths) == PATH_NAMES
    for iterator, _, _ in paths.values():
        next(iterator)  # sampling has started
    return paths


def check_fails_in_time(
    paths: dict[str, tuple[Iterator[Any], type[BaseException], str]], address: str, bound: float
) -> dict[str, float]:
    times = {}
    for name, (iterator, error_type, marker) in paths.items():
        elapsed, error = time_to_error(iterator)
        assert isinstance(error, error_type), f"{name}: {type(error).__name__}: {error}"
        text = str(error)
        assert marker in text, f"{name}: {text}"
        assert address in text and TABLE in text, f"{name}: {text}"
        assert "restart" in text, f"{name}: {text}"
        assert elapsed < bound + SLACK_S, f"{name} took {elapsed:.1f} s (bound {bound:.1f} s)"
        times[name] = elapsed
    return times


def cartpole() -> tuple[Any, Any, Any]:
    """The CartPole environment, random policy and data spec of the conftest fixtures."""
    from tf_agents.environments import suite_gym
    from tf_agents.policies import random_py_policy

    from replay_service.specs.nests import collect_data_spec

    env = suite_gym.load("CartPole-v0")
    env.seed(0)
    policy = random_py_policy.RandomPyPolicy(env.time_step_spec(), env.action_spec(), seed=0)
    return env, policy, collect_data_spec(env, policy)


# Each scenario below runs in a child process (`run_child`): iterators of a killed server left
# in a pytest worker would spin and block one of its later garbage collections for a minute.


def killed_servers_scenario(addresses: str) -> dict[str, dict[str, float]]:
    """Child: once the parent saw the servers of `addresses` (JSON name -> address) listen,
    iterators of every path on each; asks the parent to kill each server in turn and checks
    its iterators fail in time."""
    env, policy, data_spec = cartpole()
    child_request("wait listening")
    running = {}
    for name, address in json.loads(addresses).items():
        manager = ReplayBufferManager(
            data_spec, CAPACITY, server_address=address, table_name=TABLE, timeouts=TIMEOUTS
        )
        replay_buffer, observer = manager.create_replay_buffer()
        collect(env, policy, observer, 40)
        running[name] = (address, sampling_paths(manager, replay_buffer))
    times = {}
    for name, (address, paths) in running.items():
        child_request(f"kill {name}")
        times[name] = check_fails_in_time(paths, address, BOUND)
    return times


def test_every_sampling_path_fails_in_time_when_the_server_dies(start_server, tmp_path) -> None:
    """The iterators live (and the servers are killed under them) in a child process: see
    `killed_servers_scenario`."""
    # One server is killed with SIGKILL, the other stopped with SIGTERM; both start side by
    # side (each spends seconds importing TensorFlow).
    signals = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM}
    servers = {
        name: start_server(
            "--checkpoint_interval_s=0", f"--checkpoint_dir={tmp_path / name}", wait=False
        )
        for name in signals
    }

    def handle(request: str) -> None:
        # The child imports its stack while the servers import theirs.
        if request == "wait listening":
            for server, _ in servers.values():
                server.wait_listening()
        else:
            name = request.removeprefix("kill ")
            servers[name][0].finish(signals[name])

    addresses = {name: address for name, (_, address) in servers.items()}
    times = run_child(__file__, "killed_servers", json.dumps(addresses), handle=handle)
    print(times)
    assert set(times) == set(signals)
    for name, path_times in times.items():
        assert set(path_times) == set(PATH_NAMES), name
        assert max(path_times.values()) < BOUND + SLACK_S, (name, path_times)


def sharded_scenario(first_address: str, second_address: str) -> dict[str, float]:
    """Child: once the parent saw both shards listen, a sharded dataset over them; asks the
    parent to kill the second shard and checks the dataset fails in time naming it."""
    env, policy, data_spec = cartpole()
    child_request("wait listening")
    shards = ShardedReplayBuffer(
        ShardedConfig((first_address, second_address)),
        data_spec,
        CAPACITY,
        table_name=TABLE,
        timeouts=TIMEOUTS,
    ).create()
    try:
        collect(env, policy, shards.observer(0), 40)
        collect(env, policy, shards.observer(1), 40)
        iterator = iter(shards.get_dataset(BATCH))
        next(iterator)
        child_request("kill second")
        elapsed, error = time_to_error(iterator)
        assert isinstance(error, tf.errors.InvalidArgumentError), error
        assert SERVER_LOST_MESSAGE in str(error) and second_address in str(error)
        assert elapsed < BOUND + SLACK_S, f"took {elapsed:.1f} s (bound {BOUND:.1f} s)"
    finally:
        shards.close()
    return {"sharded": elapsed}


def test_sharded_dataset_fails_in_time_when_a_shard_dies(start_server, tmp_path) -> None:
    """The dataset lives (and the shard is killed under it) in a child process: see
    `sharded_scenario`."""
    # Both shards start side by side (each spends seconds importing TensorFlow).
    first, first_address = start_server("--checkpoint_interval_s=0", wait=False)
    second, second_address = start_server(
        "--checkpoint_interval_s=0", f"--checkpoint_dir={tmp_path / 'second_shard'}", wait=False
    )
    killed = []

    def handle(request: str) -> None:
        # The child imports its stack while the shards import theirs.
        if request == "wait listening":
            first.wait_listening()
            second.wait_listening()
        else:
            assert request == "kill second", request
            second.finish(signal.SIGKILL)
            killed.append(request)

    try:
        times = run_child(__file__, "sharded", first_address, second_address, handle=handle)
    finally:
        first.finish(signal.SIGKILL)
    print(times)
    assert killed and times["sharded"] < BOUND + SLACK_S, times


def closed_manager_scenario(checkpoint_dir: str) -> dict[str, float]:
    """Child: iterators of every path (and one inside a `tf.function`) on an embedded manager;
    closes the manager and checks each fails at once naming it."""
    env, policy, data_spec = cartpole()
    manager = ReplayBufferManager(data_spec, 1000, checkpoint_dir=checkpoint_dir, timeouts=TIMEOUTS)
    replay_buffer, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 40)
    address = manager.server_address
    paths = sampling_paths(manager, replay_buffer)
    in_graph = iter(manager.get_dataset(BATCH))

    @tf.function
    def train_step(it: Any) -> tf.Tensor:
        trajectory, _ = next(it)
        return tf.reduce_sum(trajectory.reward)

    train_step(in_graph)
    manager.close()
    expected = {
        ServerUnavailableError: ManagerClosedError,
        tf.errors.InvalidArgumentError: tf.errors.InvalidArgumentError,
    }
    closed_paths = {
        name: (iterator, expected[error_type], MANAGER_CLOSED_MESSAGE)
        for name, (iterator, error_type, _) in paths.items()
    }
    times = {}
    for name, (iterator, error_type, marker) in closed_paths.items():
        elapsed, error = time_to_error(iterator)
        assert isinstance(error, error_type), f"{name}: {type(error).__name__}: {error}"
        assert marker in str(error) and address in str(error), f"{name}: {error}"
        assert elapsed < CLOSED_BOUND_S + SLACK_S, f"{name} took {elapsed:.1f} s"
        times[name] = elapsed
    start = time.monotonic()
    with pytest.raises(tf.errors.InvalidArgumentError, match="manager of this dataset was closed"):
        while True:
            train_step(in_graph)
    times["tf.function"] = time.monotonic() - start
    assert times["tf.function"] < CLOSED_BOUND_S + SLACK_S
    return times


def test_every_sampling_path_fails_at_once_after_an_embedded_manager_closes(tmp_path) -> None:
    """The manager and its iterators live in a child process: see `closed_manager_scenario`."""
    times = run_child(__file__, "closed_manager", str(tmp_path / "ckpt"))
    print(times)
    assert set(times) == {*PATH_NAMES, "tf.function"}
    assert max(times.values()) < CLOSED_BOUND_S + SLACK_S, times


_EXIT_SCRIPT = """
import json, sys, time
import numpy as np
from replay_service import ReplayBufferManager, Timeouts
from replay_service.backends.reverb import liveness
from replay_service.distributed.sharding import ShardedConfig, ShardedReplayBuffer
from replay_service.specs.nests import spec_from_description

calls = []
original = liveness._Watch.round
def counted(self):
    calls.append(time.monotonic())
    return original(self)
liveness._Watch.round = counted

spec = spec_from_description([
    {"path": "observation", "dtype": "float32", "shape": [4]},
    {"path": "action", "dtype": "int64", "shape": []},
])
manager = ReplayBufferManager(spec, 1000, sys.argv[1], 2, timeouts=Timeouts(sample=1.0))
manager.create_replay_buffer()
writer = manager.transition_writer()
obs = np.zeros(4, np.float32)
for i in range(40):
    writer.add(obs + i, 0, 1.0, obs + i + 1, i % 10 == 9, False)
writer.flush()
stream = manager.torch_batches(4)
dataset = iter(manager.get_dataset(4))

# A sharded mixture that reads the shard sizes (in Python, from tf.data) every batch.
reads = []
original_sizes = ShardedReplayBuffer.shard_sizes
def counted_sizes(self):
    reads.append(time.monotonic())
    return original_sizes(self)
ShardedReplayBuffer.shard_sizes = counted_sizes
other = ReplayBufferManager(spec, 1000, sys.argv[1] + "_other", 2, timeouts=Timeouts(sample=1.0))
other.create_replay_buffer()
other_writer = other.transition_writer()
for i in range(40):
    other_writer.add(obs + i, 0, 1.0, obs + i + 1, i % 10 == 9, False)
other_writer.flush()
shards = ShardedReplayBuffer(
    ShardedConfig((manager.server_address, other.server_address)),
    spec, 1000, table_name=manager.table_handle().name, timeouts=Timeouts(sample=1.0),
).load()
mixed = iter(shards.get_dataset(4, reweight_every=1))

def run(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        next(stream), next(dataset), next(mixed)
        time.sleep(0.01)

# Until rounds and reads both ran a few times (a loaded machine runs fewer a second).
deadline = time.monotonic() + 60
while time.monotonic() < deadline and (len(calls) < 5 or len(reads) < 4):
    run(0.2)
before, reads_before = len(calls), len(reads)
liveness._stop_rounds()  # what atexit runs
stopped, reads_stopped = len(calls), len(reads)
run(2.0)
print(json.dumps({
    "before": before, "stopped": stopped, "after": len(calls),
    "reads_before": reads_before, "reads_stopped": reads_stopped, "reads_after": len(reads),
}), flush=True)
# Exits with the stream, the iterator and the manager still open.
"""


def test_watch_rounds_stop_calling_python_at_exit_and_the_process_exits(tmp_path) -> None:
    """Watch rounds (and a sharded mixture's weight reads) call Python from TensorFlow's
    threads; one that did so while the interpreter finalized never returned and the process
    hung at exit. At exit (`liveness._stop_rounds`, registered with atexit) they stop calling
    Python, datasets still yield, and a process that never closed its streams exits."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["before"] >= 5, counts  # rounds ran (about 20 a second per dataset)
    assert counts["after"] - counts["stopped"] <= 2, counts  # at most rounds already past the flag
    # The sharded mixture's weight reads too (one per round of blocks, a few a second).
    assert counts["reads_before"] >= 4, counts
    assert counts["reads_after"] - counts["reads_stopped"] <= 2, counts


if __name__ == "__main__":
    child_main(
        {
            "killed_servers": killed_servers_scenario,
            "sharded": sharded_scenario,
            "closed_manager": closed_manager_scenario,
        }
    )

"""Learners fail, not hang, when their server is lost: every sampling path, real servers.

A `replay-server` subprocess is killed (SIGKILL, SIGTERM) under iterators of every sampling
path, or an embedded manager is closed under them; `next()` must raise our error (or a
`tf.errors` error naming the server and the table) within `liveness.liveness_bound`.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import tensorflow as tf

from conftest import collect
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


def remote_manager(make_manager: Callable[..., ReplayBufferManager], address: str) -> Any:
    return make_manager(
        server_address=address, capacity=CAPACITY, table_name=TABLE, timeouts=TIMEOUTS
    )


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
    print({name: round(t, 2) for name, t in times.items()})
    return times


def test_every_sampling_path_fails_in_time_when_the_server_dies(
    start_server, make_manager, env, policy, tmp_path
) -> None:
    # One server is killed with SIGKILL, the other stopped with SIGTERM; both start side by
    # side (each spends seconds importing TensorFlow).
    signals = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM}
    servers = {
        name: start_server(
            "--checkpoint_interval_s=0", f"--checkpoint_dir={tmp_path / name}", wait=False
        )
        for name in signals
    }
    running = {}
    for name, (server, address) in servers.items():
        server.wait_listening()
        manager = remote_manager(make_manager, address)
        replay_buffer, observer = manager.create_replay_buffer()
        collect(env, policy, observer, 40)
        running[name] = (server, address, sampling_paths(manager, replay_buffer))
    for name, (server, address, paths) in running.items():
        server.finish(signals[name])
        print(name)
        check_fails_in_time(paths, address, BOUND)


def test_sharded_dataset_fails_in_time_when_a_shard_dies(
    start_server, data_spec, env, policy, tmp_path
) -> None:
    # Both shards start side by side (each spends seconds importing TensorFlow).
    first, first_address = start_server("--checkpoint_interval_s=0", wait=False)
    second, second_address = start_server(
        "--checkpoint_interval_s=0", f"--checkpoint_dir={tmp_path / 'second_shard'}", wait=False
    )
    first.wait_listening()
    second.wait_listening()
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
        second.finish(signal.SIGKILL)
        elapsed, error = time_to_error(iterator)
        assert isinstance(error, tf.errors.InvalidArgumentError), error
        assert SERVER_LOST_MESSAGE in str(error) and second_address in str(error)
        assert elapsed < BOUND + SLACK_S, f"took {elapsed:.1f} s (bound {BOUND:.1f} s)"
        print({"sharded": round(elapsed, 2)})
    finally:
        shards.close()
        first.finish(signal.SIGKILL)


def test_every_sampling_path_fails_at_once_after_an_embedded_manager_closes(
    make_manager, env, policy
) -> None:
    manager = make_manager(timeouts=TIMEOUTS)
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
    for name, (iterator, error_type, marker) in closed_paths.items():
        elapsed, error = time_to_error(iterator)
        assert isinstance(error, error_type), f"{name}: {type(error).__name__}: {error}"
        assert marker in str(error) and address in str(error), f"{name}: {error}"
        assert elapsed < CLOSED_BOUND_S + SLACK_S, f"{name} took {elapsed:.1f} s"
    start = time.monotonic()
    with pytest.raises(tf.errors.InvalidArgumentError, match="manager of this dataset was closed"):
        while True:
            train_step(in_graph)
    assert time.monotonic() - start < CLOSED_BOUND_S + SLACK_S


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
    import json
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

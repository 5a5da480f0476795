"""TensorBoard scalars of the stats, read back from the event files."""

from __future__ import annotations

import glob
import os
import time
from collections import defaultdict

import pytest
import tensorflow as tf

from conftest import FAST_TIMEOUTS, collect
from replay_service import ConfigError, ReplayBufferManager

TABLE = "uniform_table"


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """Tag -> [(step, value)] of every scalar in the event files under `logdir`."""
    values: dict[str, list[tuple[int, float]]] = defaultdict(list)
    files = sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*")))
    assert files, f"no event file in {logdir}"
    for path in files:
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                values[value.tag].append((event.step, float(tf.make_ndarray(value.tensor))))
    return values


@pytest.mark.heavy
def test_manager_writes_stats_to_tensorboard(make_manager, env, policy, tmp_path):
    logdir = str(tmp_path / "tb")
    manager = make_manager(summary_dir=logdir, summary_interval_s=0.3)
    _, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 50)
    size = manager.num_frames()
    checkpoint = manager.checkpoint()
    time.sleep(1.0)  # at least two more writes
    started = time.monotonic()
    manager.close()
    assert time.monotonic() - started < 5.0  # the thread stops promptly

    values = read_scalars(logdir)
    sizes = values[f"{TABLE}/size"]
    assert sizes[0] == (0, 0.0)  # written at create_replay_buffer
    assert sizes[-1][1] == size
    assert [step for step, _ in sizes] == list(range(len(sizes))) and len(sizes) >= 3
    assert values[f"{TABLE}/capacity"][-1][1] == 1000
    assert values[f"{TABLE}/inserts"][-1][1] == size
    assert max(v for _, v in values[f"{TABLE}/inserts_per_s"]) > 0
    assert f"{TABLE}/rate_limiter_sample_blocked_ms" in values
    stats = manager_stats_bytes(checkpoint)
    assert values["checkpoint/bytes"][-1][1] == stats
    assert values["checkpoint/num_items"][-1][1] == size
    assert values["checkpoint/duration_s"][-1][1] > 0


def manager_stats_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if not n.endswith(".json")
    )


def test_bad_summary_interval_is_refused(data_spec, tmp_path):
    with pytest.raises(ConfigError, match=r"summary_interval_s .* got 0"):
        ReplayBufferManager(
            data_spec,
            100,
            str(tmp_path / "ckpt"),
            summary_dir=str(tmp_path / "tb"),
            summary_interval_s=0,
            timeouts=FAST_TIMEOUTS,
        )


@pytest.mark.heavy
def test_replay_server_tensorboard_dir(start_server, tmp_path, env, policy, data_spec):
    logdir = str(tmp_path / "server_tb")
    server, address = start_server(
        "--checkpoint_interval_s=0", f"--tensorboard_dir={logdir}", "--summary_interval_s=0.3"
    )
    collector = ReplayBufferManager(
        data_spec, 100_000, server_address=address, timeouts=FAST_TIMEOUTS
    )
    try:
        _, observer = collector.load_replay_buffer()
        collect(env, policy, observer, 40)
        size = collector.num_frames()
    finally:
        collector.close()
    time.sleep(1.0)
    code, output = server.finish()
    assert code == 0, output[-2000:]
    values = read_scalars(logdir)
    assert values[f"{TABLE}/size"][-1][1] == size
    assert values[f"{TABLE}/capacity"][-1][1] == 100_000
    assert max(v for _, v in values[f"{TABLE}/inserts_per_s"]) > 0

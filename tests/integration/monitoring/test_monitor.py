"""`BufferMonitor`: its options checked before anything starts, a server's stats read once it is
started, and its TensorBoard summaries written until it is closed."""

from __future__ import annotations

import glob
import os

import pytest

from replay_service import ConfigError
from replay_service.monitoring.monitor import BufferMonitor
from replay_service.monitoring.stats import BufferStats

TABLE = "uniform_table"


def test_monitor_refuses_bad_options_before_starting(tmp_path):
    logdir = tmp_path / "tb"
    with pytest.raises(ConfigError, match=r"summary_dir"):
        BufferMonitor(str(logdir) + "\0x", 1.0)
    with pytest.raises(ConfigError, match=r"summary_interval_s .* got -1"):
        BufferMonitor(str(logdir), -1)
    assert not logdir.exists()  # nothing was created


@pytest.mark.heavy
def test_monitor_reads_the_server_and_writes_until_closed(make_manager, tmp_path):
    manager = make_manager()
    manager.create_replay_buffer()
    logdir = tmp_path / "tb"
    monitor = BufferMonitor(str(logdir), 30.0)
    monitor.start(manager.py_client, 5.0, lambda: monitor.read(None))
    stats = monitor.read(None)
    assert isinstance(stats, BufferStats)
    assert stats.table(TABLE).size == 0 and stats.checkpoint is None
    monitor.close()
    monitor.close()  # idempotent
    assert glob.glob(os.path.join(logdir, "events.out.tfevents.*"))  # the first write, at start


@pytest.mark.heavy
def test_monitor_without_a_summary_dir_only_reads(make_manager, tmp_path):
    manager = make_manager()
    manager.create_replay_buffer()
    monitor = BufferMonitor(None, 30.0)
    monitor.start(manager.py_client, 5.0, lambda: monitor.read(None))
    assert monitor.read(None).table(TABLE).capacity == 1000
    monitor.close()
    assert os.listdir(tmp_path) == ["ckpt"]  # no event file anywhere

"""scripts/load_test.py: collectors and a learner in their own processes against real servers."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from conftest import REPO
from replay_service import ConfigError

sys.path.insert(0, os.path.join(REPO, "scripts"))

import load_test

SHORT_RUN_S = 6.0
SHORT_CAPACITY = 1000
# Start-up (servers and 5 worker processes importing TensorFlow on 2 cores) and shutdown.
OVERHEAD_LIMIT_S = 120.0


def assert_reconciled(report: load_test.LoadTestReport) -> None:
    """The checks a passing run must satisfy, with the report in the failure message."""
    text = load_test.format_report(report)
    assert report.ok, text
    assert report.server_inserts == report.collector_items > 0, text
    assert report.server_samples >= report.learner_items > 0, text
    assert report.inserts_per_s > 0 and report.samples_per_s > 0, text
    assert all(v > 0 for v in report.observer_latency_us), text
    assert all(v > 0 for v in report.learner_latency_ms), text
    assert report.observer_latency_us[0] <= report.observer_latency_us[2], text
    assert report.rss_max_mib is not None and report.rss_max_mib > 0, text
    assert report.rss_final_mib is not None and report.rss_final_mib <= report.rss_max_mib, text
    names = {check.name: check.ok for check in report.checks}
    assert names["processes finished in time"] is True, text
    assert names["servers stopped cleanly"] is True, text


@pytest.mark.slow  # a load run of its own: about 50 s
def test_short_run_reconciles_and_ends_in_time():
    started = time.monotonic()
    config = load_test.LoadTestConfig(duration_s=SHORT_RUN_S, capacity=SHORT_CAPACITY)
    report = load_test.run_load_test(config)
    elapsed = time.monotonic() - started
    assert_reconciled(report)
    assert report.num_collectors == 4 and report.num_shards == 1
    # The run's own bound (the same a loaded machine must meet): the stop comes after the run's
    # duration, and every process reports and exits within the stop grace.
    assert SHORT_RUN_S <= report.duration_s < SHORT_RUN_S + load_test.STOP_GRACE_S
    assert report.collector_items > SHORT_CAPACITY  # the table filled and evicted
    assert elapsed < SHORT_RUN_S + OVERHEAD_LIMIT_S
    assert report.to_json()["ok"] is True


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"duration_s": 0}, "duration_s must be in (0, 600] seconds, got 0"),
        ({"duration_s": 601}, "got 601"),
        ({"num_collectors": 0}, "num_collectors must be a positive integer, got 0"),
        ({"addresses": ("localhost",)}, "'localhost' is not a server address"),
        ({"server_pids": (1,)}, "server_pids [1] apply only with addresses"),
    ],
)
def test_bad_load_test_configs_name_the_value(kwargs, message):
    with pytest.raises(ConfigError) as info:
        load_test.LoadTestConfig(**kwargs)
    assert message in str(info.value)


def test_synthetic_steps_are_deterministic_episodes():
    steps = [load_test.synthetic_step(2, 5, t, 4) for t in range(4)]
    again = [load_test.synthetic_step(2, 5, t, 4) for t in range(4)]
    assert [s.observation.tolist() for s in steps] == [s.observation.tolist() for s in again]
    assert [int(s.step_type) for s in steps] == [0, 1, 1, 2]
    assert [int(s.next_step_type) for s in steps] == [1, 1, 2, 0]
    assert [bool(s.is_boundary()) for s in steps] == [False, False, False, True]
    assert steps[1].observation.tolist()[:3] == [2.0, 5.0, 1.0]


def test_help_explains_the_flags():
    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "load_test.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for flag in ("--duration_s", "--num_collectors", "--addresses", "--json", "--capacity"):
        assert flag in result.stdout
    assert "reconciles" in result.stdout


@pytest.mark.slow
def test_sixty_second_run_keeps_server_memory_flat():
    report = load_test.run_load_test(load_test.LoadTestConfig(duration_s=60.0))
    assert_reconciled(report)
    assert report.table_full_at_mid is True, load_test.format_report(report)
    plateau = next(c for c in report.checks if c.name == "server RSS plateaus")
    assert plateau.ok is True, load_test.format_report(report)


@pytest.mark.slow
def test_two_shards_reconcile():
    report = load_test.run_load_test(
        load_test.LoadTestConfig(duration_s=20.0, num_shards=2, capacity=2000)
    )
    assert_reconciled(report)
    assert report.num_shards == 2

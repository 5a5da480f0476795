"""Rate limiting: restored tables take today's options and cannot stall; a single-process
collect/train loop with a samples-per-insert limiter finishes."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from tf_agents.drivers import py_driver
from tf_agents.trajectories import trajectory as trajectory_lib

from conftest import FAST_TIMEOUTS, collect
from replay_service import ConfigError, SamplingConfig, Timeouts
from replay_service.backends.reverb.connection import server_info
from replay_service.backends.reverb.internals import rebased_sample_count
from replay_service.sample.rate_limit import IN_FLIGHT, LimiterState, check_single_process_loop


def limiter(manager: Any) -> LimiterState:
    """The manager's table limiter state, read from the server."""
    info = server_info(manager.py_client, 5.0)[manager.table_name]
    return LimiterState.from_info(info)


def run_loop(manager: Any, env: Any, policy: Any, *, batch_size: int, train_steps: int) -> int:
    """Collects and trains in one thread as `TrainSchedule` says; returns the steps collected."""
    observer = manager.get_replay_buffer_and_observer()[1]
    driver = py_driver.PyDriver(env, policy, [observer], max_steps=1)
    schedule = manager.train_schedule(batch_size)
    iterator = iter(manager.get_dataset(batch_size, prefetch=1))
    time_step, policy_state = env.reset(), policy.get_initial_state()
    trained = collected = 0
    while trained < train_steps:
        if schedule.ready():
            trajectories, _ = next(iterator)
            assert trajectories.observation.shape[0] == batch_size
            trained += 1
        else:
            time_step, policy_state = driver.run(time_step, policy_state)
            collected += 1
    return collected


@pytest.mark.heavy
def test_single_process_loop_with_samples_per_insert_finishes(make_manager, env, policy):
    spi, batch, min_size = 2.0, 16, 40
    error_buffer = (batch + spi * IN_FLIGHT) / 2
    sampling = SamplingConfig(
        samples_per_insert=spi, min_size_to_sample=min_size, error_buffer=error_buffer
    )
    manager = make_manager(sampling=sampling, timeouts=Timeouts(sample=20.0, write=20.0))
    manager.create_replay_buffer()
    collected = run_loop(manager, env, policy, batch_size=batch, train_steps=40)

    state = limiter(manager)
    assert state.samples >= 40 * batch
    assert state.min_diff <= state.diff <= state.max_diff
    # The ratio held: about samples / spi items were collected, not more than the band allows.
    assert state.inserts <= (state.samples + state.max_diff) / spi + 1
    assert collected >= min_size


def test_schedule_refuses_an_error_buffer_too_small_for_one_thread(make_manager):
    manager = make_manager(sampling=SamplingConfig(samples_per_insert=2.0, min_size_to_sample=10))
    manager.create_replay_buffer()
    needed = r"error buffer 4 is too small.*batch_size 256.*error_buffer >= 177 "
    with pytest.raises(ConfigError, match=needed):
        manager.train_schedule(256)
    with pytest.raises(ConfigError, match="batch_size must be a positive integer, got 0"):
        check_single_process_loop(0, 1.0, 0.0, 1e9)


@pytest.mark.heavy
def test_limiter_state_follows_reverbs_rule(make_manager, env, policy):
    sampling = SamplingConfig(samples_per_insert=1.0, min_size_to_sample=5, error_buffer=30.0)
    manager = make_manager(sampling=sampling)
    manager.create_replay_buffer()
    state = limiter(manager)
    assert not state.can_sample(1) and state.inserts_needed(1) == 5
    run_loop(manager, env, policy, batch_size=4, train_steps=3)
    state = limiter(manager)
    allowed = math.floor(state.diff - state.min_diff)
    assert state.can_sample(allowed) and not state.can_sample(allowed + 1)
    assert state.inserts_needed(allowed + 1) == 1


def drain(manager: Any) -> None:
    """Samples exactly as many items as the limiter lets through without waiting."""
    state = limiter(manager)
    allowed = math.floor(state.diff - state.min_diff)
    if allowed > 0:
        list(manager.py_client.sample(manager.table_name, num_samples=allowed))
    assert not limiter(manager).can_sample(1)


def mid_step(value: float) -> Any:
    """A CartPole-shaped step in the middle of an episode whose observation is `value`."""
    return trajectory_lib.Trajectory(
        step_type=np.int32(1),
        observation=np.full([4], value, np.float32),
        action=np.int64(0),
        policy_info=(),
        next_step_type=np.int32(1),
        reward=np.float32(0.0),
        discount=np.float32(1.0),
    )


@pytest.mark.parametrize("layout", ["auto", "nested"])
def test_num_frames_does_not_wait_for_items_the_rate_limiter_holds_back(make_manager, layout):
    # A learner that reads num_frames() while its collectors wait for it to sample: the count
    # answers at once with what the table holds, and the held items come in once sampled.
    sampling = SamplingConfig(samples_per_insert=1.0, min_size_to_sample=2, error_buffer=10.0)
    write_s = 10.0
    manager = make_manager(
        layout=layout,
        sampling=sampling,
        timeouts=Timeouts(connect=5.0, write=write_s, sample=1.0, checkpoint=60.0),
    )
    _, observer = manager.create_replay_buffer()
    for i in range(31):  # 30 items, more than the limiter lets in without samples
        observer(mid_step(float(i)))
    start = time.monotonic()
    held_back = manager.num_frames()
    assert time.monotonic() - start < write_s / 2
    state = limiter(manager)
    assert 0 < held_back == state.size < 30 and not state.can_insert()
    list(manager.py_client.sample(manager.table_name, num_samples=25))
    assert manager.num_frames() == 30  # the held items were inserted: none was lost


@pytest.mark.heavy
def test_restored_counters_cannot_stall_sampling(make_manager, env, policy, tmp_path):
    sampling = SamplingConfig(samples_per_insert=1.0, min_size_to_sample=10, error_buffer=40.0)
    manager = make_manager(sampling=sampling, checkpoint_dir=str(tmp_path / "a"))
    manager.create_replay_buffer()
    run_loop(manager, env, policy, batch_size=8, train_steps=6)
    drain(manager)  # the learner took all it may: sampling now waits for inserts
    size = manager.num_frames()
    manager.checkpoint()
    manager.close()

    restored = make_manager(sampling=sampling, checkpoint_dir=str(tmp_path / "a"))
    restored.load_replay_buffer()
    state = limiter(restored)
    assert state.size == size
    # Rebased to the middle of the band: a learner can sample right away.
    assert state.diff == pytest.approx(state.samples_per_insert * state.min_size_to_sample)
    trajectories, _ = next(iter(restored.get_dataset(8)))
    assert trajectories.observation.shape[0] == 8


def test_restore_applies_the_configured_sampler_and_rate_limiter(make_manager, env, policy):
    manager = make_manager()  # uniform, MinSize(1)
    _, observer = manager.create_replay_buffer()
    py_driver.PyDriver(env, policy, [observer], max_steps=60).run(env.reset())
    observer.flush()
    size = manager.num_frames()
    manager.checkpoint()
    manager.close()

    sampling = SamplingConfig(
        sampler="prioritized", samples_per_insert=4.0, min_size_to_sample=10, error_buffer=200.0
    )
    restored = make_manager(sampling=sampling, timeouts=FAST_TIMEOUTS)
    restored.load_replay_buffer()
    info = server_info(restored.py_client, 5.0)[restored.table_name]
    assert info.sampler_options.HasField("prioritized")
    assert info.rate_limiter_info.samples_per_insert == 4.0
    assert info.current_size == size
    state = LimiterState.from_info(info)
    # A starter buffer filled without sampling: its 0 samples would block inserts for about
    # 4 * size samples; rebased, the next inserts pass at once.
    assert state.diff + 4.0 * IN_FLIGHT <= state.max_diff
    _, observer = restored.get_replay_buffer_and_observer()
    py_driver.PyDriver(env, policy, [observer], max_steps=33).run(env.reset())
    observer.flush()
    assert restored.num_frames() > size
    assert not tf.io.gfile.exists(f"{restored.checkpoint_dir}/.restore")


def test_rebased_sample_count():
    # SampleToInsertRatio(spi=2, min_size=10, error_buffer=4): band [16, 24], centre 20.
    assert rebased_sample_count(12, 2.0, 16.0, 24.0) == 4
    assert rebased_sample_count(3, 2.0, 16.0, 24.0) == 0  # below min size: never negative
    # MinSize: an unbounded band centres on 0.
    huge = 1.7976931348623157e308
    assert rebased_sample_count(50, 1.0, -huge, huge) == 50


def _sample_every_item_twice(manager: Any, max_times_sampled: int) -> dict[int, int]:
    """Samples one item at a time until every item in the table was sampled at least twice
    (items reaching `max_times_sampled` leave the table); returns key -> times sampled."""
    client, table = manager.py_client, manager.table_name
    counts: dict[int, int] = {}
    for _ in range(5000):
        alive = [k for k, c in counts.items() if max_times_sampled == 0 or c < max_times_sampled]
        if len(alive) == manager.num_frames() and all(counts[k] >= 2 for k in alive):
            return counts
        for sample in client.sample(table, num_samples=1, emit_timesteps=False):
            key = int(sample.info.key)
            counts[key] = counts.get(key, 0) + 1
    raise AssertionError(f"not every item was sampled twice: {counts}")


@pytest.mark.heavy
@pytest.mark.parametrize("stored_max", [0, 10])
def test_restore_with_a_lower_max_times_sampled_drops_items_sampled_that_often(
    make_manager, env, policy, stored_max
):
    manager = make_manager(sampling=SamplingConfig(max_times_sampled=stored_max))
    _, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 30)
    counts = _sample_every_item_twice(manager, stored_max)
    sampled = manager.num_frames()  # items in the table, each sampled >= 2 times
    assert sampled > 0
    observer.reset()
    collect(env, policy, observer, 20)  # a second episode, never sampled
    fresh = manager.num_frames() - sampled
    assert fresh > 0
    manager.checkpoint()
    manager.close()

    # The limiter counts the dropped items as deleted: one item short of min_size_to_sample,
    # sampling waits (and times out) instead of finding an empty table.
    short = make_manager(
        sampling=SamplingConfig(max_times_sampled=2, min_size_to_sample=fresh + 1),
        timeouts=Timeouts(sample=0.3),
    )
    short.load_replay_buffer()
    with pytest.raises(tf.errors.InvalidArgumentError, match="within 0.3 s"):
        next(iter(short.get_dataset(1)))
    short.close()

    restored = make_manager(sampling=SamplingConfig(max_times_sampled=2))
    restored.load_replay_buffer()
    # Reverb alone would keep the `sampled` items and sample each of them once more.
    assert restored.num_frames() == fresh
    info = server_info(restored.py_client, 5.0)[restored.table_name]
    assert info.max_times_sampled == 2
    # Only never-sampled items come out (fewer samples than 2 * fresh: none is exhausted).
    keys = {
        int(s.info.key)
        for s in restored.py_client.sample(
            restored.table_name, num_samples=fresh, emit_timesteps=False
        )
    }
    assert keys and not keys & counts.keys()
    # The restored table keeps working: new items are written and sampled.
    _, observer = restored.get_replay_buffer_and_observer()
    collect(env, policy, observer, 10)
    assert restored.num_frames() > fresh - len(keys)

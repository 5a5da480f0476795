"""Tests for the single-zone building environment and the environment loader."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pytest
from tf_agents.environments import utils
from tf_agents.trajectories import time_step as ts

from replay_service.starter.envs import (
    OBS_FIELDS,
    STEPS_PER_DAY,
    STEPS_PER_WEEK,
    BuildingEnv,
    decode_time,
    load_env,
    make_observation,
)
from replay_service.starter.envs.building import COS_TIME, OCCUPANCY, SIN_TIME, ZONE_TEMP

HEAT_OFF_COOL_OFF = (12.0, 30.0)
COMFORT = (20.0, 24.0)
SETBACK = (15.0, 28.0)


def _run(env: BuildingEnv, actions: Any, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Resets ``env`` and steps it; ``actions`` is a fixed pair or a per-step array."""
    fixed = np.asarray(actions, dtype=np.float32)
    observations = [env.reset().observation]
    rewards = []
    for i in range(steps):
        step = env.step(fixed if fixed.ndim == 1 else fixed[i])
        observations.append(step.observation)
        rewards.append(step.reward)
    return np.stack(observations), np.asarray(rewards)


def _still_air(**kwargs: Any) -> BuildingEnv:
    """An environment with a constant, noise-free outdoor temperature."""
    return BuildingEnv(outdoor_amplitude_c=0.0, outdoor_noise_c=0.0, seed=0, **kwargs)


def test_passes_tf_agents_validation() -> None:
    env = BuildingEnv(episode_steps=40, random_start=True, seed=3)
    utils.validate_py_environment(env, episodes=2)
    assert env.observation_spec().shape == (len(OBS_FIELDS),)
    assert env.action_spec().shape == (2,)


def test_same_seed_gives_identical_trajectories() -> None:
    actions = np.random.default_rng(7).uniform(12.0, 30.0, size=(200, 2)).astype(np.float32)
    obs_a, rew_a = _run(BuildingEnv(seed=11, random_start=True), actions, 200)
    obs_b, rew_b = _run(BuildingEnv(seed=11, random_start=True), actions, 200)
    obs_c, rew_c = _run(BuildingEnv(seed=12, random_start=True), actions, 200)
    reseeded = BuildingEnv(seed=12, random_start=True)
    _run(reseeded, actions, 50)
    reseeded.seed(11)
    np.testing.assert_array_equal(_run(reseeded, actions, 200)[0], obs_a)
    np.testing.assert_array_equal(obs_a, obs_b)
    np.testing.assert_array_equal(rew_a, rew_b)
    assert not np.array_equal(obs_a, obs_c)
    assert not np.array_equal(rew_a, rew_c)


def test_heating_raises_zone_temperature_when_cold() -> None:
    steps = 16
    comfort, _ = _run(_still_air(outdoor_mean_c=5.0), COMFORT, steps)
    setback, _ = _run(_still_air(outdoor_mean_c=5.0), SETBACK, steps)
    env = _still_air(outdoor_mean_c=5.0)
    off, _ = _run(env, HEAT_OFF_COOL_OFF, steps)
    assert env.get_info()["episode_energy_kwh"] == 0.0
    assert comfort[-1, ZONE_TEMP] == pytest.approx(20.0, abs=0.01)
    assert comfort[-1, ZONE_TEMP] > setback[-1, ZONE_TEMP] + 3.0
    assert np.all(np.diff(off[:, ZONE_TEMP]) < 0.0)
    assert 5.0 < off[-1, ZONE_TEMP] < 18.0


def test_cooling_lowers_zone_temperature_when_hot() -> None:
    kwargs = {"outdoor_mean_c": 35.0, "initial_zone_temp_c": 26.0}
    cooled_env = _still_air(**kwargs)
    cooled, _ = _run(cooled_env, (12.0, 22.0), 32)
    off, _ = _run(_still_air(**kwargs), HEAT_OFF_COOL_OFF, 32)
    assert cooled[-1, ZONE_TEMP] == pytest.approx(22.0, abs=0.01)
    assert cooled_env.get_info()["episode_energy_kwh"] > 0.0
    assert np.all(np.diff(cooled[:, ZONE_TEMP]) <= 0.0)
    assert np.all(np.diff(off[:, ZONE_TEMP]) >= 0.0)
    assert off[-1, ZONE_TEMP] == pytest.approx(HEAT_OFF_COOL_OFF[1], abs=0.01)


def test_inverted_setpoints_collapse_to_their_midpoint() -> None:
    inverted, rew_inverted = _run(BuildingEnv(seed=5), (25.0, 18.0), 50)
    midpoint, rew_midpoint = _run(BuildingEnv(seed=5), (21.5, 21.5), 50)
    np.testing.assert_array_equal(inverted, midpoint)
    np.testing.assert_array_equal(rew_inverted, rew_midpoint)
    assert inverted[-1, ZONE_TEMP] == pytest.approx(21.5, abs=0.01)


def test_reward_is_weighted_energy_plus_discomfort() -> None:
    env = BuildingEnv(seed=2, energy_weight=2.0, comfort_weight=3.0)
    _, rewards = _run(env, SETBACK, STEPS_PER_DAY)
    info = env.get_info()
    assert info["episode_discomfort"] > 0.0
    expected = -(2.0 * info["episode_energy_kwh"] + 3.0 * info["episode_discomfort"])
    assert rewards.sum() == pytest.approx(expected, rel=1e-5)
    assert rewards.dtype == np.float32


def test_non_finite_action_is_rejected() -> None:
    env = BuildingEnv(seed=0)
    env.reset()
    with pytest.raises(ValueError, match="nan"):
        env.step(np.array([np.nan, 24.0], dtype=np.float32))


def test_time_features_follow_the_step_clock() -> None:
    observations, _ = _run(BuildingEnv(seed=0), COMFORT, STEPS_PER_DAY * 3)
    for step, obs in enumerate(observations):
        angle = 2.0 * math.pi * (step % STEPS_PER_DAY) / STEPS_PER_DAY
        assert obs[SIN_TIME] == pytest.approx(math.sin(angle), abs=1e-6)
        assert obs[COS_TIME] == pytest.approx(math.cos(angle), abs=1e-6)
        assert decode_time(obs) == ((step % STEPS_PER_DAY) / 4.0, step // STEPS_PER_DAY)


def test_decode_time_round_trips_every_step_of_the_week() -> None:
    for step in range(STEPS_PER_WEEK):
        hour, weekday = (step % STEPS_PER_DAY) / 4.0, step // STEPS_PER_DAY
        assert decode_time(make_observation(weekday, hour)) == (hour, weekday)
    with pytest.raises(ValueError, match=r"\(3,\)"):
        decode_time(np.zeros(3, dtype=np.float32))


def test_clock_crosses_midnight_and_week_end() -> None:
    env = BuildingEnv(start_weekday=4, start_hour=22.5, seed=0)
    assert decode_time(env.reset().observation) == (22.5, 4)
    for _ in range(8):
        step = env.step(np.array(COMFORT, dtype=np.float32))
    assert decode_time(step.observation) == (0.5, 5)
    env = BuildingEnv(start_weekday=6, start_hour=23.75, seed=0)
    env.reset()
    assert decode_time(env.step(np.array(COMFORT, dtype=np.float32)).observation) == (0.0, 0)


def test_episode_is_truncated_after_episode_steps() -> None:
    env = BuildingEnv(episode_steps=10, seed=0)
    action = np.array(COMFORT, dtype=np.float32)
    assert env.reset().step_type == ts.StepType.FIRST
    step_types = [env.step(action) for _ in range(10)]
    assert [int(s.step_type) for s in step_types[:-1]] == [ts.StepType.MID] * 9
    assert step_types[-1].step_type == ts.StepType.LAST
    assert step_types[-1].discount == 1.0
    assert env.step(action).step_type == ts.StepType.FIRST
    full_week = BuildingEnv(seed=0)
    _run(full_week, COMFORT, STEPS_PER_WEEK - 1)
    assert full_week.step(action).is_last()


@pytest.mark.parametrize(
    ("weekday", "hour", "occupied"),
    [(0, 10.0, 1.0), (5, 10.0, 0.0), (0, 7.75, 0.0), (4, 17.75, 1.0), (2, 18.0, 0.0)],
)
def test_occupancy_follows_the_weekday_schedule(weekday: int, hour: float, occupied: float) -> None:
    env = BuildingEnv(start_weekday=weekday, start_hour=hour, seed=0)
    assert env.reset().observation[OCCUPANCY] == occupied


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"episode_steps": 0}, "episode_steps must be positive, got 0"),
        ({"episode_steps": -3}, "got -3"),
        ({"episode_steps": 2.5}, "got 2.5"),
        ({"start_weekday": 7}, "start_weekday must be in 0..6 (Monday = 0), got 7"),
        ({"start_hour": 24.0}, "got 24.0"),
        ({"start_hour": 1.1}, "start_hour must be a multiple of 0.25 in [0, 24), got 1.1"),
        ({"comfort_band": (24.0, 20.0)}, "comfort_band must be finite (low, high)"),
        ({"setpoint_bounds": (30.0, 12.0)}, "setpoint_bounds must be finite (low, high) with"),
        ({"energy_weight": -1.0}, "energy_weight must be finite and >= 0, got -1.0"),
        ({"outdoor_mean_c": math.inf}, "outdoor_mean_c must be finite, got inf"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        BuildingEnv(**kwargs)


def test_load_env_builds_seeded_building_env() -> None:
    env_a, env_b = load_env("building", seed=4), load_env("building", seed=4)
    assert isinstance(env_a, BuildingEnv)
    np.testing.assert_array_equal(_run(env_a, COMFORT, 20)[0], _run(env_b, COMFORT, 20)[0])


def test_load_env_loads_gym_ids_with_a_seed() -> None:
    first = load_env("CartPole-v0", seed=9).reset().observation
    second = load_env("CartPole-v0", seed=9).reset().observation
    np.testing.assert_array_equal(first, second)
    assert first.shape == (4,)


@pytest.mark.parametrize("name", ["NoSuchEnv-v0", "not an id", "CartPole-v99"])
def test_load_env_rejects_unknown_ids(name: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(name))):
        load_env(name, seed=0)

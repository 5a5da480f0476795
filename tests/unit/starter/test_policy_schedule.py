"""Tests for the schedule and random baseline policies and the policy loader."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from tf_agents.drivers import py_driver
from tf_agents.policies import fixed_policy, policy_saver, py_tf_eager_policy, random_py_policy
from tf_agents.specs import tensor_spec
from tf_agents.trajectories import time_step as ts

from replay_service.starter.envs import STEPS_PER_WEEK, BuildingEnv, load_env, make_observation
from replay_service.starter.policies import SchedulePolicy, load_policy, make_random_policy
from replay_service.starter.policies.schedule import COMFORT_SETPOINTS, SETBACK_SETPOINTS

FIXED_ACTION = np.array([21.0, 23.0], dtype=np.float32)


@pytest.fixture(name="env")
def fixture_env() -> BuildingEnv:
    return BuildingEnv(seed=0)


def _action_at(policy: Any, weekday: int, hour: float) -> np.ndarray:
    return policy.action(ts.restart(make_observation(weekday, hour))).action


def _run_week(env: BuildingEnv, policy: Any) -> dict[str, float]:
    """Drives one full episode with ``PyDriver`` and returns the episode totals."""
    infos: list[dict[str, float]] = []
    driver = py_driver.PyDriver(
        env, policy, observers=[], info_observers=[infos.append], max_steps=STEPS_PER_WEEK
    )
    driver.run(env.reset())
    return infos[-1]


def _constant(env: BuildingEnv, setpoints: tuple[float, float]) -> SchedulePolicy:
    return SchedulePolicy(
        env.time_step_spec(),
        env.action_spec(),
        comfort_setpoints=setpoints,
        setback_setpoints=setpoints,
    )


def _export_in_policy_saver_layout(policy: Any, export_dir: Path) -> None:
    """Writes a SavedModel with ``PolicySaver``'s action signature and spec file."""
    batched = tensor_spec.add_outer_dims_nest(policy.time_step_spec, (None,))

    def action(time_step: ts.TimeStep, policy_state: Any) -> Any:
        return policy.action(time_step, policy_state)

    module = tf.Module()
    module.action = tf.function(action, input_signature=[batched, ()], autograph=False)
    tf.saved_model.save(module, os.fspath(export_dir))
    specs = {
        "collect_data_spec": policy.collect_data_spec,
        "policy_state_spec": policy.policy_state_spec,
    }
    tensor_spec.to_pbtxt_file(os.fspath(export_dir / policy_saver.POLICY_SPECS_PBTXT), specs)


def _fixed_tf_policy(env: BuildingEnv) -> fixed_policy.FixedPolicy:
    return fixed_policy.FixedPolicy(
        FIXED_ACTION,
        tensor_spec.from_spec(env.time_step_spec()),
        tensor_spec.from_spec(env.action_spec()),
    )


@pytest.mark.parametrize(
    ("weekday", "hour", "expected"),
    [
        (0, 10.0, COMFORT_SETPOINTS),
        (0, 3.0, SETBACK_SETPOINTS),
        (5, 10.0, SETBACK_SETPOINTS),
        (6, 12.0, SETBACK_SETPOINTS),
        (4, 17.75, COMFORT_SETPOINTS),
        (2, 18.0, SETBACK_SETPOINTS),
        (1, 7.75, SETBACK_SETPOINTS),
        (1, 8.0, COMFORT_SETPOINTS),
    ],
)
def test_schedule_policy_follows_the_clock(
    env: BuildingEnv, weekday: int, hour: float, expected: tuple[float, float]
) -> None:
    policy = SchedulePolicy(env.time_step_spec(), env.action_spec())
    action = _action_at(policy, weekday, hour)
    np.testing.assert_array_equal(action, np.asarray(expected, dtype=np.float32))
    assert action.dtype == np.float32


def test_schedule_policy_reads_time_from_env_observations(env: BuildingEnv) -> None:
    policy = SchedulePolicy(env.time_step_spec(), env.action_spec())
    step = env.reset()
    actions = []
    for _ in range(11 * 4):
        action = policy.action(step).action
        actions.append(tuple(action))
        step = env.step(action)
    assert actions[3 * 4] == SETBACK_SETPOINTS
    assert actions[10 * 4] == COMFORT_SETPOINTS
    assert actions.index(COMFORT_SETPOINTS) == 8 * 4


def test_schedule_policy_ignores_hidden_state(env: BuildingEnv) -> None:
    policy = SchedulePolicy(env.time_step_spec(), env.action_spec(), start_hour=6.0, end_hour=9.0)
    hot_occupied = make_observation(0, 7.0, zone_temp_c=35.0)
    cold_empty = make_observation(0, 10.0, zone_temp_c=5.0)
    np.testing.assert_array_equal(policy.action(ts.restart(hot_occupied)).action, COMFORT_SETPOINTS)
    np.testing.assert_array_equal(policy.action(ts.restart(cold_empty)).action, SETBACK_SETPOINTS)


def test_schedule_policy_handles_batched_time_steps(env: BuildingEnv) -> None:
    policy = SchedulePolicy(env.time_step_spec(), env.action_spec())
    batch = np.stack([make_observation(0, 10.0), make_observation(0, 3.0), make_observation(5, 9)])
    actions = policy.action(ts.restart(batch, batch_size=3)).action
    expected = np.array([COMFORT_SETPOINTS, SETBACK_SETPOINTS, SETBACK_SETPOINTS], np.float32)
    np.testing.assert_array_equal(actions, expected)


def test_schedule_policy_runs_under_py_driver(env: BuildingEnv) -> None:
    policy = SchedulePolicy(env.time_step_spec(), env.action_spec())
    trajectories: list[Any] = []
    driver = py_driver.PyDriver(env, policy, observers=[trajectories.append], max_steps=300)
    final_step, _ = driver.run(env.reset())
    assert len(trajectories) == 300
    actions = {tuple(t.action) for t in trajectories}
    assert actions == {COMFORT_SETPOINTS, SETBACK_SETPOINTS}
    assert np.isfinite(final_step.observation).all()


def test_schedule_beats_constant_setpoints_on_their_weak_side(env: BuildingEnv) -> None:
    schedule = _run_week(env, SchedulePolicy(env.time_step_spec(), env.action_spec()))
    always_comfort = _run_week(env, _constant(env, COMFORT_SETPOINTS))
    always_setback = _run_week(env, _constant(env, SETBACK_SETPOINTS))
    assert schedule["episode_discomfort"] < 0.2 * always_setback["episode_discomfort"]
    assert schedule["episode_energy_kwh"] < 0.8 * always_comfort["episode_energy_kwh"]
    assert always_comfort["episode_discomfort"] < schedule["episode_discomfort"]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"comfort_setpoints": (24.0, 20.0)}, "comfort_setpoints must be (heating, cooling)"),
        ({"setback_setpoints": (10.0, 28.0)}, "setback_setpoints (10.0, 28.0) outside"),
        ({"start_hour": 18.0, "end_hour": 8.0}, "got 18.0, 8.0"),
    ],
)
def test_schedule_policy_rejects_bad_settings(
    env: BuildingEnv, kwargs: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        SchedulePolicy(env.time_step_spec(), env.action_spec(), **kwargs)


def test_schedule_policy_rejects_non_building_specs() -> None:
    cartpole = load_env("CartPole-v0", seed=0)
    with pytest.raises(ValueError, match=r"observation spec of shape \(7,\)"):
        SchedulePolicy(cartpole.time_step_spec(), cartpole.action_spec())
    building = BuildingEnv(seed=0)
    with pytest.raises(ValueError, match="action spec"):
        SchedulePolicy(building.time_step_spec(), cartpole.action_spec())


def test_random_policy_stays_within_bounds_and_is_seeded(env: BuildingEnv) -> None:
    first = make_random_policy(env.time_step_spec(), env.action_spec(), seed=3)
    second = make_random_policy(env.time_step_spec(), env.action_spec(), seed=3)
    step = env.reset()
    actions = np.stack([first.action(step).action for _ in range(200)])
    replay = np.stack([second.action(step).action for _ in range(200)])
    spec = env.action_spec()
    assert np.all(actions >= spec.minimum) and np.all(actions <= spec.maximum)
    np.testing.assert_array_equal(actions, replay)
    assert actions.std(axis=0).min() > 3.0


def test_load_policy_builds_named_policies(env: BuildingEnv) -> None:
    schedule = load_policy("schedule", env.time_step_spec(), env.action_spec(), seed=0)
    random = load_policy("random", env.time_step_spec(), env.action_spec(), seed=0)
    assert isinstance(schedule, SchedulePolicy)
    assert isinstance(random, random_py_policy.RandomPyPolicy)
    step = env.reset()
    for policy in (schedule, random):
        step = env.step(policy.action(step).action)
    assert step.step_type == ts.StepType.MID


@pytest.mark.parametrize("name", ["greedy", "Schedule", "/no/such/policy/dir"])
def test_load_policy_rejects_unknown_names(env: BuildingEnv, name: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(name))) as raised:
        load_policy(name, env.time_step_spec(), env.action_spec(), seed=0)
    assert "'schedule', 'random'" in str(raised.value)


def test_load_policy_rejects_directory_without_saved_policy(
    env: BuildingEnv, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=policy_saver.POLICY_SPECS_PBTXT):
        load_policy(tmp_path, env.time_step_spec(), env.action_spec(), seed=0)


def test_load_policy_round_trips_a_saved_tf_policy(env: BuildingEnv, tmp_path: Path) -> None:
    _export_in_policy_saver_layout(_fixed_tf_policy(env), tmp_path)
    loaded = load_policy(tmp_path, env.time_step_spec(), env.action_spec(), seed=0)
    assert isinstance(loaded, py_tf_eager_policy.SavedModelPyTFEagerPolicy)
    trajectories: list[Any] = []
    py_driver.PyDriver(env, loaded, [trajectories.append], max_steps=5).run(env.reset())
    assert len(trajectories) == 5
    for trajectory in trajectories:
        np.testing.assert_array_equal(trajectory.action, FIXED_ACTION)
    cartpole = load_env("CartPole-v0", seed=0)
    with pytest.raises(ValueError, match="the environment has"):
        load_policy(tmp_path, cartpole.time_step_spec(), cartpole.action_spec())


def test_load_policy_reads_a_policy_saver_export(env: BuildingEnv, tmp_path: Path) -> None:
    policy_saver.PolicySaver(_fixed_tf_policy(env), batch_size=None).save(os.fspath(tmp_path))
    loaded = load_policy(tmp_path, env.time_step_spec(), env.action_spec(), seed=0)
    np.testing.assert_array_equal(loaded.action(env.reset()).action, FIXED_ACTION)

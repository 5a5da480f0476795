"""`starter.results`: what `StepRecorder` records of the steps a driver took, and the summary of
a `PopulateResult`."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from tf_agents.trajectories import trajectory

from replay_service.starter.envs import make_observation
from replay_service.starter.results import PopulateResult, StepRecorder, format_summary

FIRST, MID, LAST = 0, 1, 2


def step(step_type, next_step_type, reward, action, observation=None):
    """One unbatched trajectory with numpy values."""
    return trajectory.Trajectory(
        step_type=np.int32(step_type),
        observation=np.zeros(3, np.float32) if observation is None else observation,
        action=action,
        policy_info=(),
        next_step_type=np.int32(next_step_type),
        reward=np.asarray(reward, np.float32),
        discount=np.float32(1.0),
    )


def test_steps_are_recorded_boundaries_skipped_and_episodes_counted():
    recorder = StepRecorder(time_of_day=False)
    assert recorder.episodes == 0
    recorder(step(FIRST, MID, 1.0, np.int64(0)))
    assert recorder.episodes == 1 and recorder.episodes_finished == 0  # one in progress
    recorder(step(MID, LAST, [2.0, 0.5], np.int64(1)))  # a reward vector is summed
    recorder(step(LAST, FIRST, 99.0, np.int64(7)))  # the boundary step is not a step
    assert recorder.rewards == [1.0, 2.5]
    assert [a.tolist() for a in recorder.actions] == [[0.0], [1.0]]
    assert (recorder.episodes_finished, recorder.in_episode, recorder.episodes) == (1, False, 1)
    recorder(step(FIRST, MID, 0.0, np.int64(1)))
    assert recorder.episodes == 2
    assert recorder.hours == []


def test_nested_actions_are_flattened_into_one_float_vector():
    recorder = StepRecorder(time_of_day=False)
    recorder(step(FIRST, MID, 0.0, {"a": np.float32(1.5), "b": np.array([2, 3], np.int32)}))
    assert recorder.actions[0].dtype == np.float64
    assert recorder.actions[0].tolist() == [1.5, 2.0, 3.0]


def test_the_hour_of_day_is_decoded_from_building_observations():
    recorder = StepRecorder(time_of_day=True)
    recorder(step(FIRST, MID, 0.0, np.zeros(2), make_observation(weekday=2, hour=13.25)))
    recorder(step(MID, MID, 0.0, np.zeros(2), make_observation(weekday=2, hour=13.5)))
    assert recorder.hours == pytest.approx([13.25, 13.5])


RESULT = PopulateResult(
    buffer_name="week",
    path="/b/week",
    plot_path="/b/week.summary.png",
    env="building",
    policy="schedule",
    seed=7,
    capacity=1000,
    sequence_length=2,
    num_envs=2,
    num_runs=3,
    steps_per_run=10,
    steps=60,
    items=58,
    items_before=0,
    episodes=2,
    episodes_finished=0,
    reward_mean=-1.23456,
    reward_min=-5.0,
    reward_max=0.0,
    elapsed_s=2.0,
    mode="created",
)


def test_the_summary_names_every_number():
    lines = format_summary(RESULT).splitlines()
    assert lines == [
        "starter buffer 'week' created: /b/week",
        "  items     58 of capacity 1000 (2-step windows)",
        "  steps     60 (2 env(s) x 3 run(s) x 10 steps) in 2.0 s, 30 steps/s",
        "  episodes  2 (0 finished)",
        "  reward    mean -1.235, min -5, max 0 per step",
        "  source    env 'building', policy 'schedule', seed 7",
        "  plot      /b/week.summary.png",
    ]


def test_an_appended_summary_says_how_many_items_were_added():
    appended = dataclasses.replace(RESULT, mode="appended", items=90, items_before=58)
    assert "items     90 of capacity 1000, 32 added (2-step windows)" in format_summary(appended)
    replaced = dataclasses.replace(RESULT, mode="replaced", items_before=58)
    assert "added" not in format_summary(replaced)


def test_speed_of_an_instant_run_is_infinite_not_a_division_error():
    assert RESULT.steps_per_second == 30.0
    assert dataclasses.replace(RESULT, elapsed_s=0.0).steps_per_second == float("inf")

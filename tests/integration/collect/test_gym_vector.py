"""GymVectorWriter stores exactly a gymnasium vector env's real transitions, in both modes."""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np
import pytest
import tensorflow as tf
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from tf_agents.trajectories import time_step as ts

from conftest import all_items
from replay_service import ConfigError, SpecMismatchError

NUM_ENVS = 3
STEPS = 90
MAX_EPISODE_STEPS = 20  # short episodes: terminations and time-limit truncations both happen


class Recorder(gymnasium.Wrapper):
    """Records every real transition of one environment, as plain Python tuples."""

    def __init__(self, env: gymnasium.Env, log: list[tuple[Any, ...]]) -> None:
        super().__init__(env)
        self._log = log
        self._obs: np.ndarray | None = None

    def reset(self, **kwargs: Any) -> Any:
        obs, info = self.env.reset(**kwargs)
        self._obs = obs
        return obs, info

    def step(self, action: Any) -> Any:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._log.append(
            (self._obs.tobytes(), int(action), float(reward), obs.tobytes(), terminated, truncated)
        )
        self._obs = obs
        return obs, reward, terminated, truncated, info


def _make_envs(mode: AutoresetMode, logs: list[list[tuple[Any, ...]]]) -> SyncVectorEnv:
    def factory(i: int) -> Any:
        return lambda: Recorder(
            gymnasium.make("CartPole-v1", max_episode_steps=MAX_EPISODE_STEPS), logs[i]
        )

    return SyncVectorEnv([factory(i) for i in range(NUM_ENVS)], autoreset_mode=mode)


def _stored_transitions(manager: Any, data_spec: Any) -> list[tuple[Any, ...]]:
    """Every stored 2-step item as (obs, action, reward, next_obs, terminated, truncated)."""
    items = all_items(manager.py_client, manager.table_name, manager.num_frames())
    out = []
    for flat in items.values():
        step = tf.nest.pack_sequence_as(data_spec, flat)
        assert step.step_type[0] != ts.StepType.LAST  # no window starts at an episode's end
        ended = step.next_step_type[0] == ts.StepType.LAST
        out.append(
            (
                step.observation[0].tobytes(),
                int(step.action[0]),
                float(step.reward[0]),
                step.observation[1].tobytes(),
                bool(ended and step.discount[0] == 0),
                bool(ended and step.discount[0] != 0),
            )
        )
    return out


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP])
def test_stored_transitions_equal_the_envs_real_ones(
    make_manager: Any, data_spec: Any, mode: AutoresetMode
) -> None:
    logs: list[list[tuple[Any, ...]]] = [[] for _ in range(NUM_ENVS)]
    envs = _make_envs(mode, logs)
    manager = make_manager(data_spec=data_spec)
    manager.create_replay_buffer()
    writer = manager.gym_vector_writer(envs)
    assert writer.autoreset_mode.name == mode.name
    rng = np.random.default_rng(0)
    obs, _ = envs.reset(seed=0)
    writer.reset(obs)
    for _ in range(STEPS):
        actions = rng.integers(0, 2, size=NUM_ENVS)
        writer.add(actions, *envs.step(actions))
    writer.close()
    envs.close()

    everything = [t for log in logs for t in log]
    # The last transition of an episode still running at close() is in no item (as with
    # TF-Agents' observer): an item needs the step after it.
    truth = [t for log in logs for t in (log if log[-1][4] or log[-1][5] else log[:-1])]
    assert any(t[4] for t in truth) and any(t[5] for t in truth)  # both kinds of ends occurred
    stored = _stored_transitions(manager, data_spec)
    assert sorted(stored) == sorted(truth)
    assert manager.num_frames() == len(truth)
    assert writer.transitions == len(everything)
    resets = NUM_ENVS * STEPS - len(everything)
    assert writer.reset_steps == resets
    assert (resets > 0) == (mode is AutoresetMode.NEXT_STEP)


def test_naive_add_multi_on_next_step_would_store_reset_steps(make_manager, data_spec) -> None:
    """The failure the vector writer prevents: the reset step looks like a transition."""
    logs: list[list[tuple[Any, ...]]] = [[] for _ in range(NUM_ENVS)]
    envs = _make_envs(AutoresetMode.NEXT_STEP, logs)
    manager = make_manager(data_spec=data_spec)
    manager.create_replay_buffer()
    writer = manager.transition_writer()
    obs, _ = envs.reset(seed=0)
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        actions = rng.integers(0, 2, size=NUM_ENVS)
        next_obs, rewards, terminated, truncated, _ = envs.step(actions)
        writer.add_multi(
            obs, actions, rewards, next_obs, terminated, truncated, final_states=next_obs
        )
        obs = next_obs
    writer.close()
    truth = {t for log in logs for t in log}
    stored = _stored_transitions(manager, data_spec)
    assert len([t for t in stored if t not in truth]) > 0


def test_mode_mismatches_are_refused_before_anything_is_written(make_manager, data_spec) -> None:
    manager = make_manager(data_spec=data_spec)
    manager.create_replay_buffer()
    for env_mode, writer_mode, message in (
        (AutoresetMode.NEXT_STEP, "same_step", r"no final observation .* is the env NEXT_STEP"),
        (AutoresetMode.SAME_STEP, "next_step", r"infos holds final observations for envs"),
    ):
        envs = _make_envs(env_mode, [[] for _ in range(NUM_ENVS)])
        writer = manager.gym_vector_writer(envs, autoreset_mode=writer_mode)
        obs, _ = envs.reset(seed=1)
        writer.reset(obs)
        confirmed = manager.num_frames()
        with pytest.raises(SpecMismatchError, match=message):
            for _ in range(STEPS):
                actions = np.zeros(NUM_ENVS, np.int64)  # always left: episodes end soon
                writer.add(actions, *envs.step(actions))
                writer.flush()
                confirmed = manager.num_frames()
        writer.flush()
        assert manager.num_frames() == confirmed  # the refused step wrote nothing
        assert writer.transitions > 0
        writer.close()
        envs.close()


def test_bad_sizes_and_modes_name_the_value(make_manager, data_spec) -> None:
    manager = make_manager(data_spec=data_spec)
    manager.create_replay_buffer()
    with pytest.raises(ConfigError, match="DISABLED"):
        manager.gym_vector_writer(2, autoreset_mode=AutoresetMode.DISABLED)
    with pytest.raises(ConfigError, match="autoreset_mode"):
        manager.gym_vector_writer(2)
    writer = manager.gym_vector_writer(2, autoreset_mode="next_step")
    with pytest.raises(SpecMismatchError, match=r"expected a leading dimension of 2.*\[3, 4\]"):
        writer.reset(np.zeros([3, 4], np.float32))

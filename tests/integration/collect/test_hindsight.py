"""Hindsight experience replay (pytorchrl's HERBuffer) on both backends: a buffer made with
`from_spaces` of a gymnasium Dict goal space, filled by `hindsight_writer`, holds every
transition and exactly the relabels its strategy prescribes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import gymnasium
import numpy as np
import pytest
from gymnasium import spaces

from conftest import FAST_TIMEOUTS
from replay_service import ConfigError, ReplayBufferManager, SpecMismatchError

pytestmark = pytest.mark.heavy

EPISODE_LENGTH = 5
EPISODES = 3
TOLERANCE = 0.05
FAR_GOAL = np.array([100.0, 100.0], np.float32)  # never achieved: originals all fail


class GoalLine(gymnasium.Env):
    """A point moving in the plane towards a fixed, far goal (gymnasium-robotics' layout)."""

    def __init__(self) -> None:
        box = spaces.Box(-1000.0, 1000.0, (2,), np.float32)
        self.observation_space = spaces.Dict(
            {"observation": box, "achieved_goal": box, "desired_goal": box}
        )
        self.action_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self._position = np.zeros(2, np.float32)
        self._steps = 0

    def _observation(self) -> dict[str, np.ndarray]:
        return {
            "observation": self._position.copy(),
            "achieved_goal": self._position.copy(),
            "desired_goal": FAR_GOAL.copy(),
        }

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[Any, dict]:
        super().reset(seed=seed)
        start = 10.0 * (seed or 0)
        self._position = np.array([start, -start], np.float32)
        self._steps = 0
        return self._observation(), {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        self._position = (self._position + np.asarray(action, np.float32)).astype(np.float32)
        self._steps += 1
        observation = self._observation()
        info = {"step": self._steps}
        reward = float(
            self.compute_reward(observation["achieved_goal"], observation["desired_goal"], info)
        )
        return observation, reward, False, self._steps >= EPISODE_LENGTH, info

    @staticmethod
    def compute_reward(achieved_goal: Any, desired_goal: Any, info: Any) -> Any:
        """gymnasium-robotics' sparse reward: 0 within TOLERANCE of the goal, else -1."""
        distance = np.linalg.norm(np.asarray(achieved_goal) - np.asarray(desired_goal), axis=-1)
        return -(distance > TOLERANCE).astype(np.float32)


@pytest.fixture(params=("reverb", "local"))
def make(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Callable[..., Any]]:
    made: list[ReplayBufferManager] = []

    def factory(observation_space: Any = None, **kwargs: Any) -> ReplayBufferManager:
        env = GoalLine()
        kwargs.setdefault("capacity", 1000)
        manager = ReplayBufferManager.from_spaces(
            env.observation_space if observation_space is None else observation_space,
            env.action_space,
            checkpoint_dir=str(tmp_path / f"ckpt{len(made)}"),
            backend=request.param,
            timeouts=FAST_TIMEOUTS,
            **kwargs,
        )
        made.append(manager)
        return manager

    yield factory
    for manager in made:
        manager.close()


def collect(writer: Any) -> list[list[dict[str, Any]]]:
    """Runs EPISODES episodes through `writer`; returns each episode's transitions."""
    env = GoalLine()
    episodes = []
    for episode in range(EPISODES):
        observation, _ = env.reset(seed=episode + 1)
        transitions = []
        for step in range(EPISODE_LENGTH):
            action = np.array([0.5 + 0.1 * step, 0.25 * (episode + 1)], np.float32)
            next_observation, reward, terminated, truncated, info = env.step(action)
            writer.add(observation, action, reward, next_observation, terminated, truncated, info)
            transitions.append(
                {"state": observation, "action": action, "next": next_observation, "info": info}
            )
            observation = next_observation
        episodes.append(transitions)
    writer.flush()
    return episodes


def stored_transitions(manager: ReplayBufferManager) -> dict[str, np.ndarray]:
    """Every item of the buffer as numpy transition fields (one epoch batch of all of them)."""
    (batch,) = list(manager.epoch_batches(len(manager), transitions=True, seed=0))
    return {
        "state_obs": batch.states["observation"].numpy(),
        "state_goal": batch.states["desired_goal"].numpy(),
        "next_obs": batch.next_states["observation"].numpy(),
        "next_achieved": batch.next_states["achieved_goal"].numpy(),
        "next_goal": batch.next_states["desired_goal"].numpy(),
        "action": batch.actions.numpy(),
        "reward": batch.rewards.numpy(),
        "done": batch.dones.numpy(),
        "truncated": batch.truncated.numpy(),
    }


def origin(
    episodes: list[list[dict[str, Any]]], state_obs: np.ndarray, action: np.ndarray
) -> tuple[int, int]:
    """`(episode, t)` of the collected transition with this state and action."""
    for e, transitions in enumerate(episodes):
        for t, transition in enumerate(transitions):
            if np.array_equal(transition["state"]["observation"], state_obs) and np.array_equal(
                transition["action"], action
            ):
                return e, t
    raise AssertionError(f"no collected transition has state {state_obs} and action {action}")


@pytest.mark.parametrize(("strategy", "k"), [("future", 3), ("final", 1)])
def test_relabels_are_exactly_what_the_strategy_prescribes(make, strategy, k):
    manager = make()
    manager.create_replay_buffer()
    seen_infos: list[Any] = []

    def compute_reward(achieved_goal: Any, desired_goal: Any, info: Any) -> Any:
        seen_infos.append(info)
        return GoalLine.compute_reward(achieved_goal, desired_goal, info)

    writer = manager.hindsight_writer(compute_reward, strategy=strategy, k=k, seed=7)
    episodes = collect(writer)

    transitions = EPISODES * EPISODE_LENGTH
    assert len(manager) == transitions * (1 + k)
    assert writer.relabelled == transitions * k
    # One vectorised call per episode, with each relabel's info dict.
    assert len(seen_infos) == EPISODES
    for infos in seen_infos:
        assert isinstance(infos, np.ndarray) and infos.dtype == object
        assert len(infos) == EPISODE_LENGTH * k

    items = stored_transitions(manager)
    per_transition: dict[tuple[int, int], int] = {}
    originals = 0
    for i in range(len(items["reward"])):
        e, t = origin(episodes, items["state_obs"][i], items["action"][i])
        transition = episodes[e][t]
        np.testing.assert_array_equal(items["next_obs"][i], transition["next"]["observation"])
        goal = items["state_goal"][i]
        np.testing.assert_array_equal(items["next_goal"][i], goal)
        if np.array_equal(goal, FAR_GOAL):  # the original transition, as collected
            originals += 1
            assert items["reward"][i] == -1.0
            assert items["truncated"][i] == (t == EPISODE_LENGTH - 1)
            continue
        per_transition[(e, t)] = per_transition.get((e, t), 0) + 1
        achieved_later = [episodes[e][j]["next"]["achieved_goal"] for j in range(t, EPISODE_LENGTH)]
        if strategy == "final":
            np.testing.assert_array_equal(goal, episodes[e][-1]["next"]["achieved_goal"])
        else:
            assert any(np.array_equal(goal, g) for g in achieved_later), (e, t, goal)
        expected = GoalLine.compute_reward(transition["next"]["achieved_goal"], goal, {})
        assert items["reward"][i] == expected
        assert not items["done"][i] and items["truncated"][i]
    assert originals == transitions
    assert per_transition == {(e, t): k for e in range(EPISODES) for t in range(EPISODE_LENGTH)}
    # Relabels to a goal reached at that very transition succeed (reward 0); "final" gives
    # one per episode at least (its last transition).
    assert (items["reward"] == 0.0).sum() >= EPISODES


def test_future_goals_spread_over_the_rest_of_the_episode(make):
    """With many relabels, a first transition's goals cover every later achieved goal."""
    manager = make()
    manager.create_replay_buffer()
    writer = manager.hindsight_writer(GoalLine.compute_reward, strategy="future", k=40, seed=1)
    episodes = collect(writer)
    items = stored_transitions(manager)
    first = episodes[0][0]["state"]["observation"]
    goals = {
        tuple(items["state_goal"][i])
        for i in range(len(items["reward"]))
        if np.array_equal(items["state_obs"][i], first)
        and not np.array_equal(items["state_goal"][i], FAR_GOAL)
    }
    assert goals == {tuple(t["next"]["achieved_goal"]) for t in episodes[0]}


@pytest.mark.parametrize(
    ("space", "named"),
    [
        (spaces.Box(-1.0, 1.0, (2,), np.float32), "Box|TensorSpec|ArraySpec"),
        (
            spaces.Dict(
                {
                    "observation": spaces.Box(-1.0, 1.0, (2,), np.float32),
                    "achieved_goal": spaces.Box(-1.0, 1.0, (2,), np.float32),
                }
            ),
            r"keys \['achieved_goal', 'observation'\]",
        ),
        (
            spaces.Dict(
                {
                    "observation": spaces.Box(-1.0, 1.0, (2,), np.float32),
                    "achieved_goal": spaces.Box(-1.0, 1.0, (2,), np.float32),
                    "desired_goal": spaces.Box(-1.0, 1.0, (3,), np.float32),
                }
            ),
            r"\[2\].*\[3\]",
        ),
    ],
)
def test_a_non_goal_observation_space_is_refused(make, space, named):
    manager = make(space)
    manager.create_replay_buffer()
    with pytest.raises(ConfigError, match=named):
        manager.hindsight_writer(GoalLine.compute_reward)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"strategy": "episode"}, "'episode'"),
        ({"k": 0}, r"k must be a positive integer \(relabels per transition\), got 0"),
        ({"k": True}, "got True"),
        ({"strategy": "final", "k": 4}, "k=4"),
        ({"seed": -1}, "got -1"),
    ],
)
def test_bad_options_are_refused(make, kwargs, named):
    manager = make()
    manager.create_replay_buffer()
    with pytest.raises(ConfigError, match=named):
        manager.hindsight_writer(GoalLine.compute_reward, **kwargs)
    with pytest.raises(ConfigError, match="compute_reward must be callable"):
        manager.hindsight_writer("reward")


def test_items_longer_than_transitions_are_refused(make):
    manager = make(sequence_length=3)
    manager.create_replay_buffer()
    with pytest.raises(ConfigError, match="sequence_length=3"):
        manager.hindsight_writer(GoalLine.compute_reward)


def test_a_reward_function_of_the_wrong_shape_is_named_and_the_episode_kept(make):
    manager = make()
    manager.create_replay_buffer()
    writer = manager.hindsight_writer(lambda a, d, info: np.zeros(2), strategy="final")
    env = GoalLine()
    observation, _ = env.reset(seed=1)
    with pytest.raises(SpecMismatchError, match=r"shape \[2\]"):
        for _ in range(EPISODE_LENGTH):
            action = np.array([0.5, 0.5], np.float32)
            next_observation, reward, terminated, truncated, info = env.step(action)
            writer.add(observation, action, reward, next_observation, terminated, truncated, info)
            observation = next_observation
    writer.flush()
    assert len(manager) == EPISODE_LENGTH  # the collected transitions, no relabel

"""Warm-up from any policy and weighted table mixes for PyTorch, on both backends.

Velora's `warm(agent, n_samples, num_envs)` is `manager.warm_up(env, num_steps, policy)`
(gymnasium envs and vector envs, random actions by default); `mixed_dataset`'s weighted mix of
tables is `manager.mixed_torch_batches(batch_size, weights)` for PyTorch. `GymVectorWriter.add`
takes the extras declared with `from_spaces(extras=...)`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import gymnasium
import numpy as np
import pytest
import torch
from gymnasium import spaces
from gymnasium.vector import SyncVectorEnv

from conftest import FAST_TIMEOUTS
from replay_service import (
    ReplayBufferManager,
    SpecMismatchError,
)

pytestmark = pytest.mark.heavy

BACKENDS = ("reverb", "local")
OBSERVATION = spaces.Box(-10.0, 10.0, (4,), np.float32)
ACTION = spaces.Discrete(2)
NUM_ENVS = 3
MAX_EPISODE_STEPS = 5  # every few steps a time-limit truncation
RECENT = "recent"
RECENT_CAPACITY = 8
SIGMAS = 5


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture()
def make(backend: str, tmp_path: Any) -> Iterator[Callable[..., ReplayBufferManager]]:
    """`from_spaces` managers of the parametrized backend, closed at teardown."""
    made: list[ReplayBufferManager] = []

    def factory(name: str = "ckpt", observation: Any = OBSERVATION, **kwargs: Any) -> Any:
        kwargs.setdefault("capacity", 500)
        kwargs.setdefault("timeouts", FAST_TIMEOUTS)
        manager = ReplayBufferManager.from_spaces(
            observation,
            ACTION,
            checkpoint_dir=str(tmp_path / name),
            backend=backend,
            **kwargs,
        )
        made.append(manager)
        return manager

    yield factory
    for manager in made:
        manager.close()


class Recorder(gymnasium.Wrapper):
    """Records every real transition of one environment as plain Python values."""

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
        assert self._obs is not None
        self._log.append(
            (
                tuple(self._obs.tolist()),
                int(action),
                float(reward),
                tuple(obs.tolist()),
                bool(terminated),
                bool(truncated) and not terminated,
            )
        )
        self._obs = obs
        return obs, reward, terminated, truncated, info


def cartpole(log: list[tuple[Any, ...]]) -> gymnasium.Env:
    return Recorder(gymnasium.make("CartPole-v1", max_episode_steps=MAX_EPISODE_STEPS), log)


def stored(manager: ReplayBufferManager, table: str | None = None) -> list[tuple[Any, ...]]:
    """Every stored transition once, as `Recorder` logs them."""
    out = []
    for batch in manager.epoch_batches(64, transitions=True, table=table):
        for i in range(batch.states.shape[0]):
            out.append(
                (
                    tuple(batch.states[i].tolist()),
                    int(batch.actions[i]),
                    float(batch.rewards[i]),
                    tuple(batch.next_states[i].tolist()),
                    bool(batch.dones[i]),
                    bool(batch.truncated[i]),
                )
            )
    return out


def cut_at_the_end(log: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """An env's log with its last transition ended as truncated (the warm-up's budget)."""
    *head, (state, action, reward, next_state, done, _) = log
    return [*head, (state, action, reward, next_state, done, not done)]


# ------------------------------------------------------------- GymVectorWriter and extras


def test_gym_vector_writer_splits_extras_per_env(make):
    manager = make(extras={"hidden": ((2,), np.float32), "log_prob": ((), np.float32)})
    manager.create_replay_buffer()
    envs = SyncVectorEnv([lambda: cartpole([]) for _ in range(NUM_ENVS)])
    writer = manager.gym_vector_writer(envs)
    obs, _ = envs.reset(seed=0)
    writer.reset(obs)
    actions = np.zeros(NUM_ENVS, np.int64)
    for _ in range(4):
        hidden = np.stack([obs[:, 0], obs[:, 1]], axis=1)
        log_prob = np.arange(NUM_ENVS, dtype=np.float32)
        obs, *rest = envs.step(actions)
        writer.add(actions, obs, *rest, hidden=hidden, log_prob=log_prob)
    with pytest.raises(SpecMismatchError, match=r"extra\(s\) \['log_prob'\] required"):
        writer.add(actions, *envs.step(actions), hidden=np.zeros((NUM_ENVS, 2), np.float32))
    with pytest.raises(SpecMismatchError, match="hidden: expected a leading dimension of 3"):
        writer.add(actions, *envs.step(actions), hidden=np.zeros((2, 2)), log_prob=np.zeros(2))
    writer.flush()
    batches = list(manager.epoch_batches(64, transitions=True))
    states = torch.cat([b.states for b in batches])
    hiddens = torch.cat([b.hiddens["hidden"] for b in batches])
    torch.testing.assert_close(hiddens, states[:, :2])
    log_probs = torch.cat([b.hiddens["log_prob"] for b in batches])
    # 4 steps per env; the 4th transition waits for its episode's next step.
    assert sorted(log_probs.tolist()) == [0.0] * 3 + [1.0] * 3 + [2.0] * 3

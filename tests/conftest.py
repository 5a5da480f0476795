"""Shared fixtures: a real CartPole environment, its data spec, and managers that clean up."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import reverb
from tf_agents.drivers import py_driver
from tf_agents.environments import suite_gym
from tf_agents.policies import random_py_policy

from replay_service import ReplayBufferManager, Timeouts
from replay_service.demo import collect_data_spec

FAST_TIMEOUTS = Timeouts(connect=5.0, write=10.0, sample=1.0, checkpoint=60.0)


@pytest.fixture()
def env() -> Any:
    """A CartPole-v0 py environment."""
    environment = suite_gym.load("CartPole-v0")
    environment.seed(0)
    return environment


@pytest.fixture()
def policy(env: Any) -> Any:
    """A seeded random policy for `env`."""
    return random_py_policy.RandomPyPolicy(env.time_step_spec(), env.action_spec(), seed=0)


@pytest.fixture()
def data_spec(env: Any, policy: Any) -> Any:
    """The per-step Trajectory spec of `env` (what `agent.collect_data_spec` gives)."""
    return collect_data_spec(env, policy)


@pytest.fixture()
def make_manager(data_spec: Any, tmp_path: Any) -> Iterator[Callable[..., ReplayBufferManager]]:
    """Builds managers (default: CartPole spec, capacity 1000, tmp checkpoint dir) and closes
    every one of them at teardown."""
    made: list[ReplayBufferManager] = []

    def factory(**kwargs: Any) -> ReplayBufferManager:
        kwargs.setdefault("data_spec", data_spec)
        kwargs.setdefault("capacity", 1000)
        if "server_address" not in kwargs:
            kwargs.setdefault("checkpoint_dir", str(tmp_path / "ckpt"))
        kwargs.setdefault("timeouts", FAST_TIMEOUTS)
        manager = ReplayBufferManager(**kwargs)
        made.append(manager)
        return manager

    yield factory
    for manager in made:
        manager.close()


def collect(env: Any, policy: Any, observer: Any, steps: int) -> None:
    """Runs `steps` non-boundary environment steps through `observer` and flushes it."""
    py_driver.PyDriver(env, policy, [observer], max_steps=steps).run(env.reset())
    observer.flush()


def all_items(client: reverb.Client, table: str, expected: int) -> dict[int, list[np.ndarray]]:
    """Samples a uniform table until every one of its `expected` items was seen.

    Returns:
      Item key -> flattened item data.
    """
    items: dict[int, list[np.ndarray]] = {}
    for _ in range(200):
        for sample in client.sample(table, num_samples=200, emit_timesteps=False):
            items[int(sample.info.key)] = [np.asarray(x) for x in sample.data]
        if len(items) >= expected:
            break
    assert len(items) == expected, f"saw {len(items)} distinct items, expected {expected}"
    return items

"""Environments for the replay service and a loader by name.

The constants (`constants.py`) and `check_env_id` load without TF-Agents; `BuildingEnv` and the
other names of `building.py` are imported on first use, so that a command's `--help` and its
checks of an `--env` id load no TensorFlow.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from replay_service.starter.envs.constants import (
    BUILDING_ENV_ID,
    STEP_MINUTES,
    STEPS_PER_DAY,
    STEPS_PER_WEEK,
)

if TYPE_CHECKING:
    from tf_agents.environments import py_environment

__all__ = [
    "BUILDING_ENV_ID",
    "OBS_FIELDS",
    "OBS_SIZE",
    "STEPS_PER_DAY",
    "STEPS_PER_WEEK",
    "STEP_MINUTES",
    "BuildingEnv",
    "check_env_id",
    "decode_time",
    "is_occupied",
    "load_env",
    "make_observation",
]

# Names of `building.py` (TF-Agents), imported on first use.
_BUILDING_NAMES = frozenset(
    {"OBS_FIELDS", "OBS_SIZE", "BuildingEnv", "decode_time", "is_occupied", "make_observation"}
)


def __getattr__(name: str) -> object:
    """Imports `building.py` on first use of one of its names (see `_BUILDING_NAMES`).

    Raises:
      AttributeError: If `name` is not a public name of replay_service.starter.envs.
    """
    if name == "building":  # `replay_service.starter.envs.building`, the submodule
        return importlib.import_module("replay_service.starter.envs.building")
    if name not in _BUILDING_NAMES:
        raise AttributeError(f"module 'replay_service.starter.envs' has no attribute {name!r}")
    value = getattr(importlib.import_module("replay_service.starter.envs.building"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_BUILDING_NAMES})


def check_env_id(name: str) -> None:
    """Checks that `load_env` knows the id `name`, in gym's registry: without TF-Agents, and
    without creating the environment.

    Args:
        name: ``"building"`` or a gym id such as ``"CartPole-v0"`` (``"module:Id"`` imports
            the module first, as gym does).

    Raises:
        ValueError: If ``name`` is neither ``"building"`` nor a registered gym id; the message
            names it.
    """
    if name == BUILDING_ENV_ID:
        return
    import gym

    try:
        gym.spec(name)  # what suite_gym.load looks up first
    except gym.error.Error as err:
        raise _unknown_env(name, err) from err


def _unknown_env(name: str, err: Exception) -> ValueError:
    reason = str(err).splitlines()[0]
    return ValueError(
        f"unknown environment id {name!r}: expected {BUILDING_ENV_ID!r} or a registered "
        f"gym id such as 'CartPole-v0' ({reason})"
    )


def load_env(name: str, seed: int | None = None) -> py_environment.PyEnvironment:
    """Creates an environment by id.

    Args:
        name: ``"building"`` for :class:`BuildingEnv`, otherwise a registered gym id such as
            ``"CartPole-v0"`` loaded through ``suite_gym``.
        seed: Seed passed to the environment; None leaves it unseeded.

    Returns:
        A ``PyEnvironment``.

    Raises:
        ValueError: If ``name`` is neither ``"building"`` nor a loadable gym id.
    """
    check_env_id(name)
    if name == BUILDING_ENV_ID:
        from replay_service.starter.envs.building import BuildingEnv

        return BuildingEnv(seed=seed)
    import gym
    from tf_agents.environments import suite_gym

    try:
        env = suite_gym.load(name)
    except gym.error.Error as err:
        raise _unknown_env(name, err) from err
    if seed is not None:
        env.seed(seed)
    return env

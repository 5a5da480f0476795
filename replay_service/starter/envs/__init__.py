"""Environments for the replay service and a loader by name."""

from __future__ import annotations

from tf_agents.environments import py_environment

from replay_service.starter.envs.building import (
    OBS_FIELDS,
    OBS_SIZE,
    STEP_MINUTES,
    STEPS_PER_DAY,
    STEPS_PER_WEEK,
    BuildingEnv,
    decode_time,
    is_occupied,
    make_observation,
)

BUILDING_ENV_ID = "building"

__all__ = [
    "BUILDING_ENV_ID",
    "OBS_FIELDS",
    "OBS_SIZE",
    "STEPS_PER_DAY",
    "STEPS_PER_WEEK",
    "STEP_MINUTES",
    "BuildingEnv",
    "decode_time",
    "is_occupied",
    "load_env",
    "make_observation",
]


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
    if name == BUILDING_ENV_ID:
        return BuildingEnv(seed=seed)
    import gym
    from tf_agents.environments import suite_gym

    try:
        env = suite_gym.load(name)
    except gym.error.Error as err:
        reason = str(err).splitlines()[0]
        raise ValueError(
            f"unknown environment id {name!r}: expected {BUILDING_ENV_ID!r} or a registered "
            f"gym id such as 'CartPole-v0' ({reason})"
        ) from err
    if seed is not None:
        env.seed(seed)
    return env

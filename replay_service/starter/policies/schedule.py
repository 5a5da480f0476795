"""Baseline policies for ``BuildingEnv`` and a loader for policies by name or path."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import tensorflow as tf
from tf_agents.policies import py_policy, py_tf_eager_policy, random_py_policy
from tf_agents.policies.policy_saver import POLICY_SPECS_PBTXT
from tf_agents.specs import array_spec
from tf_agents.trajectories import policy_step
from tf_agents.trajectories import time_step as ts
from tf_agents.typing import types

from replay_service.backends.reverb.platform import inspect_patch
from replay_service.starter.envs.building import OBS_SIZE, decode_time

inspect_patch.patch_inspect()  # lets PolicySaver save policies (see inspect_patch)

POLICY_CHOICES = ("schedule", "random")
COMFORT_SETPOINTS = (20.0, 24.0)
SETBACK_SETPOINTS = (15.0, 28.0)
COMFORT_START_HOUR = 8.0
COMFORT_END_HOUR = 18.0
COMFORT_WEEKDAYS = (0, 1, 2, 3, 4)


def _check_building_specs(time_step_spec: ts.TimeStep, action_spec: types.NestedArraySpec) -> None:
    observation_spec = time_step_spec.observation
    if not isinstance(observation_spec, array_spec.ArraySpec) or observation_spec.shape != (
        OBS_SIZE,
    ):
        raise ValueError(
            f"schedule policy needs a BuildingEnv observation spec of shape ({OBS_SIZE},), "
            f"got {observation_spec!r}"
        )
    if not (
        isinstance(action_spec, array_spec.BoundedArraySpec)
        and action_spec.shape == (2,)
        and np.issubdtype(action_spec.dtype, np.floating)
    ):
        raise ValueError(
            f"schedule policy needs a bounded float (2,) setpoint action spec, got {action_spec!r}"
        )


class SchedulePolicy(py_policy.PyPolicy):
    """Comfort setpoints during scheduled hours, setback setpoints otherwise.

    The decision uses only the observation's time-of-day and day-of-week features, so the
    policy works on any observation laid out like ``BuildingEnv``'s, batched or not.
    """

    def __init__(
        self,
        time_step_spec: ts.TimeStep,
        action_spec: types.NestedArraySpec,
        *,
        comfort_setpoints: tuple[float, float] = COMFORT_SETPOINTS,
        setback_setpoints: tuple[float, float] = SETBACK_SETPOINTS,
        start_hour: float = COMFORT_START_HOUR,
        end_hour: float = COMFORT_END_HOUR,
        weekdays: Sequence[int] = COMFORT_WEEKDAYS,
    ) -> None:
        """Creates the policy.

        Args:
            time_step_spec: Time step spec of a ``BuildingEnv``.
            action_spec: Bounded ``(2,)`` float setpoint action spec.
            comfort_setpoints: ``(heating, cooling)`` used inside the schedule.
            setback_setpoints: ``(heating, cooling)`` used outside the schedule.
            start_hour: First hour of the daily comfort window, inclusive.
            end_hour: End of the daily comfort window, exclusive.
            weekdays: Weekdays (Monday = 0) on which the comfort window applies.

        Raises:
            ValueError: If the specs are not BuildingEnv-shaped, a setpoint pair is inverted
                or outside the action bounds, or the hours are not ``0 <= start < end <= 24``.
        """
        _check_building_specs(time_step_spec, action_spec)
        super().__init__(time_step_spec, action_spec)
        if not 0.0 <= start_hour < end_hour <= 24.0:
            raise ValueError(f"need 0 <= start_hour < end_hour <= 24, got {start_hour}, {end_hour}")
        self._comfort = self._check_setpoints("comfort_setpoints", comfort_setpoints)
        self._setback = self._check_setpoints("setback_setpoints", setback_setpoints)
        self._start_hour = float(start_hour)
        self._end_hour = float(end_hour)
        self._weekdays = frozenset(int(day) for day in weekdays)

    def _check_setpoints(self, name: str, pair: tuple[float, float]) -> np.ndarray:
        setpoints = np.asarray(pair, dtype=self.action_spec.dtype)
        low, high = self.action_spec.minimum, self.action_spec.maximum
        if setpoints.shape != (2,) or setpoints[0] > setpoints[1]:
            raise ValueError(f"{name} must be (heating, cooling) with heating <= cooling: {pair}")
        if np.any(setpoints < low) or np.any(setpoints > high):
            raise ValueError(f"{name} {pair} outside the action bounds [{low}, {high}]")
        return setpoints

    def in_schedule(self, observation: np.ndarray) -> bool:
        """Returns whether a single observation falls inside the comfort window.

        Args:
            observation: One observation laid out like ``BuildingEnv``'s.

        Returns:
            True when the comfort setpoints apply.
        """
        hour, weekday = decode_time(observation)
        return weekday in self._weekdays and self._start_hour <= hour < self._end_hour

    def _setpoints(self, observation: np.ndarray) -> np.ndarray:
        return self._comfort if self.in_schedule(observation) else self._setback

    def _action(
        self, time_step: ts.TimeStep, policy_state: types.NestedArray
    ) -> policy_step.PolicyStep:
        observation = np.asarray(time_step.observation)
        if observation.ndim == 1:
            action = self._setpoints(observation).copy()
        else:
            flat = observation.reshape(-1, OBS_SIZE)
            action = np.stack([self._setpoints(obs) for obs in flat])
            action = action.reshape((*observation.shape[:-1], 2))
        return policy_step.PolicyStep(action, policy_state, ())


def make_random_policy(
    time_step_spec: ts.TimeStep, action_spec: types.NestedArraySpec, seed: int | None = None
) -> random_py_policy.RandomPyPolicy:
    """Returns a policy sampling uniformly within the action bounds.

    Args:
        time_step_spec: Environment time step spec.
        action_spec: Environment action spec.
        seed: Seed for the sampler; None draws fresh entropy.

    Returns:
        A ``RandomPyPolicy``.
    """
    return random_py_policy.RandomPyPolicy(time_step_spec, action_spec, seed=seed)


def load_policy(
    name_or_path: str | os.PathLike[str],
    time_step_spec: ts.TimeStep,
    action_spec: types.NestedArraySpec,
    seed: int | None = None,
) -> py_policy.PyPolicy:
    """Builds a policy by name or loads one saved with ``PolicySaver``.

    Args:
        name_or_path: ``"schedule"``, ``"random"`` or a saved policy directory.
        time_step_spec: Environment time step spec.
        action_spec: Environment action spec.
        seed: Seed for the random policy; ignored otherwise.

    Returns:
        A ``PyPolicy``.

    Raises:
        ValueError: If the name is unknown, the path is not a directory, or the specs do not
            suit the requested policy.
    """
    name = os.fspath(name_or_path)
    if name == "schedule":
        return SchedulePolicy(time_step_spec, action_spec)
    if name == "random":
        return make_random_policy(time_step_spec, action_spec, seed)
    if os.path.isdir(name):
        return _load_saved_policy(name, time_step_spec, action_spec)
    raise ValueError(
        f"unknown policy {name!r}: expected one of {POLICY_CHOICES} or a saved policy directory"
    )


def _load_saved_policy(
    path: str, time_step_spec: ts.TimeStep, action_spec: types.NestedArraySpec
) -> py_policy.PyPolicy:
    if not os.path.exists(os.path.join(path, POLICY_SPECS_PBTXT)):
        raise ValueError(f"{path!r} is not a saved policy: missing {POLICY_SPECS_PBTXT}")
    policy = py_tf_eager_policy.SavedModelPyTFEagerPolicy(path, load_specs_from_pbtxt=True)
    saved = _spec_signature((policy.time_step_spec.observation, policy.action_spec))
    expected = _spec_signature((time_step_spec.observation, action_spec))
    if saved != expected:
        raise ValueError(
            f"saved policy at {path!r} has (observation, action) shapes and dtypes {saved}, "
            f"the environment has {expected}"
        )
    return policy


def _spec_signature(spec: types.NestedSpec) -> list[tuple[tuple[int, ...], np.dtype]]:
    return [
        (tuple(s.shape), np.dtype(tf.as_dtype(s.dtype).as_numpy_dtype))
        for s in tf.nest.flatten(spec)
    ]

"""Single thermal zone building simulator exposed as a TF-Agents ``PyEnvironment``.

The zone follows a first-order RC model: heat flows through the envelope towards the outdoor
temperature, occupants add internal gains, and an HVAC unit with limited heating and cooling
power holds the zone inside the band ``[heating_setpoint, cooling_setpoint]`` chosen by the
agent. Each step covers 15 minutes; an episode is a time-limited stretch (one week by default)
and therefore ends with ``ts.truncation`` (discount 1.0) rather than a terminal state.

Observation layout (float32 vector, see ``OBS_FIELDS``)::

    0 zone_temp     zone air temperature, degC
    1 outdoor_temp  outdoor air temperature, degC
    2 occupancy     1.0 when the zone is occupied, else 0.0
    3 sin_time      sin(2*pi * step_of_day / STEPS_PER_DAY)
    4 cos_time      cos(2*pi * step_of_day / STEPS_PER_DAY)
    5 sin_weekday   sin(2*pi * weekday / 7), Monday = 0
    6 cos_weekday   cos(2*pi * weekday / 7)
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from tf_agents.environments import py_environment
from tf_agents.specs import array_spec
from tf_agents.trajectories import time_step as ts

from replay_service.starter.envs.constants import (
    DAYS_PER_WEEK,
    STEP_HOURS,
    STEPS_PER_DAY,
    STEPS_PER_HOUR,
    STEPS_PER_WEEK,
)

OBS_FIELDS = (
    "zone_temp",
    "outdoor_temp",
    "occupancy",
    "sin_time",
    "cos_time",
    "sin_weekday",
    "cos_weekday",
)
OBS_SIZE = len(OBS_FIELDS)
ZONE_TEMP, OUTDOOR_TEMP, OCCUPANCY, SIN_TIME, COS_TIME, SIN_WEEKDAY, COS_WEEKDAY = range(OBS_SIZE)

OCCUPIED_START_HOUR = 8.0
OCCUPIED_END_HOUR = 18.0
OCCUPIED_WEEKDAYS = (0, 1, 2, 3, 4)
OUTDOOR_MIN_HOUR = 5.0

ENVELOPE_UA_KW_PER_C = 0.5
THERMAL_CAPACITY_KWH_PER_C = 5.0
OCCUPANT_GAIN_KW = 1.0
HEATING_CAPACITY_KW = 15.0
COOLING_CAPACITY_KW = 10.0
HEATING_COP = 3.0
COOLING_COP = 3.0

DEFAULT_SETPOINT_BOUNDS = (12.0, 30.0)
DEFAULT_COMFORT_BAND = (20.0, 24.0)


def is_occupied(weekday: int, hour: float) -> bool:
    """Returns whether the zone is occupied (08:00-18:00, Monday to Friday).

    Args:
        weekday: Day of week, Monday = 0.
        hour: Hour of day in ``[0, 24)``.

    Returns:
        True when people are in the zone.
    """
    return weekday in OCCUPIED_WEEKDAYS and OCCUPIED_START_HOUR <= hour < OCCUPIED_END_HOUR


def make_observation(
    weekday: int, hour: float, zone_temp_c: float = 20.0, outdoor_temp_c: float = 10.0
) -> np.ndarray:
    """Builds an observation vector for a given clock time.

    Args:
        weekday: Day of week in ``0..6``, Monday = 0.
        hour: Hour of day in ``[0, 24)``.
        zone_temp_c: Zone temperature to report.
        outdoor_temp_c: Outdoor temperature to report.

    Returns:
        A float32 array laid out as ``OBS_FIELDS``.

    Raises:
        ValueError: If ``weekday`` or ``hour`` is out of range.
    """
    if not 0 <= weekday < DAYS_PER_WEEK:
        raise ValueError(f"weekday must be in 0..6 (Monday = 0), got {weekday!r}")
    if not 0.0 <= hour < 24.0:
        raise ValueError(f"hour must be in [0, 24), got {hour!r}")
    day_angle = 2.0 * math.pi * hour / 24.0
    week_angle = 2.0 * math.pi * weekday / DAYS_PER_WEEK
    values = (
        zone_temp_c,
        outdoor_temp_c,
        float(is_occupied(weekday, hour)),
        math.sin(day_angle),
        math.cos(day_angle),
        math.sin(week_angle),
        math.cos(week_angle),
    )
    return np.asarray(values, dtype=np.float32)


def decode_time(observation: np.ndarray) -> tuple[float, int]:
    """Reads the clock back from an observation's time features.

    Args:
        observation: A single observation laid out as ``OBS_FIELDS``.

    Returns:
        ``(hour, weekday)``: hour of day rounded to the 15-minute step grid, weekday with
        Monday = 0.

    Raises:
        ValueError: If the observation does not have shape ``(OBS_SIZE,)``.
    """
    obs = np.asarray(observation, dtype=np.float64)
    if obs.shape != (OBS_SIZE,):
        raise ValueError(f"observation must have shape ({OBS_SIZE},), got {obs.shape}")
    day_angle = math.atan2(obs[SIN_TIME], obs[COS_TIME]) % (2.0 * math.pi)
    week_angle = math.atan2(obs[SIN_WEEKDAY], obs[COS_WEEKDAY]) % (2.0 * math.pi)
    step_of_day = round(day_angle / (2.0 * math.pi) * STEPS_PER_DAY) % STEPS_PER_DAY
    weekday = round(week_angle / (2.0 * math.pi) * DAYS_PER_WEEK) % DAYS_PER_WEEK
    return step_of_day * STEP_HOURS, int(weekday)


def _validate_schedule(episode_steps: int, start_weekday: int, start_hour: float) -> None:
    if isinstance(episode_steps, bool) or not isinstance(episode_steps, int):
        raise ValueError(f"episode_steps must be an int, got {episode_steps!r}")
    if episode_steps <= 0:
        raise ValueError(f"episode_steps must be positive, got {episode_steps}")
    if start_weekday not in range(DAYS_PER_WEEK):
        raise ValueError(f"start_weekday must be in 0..6 (Monday = 0), got {start_weekday!r}")
    start_steps = start_hour * STEPS_PER_HOUR
    if not (0.0 <= start_hour < 24.0 and start_steps == int(start_steps)):
        raise ValueError(
            f"start_hour must be a multiple of {STEP_HOURS} in [0, 24), got {start_hour!r}"
        )


def _validate_finite(nonnegative: bool = False, **values: float) -> None:
    for name, value in values.items():
        if not math.isfinite(value) or (nonnegative and value < 0.0):
            bound = "finite and >= 0" if nonnegative else "finite"
            raise ValueError(f"{name} must be {bound}, got {value!r}")


def _check_range(name: str, pair: tuple[float, float]) -> tuple[float, float]:
    low, high = (float(v) for v in pair)
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ValueError(f"{name} must be finite (low, high) with low < high, got {pair!r}")
    return low, high


class BuildingEnv(py_environment.PyEnvironment):
    """Deterministic-under-seed single-zone HVAC control environment.

    Action: float32 ``[heating_setpoint, cooling_setpoint]`` in degC. Values are clipped to
    the action bounds; if the heating setpoint exceeds the cooling setpoint both are replaced
    by their midpoint, so the HVAC holds that single temperature.

    Reward: ``-(energy_weight * energy_kwh + comfort_weight * discomfort)`` where
    ``energy_kwh`` is the electricity drawn by the HVAC during the step and ``discomfort`` is
    the number of degrees the zone ends the step outside the comfort band, counted only when
    the step is occupied.
    """

    def __init__(
        self,
        episode_steps: int = STEPS_PER_WEEK,
        *,
        start_weekday: int = 0,
        start_hour: float = 0.0,
        random_start: bool = False,
        seed: int | None = None,
        initial_zone_temp_c: float = 18.0,
        outdoor_mean_c: float = 10.0,
        outdoor_amplitude_c: float = 6.0,
        outdoor_noise_c: float = 0.3,
        comfort_band: tuple[float, float] = DEFAULT_COMFORT_BAND,
        setpoint_bounds: tuple[float, float] = DEFAULT_SETPOINT_BOUNDS,
        energy_weight: float = 1.0,
        comfort_weight: float = 1.0,
    ) -> None:
        """Creates the environment.

        Args:
            episode_steps: Steps (15 minutes each) per episode; default one week.
            start_weekday: Weekday of the first step, Monday = 0.
            start_hour: Hour of the first step, a multiple of 0.25 in ``[0, 24)``.
            random_start: If True every episode starts at a seeded random step of the week
                and ``start_weekday`` / ``start_hour`` are ignored.
            seed: Seed for outdoor noise and random starts; None draws fresh entropy.
            initial_zone_temp_c: Zone temperature at reset.
            outdoor_mean_c: Daily mean outdoor temperature.
            outdoor_amplitude_c: Half the daily outdoor swing; the minimum falls at 05:00.
            outdoor_noise_c: Standard deviation of per-step Gaussian outdoor noise.
            comfort_band: ``(low, high)`` comfortable zone temperatures when occupied.
            setpoint_bounds: ``(low, high)`` bounds of both setpoints in the action spec.
            energy_weight: Reward cost per kWh.
            comfort_weight: Reward cost per degree of discomfort.

        Raises:
            ValueError: If any argument is out of range; the message names the value.
        """
        super().__init__(handle_auto_reset=True)
        _validate_schedule(episode_steps, start_weekday, start_hour)
        _validate_finite(initial_zone_temp_c=initial_zone_temp_c, outdoor_mean_c=outdoor_mean_c)
        _validate_finite(
            nonnegative=True,
            outdoor_amplitude_c=outdoor_amplitude_c,
            outdoor_noise_c=outdoor_noise_c,
            energy_weight=energy_weight,
            comfort_weight=comfort_weight,
        )
        self._comfort_low, self._comfort_high = _check_range("comfort_band", comfort_band)
        low, high = _check_range("setpoint_bounds", setpoint_bounds)

        self._episode_steps = episode_steps
        self._start_step = int(start_weekday) * STEPS_PER_DAY + int(start_hour * STEPS_PER_HOUR)
        self._random_start = random_start
        self._rng = np.random.default_rng(seed)
        self._initial_zone_temp = float(initial_zone_temp_c)
        self._outdoor_mean = float(outdoor_mean_c)
        self._outdoor_amplitude = float(outdoor_amplitude_c)
        self._outdoor_noise = float(outdoor_noise_c)
        self._energy_weight = float(energy_weight)
        self._comfort_weight = float(comfort_weight)
        self._action_spec = array_spec.BoundedArraySpec(
            (2,), np.float32, minimum=low, maximum=high, name="setpoints"
        )
        self._observation_spec = array_spec.ArraySpec((OBS_SIZE,), np.float32, "observation")
        self._decay = math.exp(-STEP_HOURS * ENVELOPE_UA_KW_PER_C / THERMAL_CAPACITY_KWH_PER_C)
        self._degc_per_kw = (1.0 - self._decay) / ENVELOPE_UA_KW_PER_C
        self._reset_state(self._start_step)
        self._outdoor_temp = self._outdoor_mean

    def observation_spec(self) -> array_spec.ArraySpec:
        """Returns the float32 ``(OBS_SIZE,)`` observation spec."""
        return self._observation_spec

    def action_spec(self) -> array_spec.BoundedArraySpec:
        """Returns the bounded float32 ``(2,)`` setpoint action spec."""
        return self._action_spec

    def seed(self, seed: int | None) -> None:
        """Re-seeds outdoor noise and random starts; takes effect from the next reset."""
        self._rng = np.random.default_rng(seed)

    def get_info(self) -> dict[str, Any]:
        """Returns the last step's and the episode's energy (kWh) and discomfort (degrees)."""
        return {
            "energy_kwh": self._last_energy,
            "discomfort": self._last_discomfort,
            "episode_energy_kwh": self._episode_energy,
            "episode_discomfort": self._episode_discomfort,
        }

    def _reset_state(self, week_step: int) -> None:
        self._week_step = week_step
        self._steps_taken = 0
        self._zone_temp = self._initial_zone_temp
        self._last_energy = self._last_discomfort = 0.0
        self._episode_energy = self._episode_discomfort = 0.0

    def _clock(self) -> tuple[int, float]:
        weekday = (self._week_step // STEPS_PER_DAY) % DAYS_PER_WEEK
        return weekday, (self._week_step % STEPS_PER_DAY) * STEP_HOURS

    def _draw_outdoor_temp(self) -> float:
        _, hour = self._clock()
        cycle = -math.cos(2.0 * math.pi * (hour - OUTDOOR_MIN_HOUR) / 24.0)
        noise = self._rng.normal(0.0, self._outdoor_noise) if self._outdoor_noise else 0.0
        return self._outdoor_mean + self._outdoor_amplitude * cycle + noise

    def _observation(self) -> np.ndarray:
        weekday, hour = self._clock()
        return make_observation(weekday, hour, self._zone_temp, self._outdoor_temp)

    def _sanitize(self, action: np.ndarray) -> tuple[float, float]:
        values = np.asarray(action, dtype=np.float64).reshape(-1)
        if values.shape != (2,) or not np.all(np.isfinite(values)):
            raise ValueError(f"action must be two finite setpoints, got {action!r}")
        heating, cooling = np.clip(values, self._action_spec.minimum, self._action_spec.maximum)
        if heating > cooling:
            heating = cooling = 0.5 * (heating + cooling)
        return float(heating), float(cooling)

    def _hvac_power_kw(self, free_temp: float, heating: float, cooling: float) -> float:
        """Thermal power (kW, positive heats) that ends the step at the nearest band edge."""
        if free_temp < heating:
            return min((heating - free_temp) / self._degc_per_kw, HEATING_CAPACITY_KW)
        if free_temp > cooling:
            return -min((free_temp - cooling) / self._degc_per_kw, COOLING_CAPACITY_KW)
        return 0.0

    def _advance_zone(self, heating: float, cooling: float, occupied: bool) -> float:
        """Integrates the RC model over one step and returns the HVAC electricity in kWh."""
        gains = OCCUPANT_GAIN_KW if occupied else 0.0
        balance_temp = self._outdoor_temp + gains / ENVELOPE_UA_KW_PER_C
        free_temp = balance_temp + (self._zone_temp - balance_temp) * self._decay
        power = self._hvac_power_kw(free_temp, heating, cooling)
        self._zone_temp = free_temp + power * self._degc_per_kw
        cop = HEATING_COP if power > 0.0 else COOLING_COP
        return abs(power) * STEP_HOURS / cop

    def _discomfort(self, occupied: bool) -> float:
        below = max(self._comfort_low - self._zone_temp, 0.0)
        above = max(self._zone_temp - self._comfort_high, 0.0)
        return below + above if occupied else 0.0

    def _reset(self) -> ts.TimeStep:
        start = self._rng.integers(STEPS_PER_WEEK) if self._random_start else self._start_step
        self._reset_state(int(start))
        self._outdoor_temp = self._draw_outdoor_temp()
        return ts.restart(self._observation())

    def _step(self, action: np.ndarray) -> ts.TimeStep:
        heating, cooling = self._sanitize(action)
        occupied = is_occupied(*self._clock())
        self._last_energy = self._advance_zone(heating, cooling, occupied)
        self._last_discomfort = self._discomfort(occupied)
        self._episode_energy += self._last_energy
        self._episode_discomfort += self._last_discomfort
        self._week_step = (self._week_step + 1) % STEPS_PER_WEEK
        self._steps_taken += 1
        self._outdoor_temp = self._draw_outdoor_temp()

        cost = self._energy_weight * self._last_energy
        cost += self._comfort_weight * self._last_discomfort
        reward = np.asarray(-cost, dtype=np.float32)
        discount = np.asarray(1.0, dtype=np.float32)
        if self._steps_taken >= self._episode_steps:
            return ts.truncation(self._observation(), reward, discount)
        return ts.transition(self._observation(), reward, discount)

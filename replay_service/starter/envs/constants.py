"""The environments' names and time steps, importable without TF-Agents.

The building env's id and its 15-minute step, day and week.
"""

from __future__ import annotations

BUILDING_ENV_ID = "building"
"""`load_env`'s id of `BuildingEnv`, the default environment of `replay-populate`."""

STEP_MINUTES = 15
STEP_HOURS = STEP_MINUTES / 60.0
STEPS_PER_HOUR = 60 // STEP_MINUTES
STEPS_PER_DAY = 24 * STEPS_PER_HOUR
DAYS_PER_WEEK = 7
STEPS_PER_WEEK = DAYS_PER_WEEK * STEPS_PER_DAY

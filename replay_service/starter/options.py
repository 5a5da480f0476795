"""What `populate` is asked to do: `PopulateConfig`, its defaults and the capacity checks."""

from __future__ import annotations

import dataclasses

from replay_service.config.options import require_positive_int
from replay_service.errors import ConfigError
from replay_service.starter.envs import BUILDING_ENV_ID, STEPS_PER_WEEK
from replay_service.starter.naming import validate_buffer_name

DEFAULT_ENV = BUILDING_ENV_ID
DEFAULT_POLICY = "schedule"
DEFAULT_CAPACITY = 50_000
DEFAULT_STEPS_PER_RUN = STEPS_PER_WEEK
DEFAULT_NUM_RUNS = 1
DEFAULT_SEQUENCE_LENGTH = 2
DEFAULT_NUM_ENVS = 1
DEFAULT_OUTPUT_DIR = "starter_buffers"

SEED_RANGE = 2**31

DATA_SPEC_ENV_PREFIX = "env:"
"""`load_data_spec`'s prefix of an environment id: `env:<id>` is the spec that env collects."""


@dataclasses.dataclass(frozen=True)
class PopulateConfig:
    """What `populate` collects and where it stores it.

    Attributes:
      buffer_name: Name of the starter buffer; it lives in `<output_dir>/<buffer_name>`.
      output_dir: Directory holding starter buffers (created if missing).
      env: "building" or a gym id loadable by `suite_gym`, e.g. "CartPole-v0".
      policy: "schedule", "random" or a directory holding a saved policy.
      capacity: Maximum items of the buffer. None: `DEFAULT_CAPACITY` for a new buffer, the
        stored capacity with `append`.
      steps_per_run: Environment steps per run and environment.
      num_runs: Runs; the buffer is checkpointed after each.
      sequence_length: Steps per item. None: `DEFAULT_SEQUENCE_LENGTH` for a new buffer, the
        stored one with `append`.
      num_envs: Environments stepped in turn, each with its own observer and episodes.
      seed: Seed of environment i (and of its random policy) is `seed + i`; None draws one.
        Must be below `SEED_RANGE`.
      overwrite: Replace an existing buffer of that name (once the new one is complete).
      append: Add to an existing buffer of that name.

    Raises:
      ConfigError: If a value is invalid; the message names it.
    """

    buffer_name: str
    output_dir: str = DEFAULT_OUTPUT_DIR
    env: str = DEFAULT_ENV
    policy: str = DEFAULT_POLICY
    capacity: int | None = None
    steps_per_run: int = DEFAULT_STEPS_PER_RUN
    num_runs: int = DEFAULT_NUM_RUNS
    sequence_length: int | None = None
    num_envs: int = DEFAULT_NUM_ENVS
    seed: int | None = None
    overwrite: bool = False
    append: bool = False

    def __post_init__(self) -> None:
        validate_buffer_name(self.buffer_name)
        for name in ("steps_per_run", "num_runs", "num_envs"):
            require_positive_int(name, getattr(self, name), maximum=None)
        for name in ("capacity", "sequence_length"):
            if getattr(self, name) is not None:  # checked before populate creates output_dir
                require_positive_int(name, getattr(self, name))
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not 0 <= self.seed < SEED_RANGE
        ):
            raise ConfigError(
                f"seed must be an integer in [0, {SEED_RANGE}) or None, got {self.seed!r}"
            )
        for name in ("env", "policy", "output_dir"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        if self.overwrite and self.append:
            raise ConfigError(
                f"overwrite and append exclude each other (buffer {self.buffer_name!r}): "
                "overwrite replaces the buffer, append adds to it"
            )

    @property
    def total_steps(self) -> int:
        """Environment steps collected over all runs and environments."""
        return self.steps_per_run * self.num_runs * self.num_envs


def max_new_items(total_steps: int, sequence_length: int) -> int:
    """Returns the most items that collecting `total_steps` steps can write.

    An episode of T counted steps is observed as at most T + 1 steps (its boundary step
    included), which give T + 2 - sequence_length items: at most T when `sequence_length` >= 2.
    With `sequence_length` 1 every observed step is an item, boundary steps included, and there
    is at most one boundary step per counted step.

    Args:
      total_steps: Counted (non-boundary) steps, over all environments.
      sequence_length: Steps per item.

    Returns:
      The upper bound.
    """
    return total_steps if sequence_length >= 2 else 2 * total_steps


def check_capacity(capacity: int, existing_items: int, new_items: int, what: str) -> None:
    """Refuses a capacity that could make the buffer evict items it is being filled with.

    Args:
      capacity: The buffer's capacity in items.
      existing_items: Items already in the buffer.
      new_items: Upper bound of the items about to be written (see `max_new_items`).
      what: Describes the collection, e.g. "1 env x 2 runs x 30 steps".

    Raises:
      ConfigError: If `existing_items + new_items > capacity`; the message gives the numbers.
    """
    needed = existing_items + new_items
    if needed <= capacity:
        return
    held = f"{existing_items} items already stored + " if existing_items else ""
    total = f", {needed} in all" if existing_items else ""
    raise ConfigError(
        f"capacity {capacity} is too small: {held}{what} can write up to {new_items} "
        f"items{total}. A starter buffer keeps every run, so use a capacity of at least {needed} "
        "or collect fewer steps"
    )

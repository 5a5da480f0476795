"""Starter buffers: replay buffers filled once from a baseline policy, then copied for training.

A starter buffer is an ordinary replay_service checkpoint directory, `<output_dir>/<name>`:

    <output_dir>/
      <name>/                      replay_service.json, checkpoints/ckpt-*/, .reverb/, .lock
      <name>.summary.png           reward and action summary of what was collected
      .<name>.partial-<pid>/       only while a populate run is in progress

`populate` builds the buffer in the hidden `.partial-<pid>` sibling and renames it to `<name>` only
after every run was collected and checkpointed, so a directory under its final name is always
complete; on failure the partial directory is removed. An existing buffer is never modified
silently: populating it again is refused unless the caller asks to replace it (`overwrite`) or to
add to it (`append`), and both build the new version beside it before swapping it in.

Training never writes into a starter buffer: `copy_buffer` copies its newest checkpoint into the
training run's own checkpoint directory, which `ReplayBufferManager.load_replay_buffer()` then
restores.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import json
import os
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from tf_agents.drivers import py_driver
from tf_agents.environments import py_environment
from tf_agents.policies import py_policy
from tf_agents.specs import tensor_spec

from replay_service.backends.reverb.internals import (
    ColumnType,
    StoredTable,
    bare_checkpoint_dirs,
    copy_with_signature,
    is_reverb_checkpoint,
    read_column_types,
    read_stored_tables,
    verify_files,
)
from replay_service.config.options import Timeouts, require_int
from replay_service.errors import (
    CheckpointError,
    CheckpointExistsError,
    ConfigError,
    NoCheckpointError,
    ReplayServiceError,
    SpecMismatchError,
)
from replay_service.manager import ReplayBufferManager
from replay_service.specs.nests import (
    FieldDescription,
    check_collect_spec,
    collect_data_spec,
    describe_spec,
    diff_descriptions,
    table_signature,
    trajectory_spec,
)
from replay_service.starter.envs import (
    BUILDING_ENV_ID,
    STEPS_PER_DAY,
    STEPS_PER_WEEK,
    BuildingEnv,
    decode_time,
    load_env,
)
from replay_service.starter.policies import POLICY_CHOICES, load_policy
from replay_service.storage.store import (
    CHECKPOINT_META_FILE,
    CHECKPOINT_PREFIX,
    CHECKPOINTS_DIR,
    LOCK_FILE,
    REVERB_DIR,
    STORE_FILE,
    CheckpointStore,
    StoreMetadata,
    fsync_dir,
    remove_path,
)
from replay_service.storage.store import FORMAT as CHECKPOINT_FORMAT

DEFAULT_ENV = BUILDING_ENV_ID
DEFAULT_POLICY = "schedule"
DEFAULT_CAPACITY = 50_000
DEFAULT_STEPS_PER_RUN = STEPS_PER_WEEK
DEFAULT_NUM_RUNS = 1
DEFAULT_SEQUENCE_LENGTH = 2
DEFAULT_NUM_ENVS = 1
DEFAULT_OUTPUT_DIR = "starter_buffers"

SUMMARY_PLOT_SUFFIX = ".summary.png"
PARTIAL_TAG = "partial"
COPY_TAG = "copy"
OLD_TAG = "old"
MAX_BUFFER_NAME_LENGTH = 200
SEED_RANGE = 2**31
STARTER_KEEP_CHECKPOINTS = 1
STORE_ENTRIES = frozenset({STORE_FILE, f"{STORE_FILE}.tmp", CHECKPOINTS_DIR, REVERB_DIR, LOCK_FILE})
BUILDING_ACTION_NAMES = ("heating setpoint", "cooling setpoint")
PLOT_DPI = 100
DATA_SPEC_ENV_PREFIX = "env:"

Progress = Callable[[int, int], None]
"""Called as `progress(steps_done, steps_total)` while collecting."""


# ------------------------------------------------------------------------------ naming and paths


def validate_buffer_name(name: object) -> str:
    """Checks that a starter buffer name is a single, visible directory name.

    Args:
      name: The candidate name.

    Returns:
      The name, unchanged.

    Raises:
      ConfigError: If the name is not a string, is empty, contains a path separator or a NUL
        character, starts with '.' (which also rules out '.' and '..'), ends with
        `SUMMARY_PLOT_SUFFIX`, or is longer than `MAX_BUFFER_NAME_LENGTH`.
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"buffer name must be a non-empty string, got {name!r}")
    separators = [s for s in (os.sep, os.altsep, "/", "\\", "\0") if s and s in name]
    if separators:
        raise ConfigError(
            f"buffer name {name!r} must be a single directory name, without {separators[0]!r}"
        )
    if name.startswith("."):
        raise ConfigError(
            f"buffer name {name!r} must not start with '.' ('.' and '..' are not names, and "
            "hidden names are reserved for unfinished buffers)"
        )
    if name.endswith(SUMMARY_PLOT_SUFFIX):
        raise ConfigError(
            f"buffer name {name!r} must not end with {SUMMARY_PLOT_SUFFIX!r}, the suffix of "
            "summary plots"
        )
    if len(name) > MAX_BUFFER_NAME_LENGTH:
        raise ConfigError(
            f"buffer name {name[:20]!r}... is {len(name)} characters long; the limit is "
            f"{MAX_BUFFER_NAME_LENGTH}"
        )
    return name


def starter_buffer_path(output_dir: str | os.PathLike[str], buffer_name: str) -> str:
    """Returns the absolute path of the starter buffer `buffer_name` in `output_dir`.

    Raises:
      ConfigError: If the name is not valid (see `validate_buffer_name`).
    """
    return os.path.join(os.path.abspath(os.fspath(output_dir)), validate_buffer_name(buffer_name))


def summary_plot_path(output_dir: str | os.PathLike[str], buffer_name: str) -> str:
    """Returns the path of the summary plot written beside the starter buffer.

    Raises:
      ConfigError: If the name is not valid (see `validate_buffer_name`).
    """
    return starter_buffer_path(output_dir, buffer_name) + SUMMARY_PLOT_SUFFIX


def _sibling(path: str, tag: str) -> str:
    """A hidden sibling of `path` owned by this process, e.g. `.name.partial-1234`."""
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.{tag}-{os.getpid()}")


# -------------------------------------------------------------------------------- configuration


def _require_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


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
            _require_positive_int(name, getattr(self, name))
        for name in ("capacity", "sequence_length"):
            if getattr(self, name) is not None:  # checked before populate creates output_dir
                require_int(name, getattr(self, name), 1, what="a positive integer")
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


# ----------------------------------------------------------------------- environments, policies


def make_envs_and_policies(
    env_name: str, policy_name: str, num_envs: int, seed: int
) -> tuple[list[py_environment.PyEnvironment], list[py_policy.PyPolicy]]:
    """Creates `num_envs` environments and one policy for each.

    Environment i and its policy get seed `seed + i`. A saved policy is loaded once and shared.

    Args:
      env_name: "building" or a gym id.
      policy_name: "schedule", "random" or a saved policy directory.
      num_envs: How many environments.
      seed: Base seed.

    Returns:
      `(envs, policies)`, lists of equal length.

    Raises:
      ConfigError: If the environment id or the policy is unknown, or they do not fit together.
    """
    envs = [_load_env(env_name, seed + i) for i in range(num_envs)]
    if policy_name in POLICY_CHOICES:
        policies = [
            _load_policy(policy_name, env_name, env, seed + i) for i, env in enumerate(envs)
        ]
    else:
        policies = [_load_policy(policy_name, env_name, envs[0], seed)] * num_envs
    return envs, policies


def _load_env(name: str, seed: int) -> py_environment.PyEnvironment:
    try:
        return load_env(name, seed)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    except Exception as e:
        raise ConfigError(f"cannot create environment {name!r}: {type(e).__name__}: {e}") from e


def _load_policy(
    name: str, env_name: str, env: py_environment.PyEnvironment, seed: int
) -> py_policy.PyPolicy:
    known = name in POLICY_CHOICES or os.path.isdir(name)
    try:
        return load_policy(name, env.time_step_spec(), env.action_spec(), seed)
    except ValueError as e:
        message = f"policy {name!r} cannot be used with env {env_name!r}: {e}" if known else str(e)
        raise ConfigError(message) from e
    except Exception as e:
        raise ConfigError(f"cannot load policy {name!r}: {type(e).__name__}: {e}") from e


def starter_data_spec(env: py_environment.PyEnvironment, policy: py_policy.PyPolicy) -> Any:
    """Returns the per-step `Trajectory` spec of what `env` and `policy` produce.

    The same as `replay_service.specs.nests.collect_data_spec`, with the policy's `info_spec` as
    `policy_info` (non-empty for some saved policies).

    Args:
      env: The environment.
      policy: The policy acting in it.

    Returns:
      A `Trajectory` of `tf.TensorSpec`s, what `agent.collect_data_spec` would give.
    """
    spec = collect_data_spec(env, policy)
    return spec._replace(policy_info=tensor_spec.from_spec(policy.info_spec))


def load_data_spec(value: str) -> Any:
    """Resolves a data spec named on the command line (`replay-populate --data-spec`).

    Two forms:

    - `env:<id>`: the per-step spec of a built-in environment (`building` or a gym id such as
      `CartPole-v0`) with an empty `policy_info`: what `replay-populate --env <id>` collects
      with the `schedule` and `random` policies, and what DQN, DDPG, TD3 and SAC agents'
      `collect_data_spec` is for that environment.
    - `module:function`: `function()` of an importable module (dotted names allowed on both
      sides; the current directory is searched after `sys.path`), returning the spec, e.g. a
      function that builds the agent and returns `agent.collect_data_spec`. An attribute that
      is not callable is taken as the spec itself.

    Args:
      value: The flag's value.

    Returns:
      The spec, a TF-Agents `Trajectory` of specs.

    Raises:
      ConfigError: If the value has neither form, the environment is unknown, the module or
        attribute cannot be imported, the function fails (or calls `sys.exit`), or what it
        returns is not a `Trajectory` of specs; the message names the value.
    """
    if not isinstance(value, str) or ":" not in value:
        raise ConfigError(
            f"--data-spec {value!r} must be '{DATA_SPEC_ENV_PREFIX}<env id>' (e.g. "
            f"'{DATA_SPEC_ENV_PREFIX}{BUILDING_ENV_ID}') or 'module:function' (an importable "
            "function returning the data spec, e.g. agent.collect_data_spec)"
        )
    if value.startswith(DATA_SPEC_ENV_PREFIX):
        name = value.removeprefix(DATA_SPEC_ENV_PREFIX)
        try:
            spec = trajectory_spec(_load_env(name, 0))
        except ConfigError as e:
            raise ConfigError(f"--data-spec {value!r}: {e}") from e
    else:
        spec = _import_data_spec(value)
    try:
        return check_collect_spec(spec, f"--data-spec {value!r}")
    except SpecMismatchError as e:
        named = str(e) if repr(value) in str(e) else f"--data-spec {value!r}: {e}"
        raise ConfigError(named) from e


def _import_data_spec(value: str) -> Any:
    """`load_data_spec` for `module:function` (see there)."""
    module_name, _, attribute = value.partition(":")
    parts = attribute.split(".")
    if not all(p.isidentifier() for p in (*module_name.split("."), *parts)):
        raise ConfigError(
            f"--data-spec {value!r} must be 'module:function' with dotted Python names on both "
            f"sides, or '{DATA_SPEC_ENV_PREFIX}<env id>'"
        )
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        found: Any = importlib.import_module(module_name)
    except SystemExit as e:
        raise ConfigError(
            f"--data-spec {value!r}: importing module {module_name!r} called sys.exit({e.code!r})"
        ) from None
    except Exception as e:
        raise ConfigError(
            f"--data-spec {value!r}: cannot import module {module_name!r}: {type(e).__name__}: {e}"
        ) from e
    for part in parts:
        if not hasattr(found, part):
            raise ConfigError(
                f"--data-spec {value!r}: module {module_name!r} has no attribute {attribute!r}"
            )
        found = getattr(found, part)
    if not callable(found):
        return found
    try:
        return found()
    except SystemExit as e:  # the user's code must not end the command with its own status
        raise ConfigError(
            f"--data-spec {value!r}: {attribute}() called sys.exit({e.code!r})"
        ) from None
    except Exception as e:
        raise ConfigError(
            f"--data-spec {value!r}: {attribute}() failed: {type(e).__name__}: {e}"
        ) from e


# ------------------------------------------------------------------------- collection statistics


class StepRecorder:
    """Observer recording one environment's rewards, actions and (optionally) times of day.

    Boundary trajectories (from an episode's last step to the next first step) are not steps
    and are skipped, as `PyDriver` does when it counts steps.

    Args:
      time_of_day: Decode each step's hour of day from its `BuildingEnv` observation.
    """

    def __init__(self, time_of_day: bool) -> None:
        self._time_of_day = time_of_day
        self.rewards: list[float] = []
        self.actions: list[np.ndarray] = []
        self.hours: list[float] = []
        self.episodes_finished = 0
        self.in_episode = False

    def __call__(self, trajectory: Any) -> None:
        """Records one unbatched trajectory."""
        if trajectory.is_boundary():
            return
        self.rewards.append(float(np.sum(trajectory.reward)))
        self.actions.append(
            np.concatenate(
                [np.ravel(np.asarray(a, np.float64)) for a in tf.nest.flatten(trajectory.action)]
            )
        )
        if self._time_of_day:
            self.hours.append(decode_time(trajectory.observation)[0])
        finished = bool(trajectory.is_last())
        self.episodes_finished += finished
        self.in_episode = not finished

    @property
    def episodes(self) -> int:
        """Episodes seen: finished ones plus the one in progress, if any."""
        return self.episodes_finished + int(self.in_episode)


@dataclasses.dataclass(frozen=True)
class PopulateResult:
    """What `populate` did.

    Attributes:
      buffer_name: Name of the starter buffer.
      path: Absolute path of the complete buffer.
      plot_path: Absolute path of the summary plot.
      env: Environment id.
      policy: Policy name or directory.
      seed: Base seed used.
      capacity: Buffer capacity in items.
      sequence_length: Steps per item.
      num_envs: Environments stepped.
      num_runs: Runs collected.
      steps_per_run: Steps per run and environment.
      steps: Steps collected, over all runs and environments.
      items: Items in the buffer now.
      items_before: Items in the buffer before (non-zero only when appending).
      episodes: Episodes collected (finished or cut off by the end of the last run).
      episodes_finished: Episodes that reached their last step.
      reward_mean: Mean reward per collected step.
      reward_min: Smallest reward of a collected step.
      reward_max: Largest reward of a collected step.
      elapsed_s: Wall-clock seconds spent collecting and checkpointing.
      mode: "created", "replaced" or "appended".
    """

    buffer_name: str
    path: str
    plot_path: str
    env: str
    policy: str
    seed: int
    capacity: int
    sequence_length: int
    num_envs: int
    num_runs: int
    steps_per_run: int
    steps: int
    items: int
    items_before: int
    episodes: int
    episodes_finished: int
    reward_mean: float
    reward_min: float
    reward_max: float
    elapsed_s: float
    mode: str

    @property
    def steps_per_second(self) -> float:
        """Collection speed."""
        return self.steps / self.elapsed_s if self.elapsed_s > 0 else float("inf")


def format_summary(result: PopulateResult) -> str:
    """Returns a human-readable, multi-line summary of a `populate` result."""
    added = f", {result.items - result.items_before} added" if result.mode == "appended" else ""
    return "\n".join(
        [
            f"starter buffer {result.buffer_name!r} {result.mode}: {result.path}",
            f"  items     {result.items} of capacity {result.capacity}{added} "
            f"({result.sequence_length}-step windows)",
            f"  steps     {result.steps} ({result.num_envs} env(s) x {result.num_runs} run(s) x "
            f"{result.steps_per_run} steps) in {result.elapsed_s:.1f} s, "
            f"{result.steps_per_second:.0f} steps/s",
            f"  episodes  {result.episodes} ({result.episodes_finished} finished)",
            f"  reward    mean {result.reward_mean:.4g}, min {result.reward_min:.4g}, "
            f"max {result.reward_max:.4g} per step",
            f"  source    env {result.env!r}, policy {result.policy!r}, seed {result.seed}",
            f"  plot      {result.plot_path}",
        ]
    )


# ----------------------------------------------------------------------------------- plotting


def write_summary_plot(
    path: str, recorders: Sequence[StepRecorder], title: str, *, time_of_day: bool
) -> str:
    """Writes a PNG of the rewards and actions that were collected.

    With `time_of_day` (the building env) both are drawn against the hour of day, every step as
    a dot with the mean per 15-minute slot as a line; otherwise rewards are drawn over the steps
    of each environment and actions as histograms.

    Args:
      path: Where to write the PNG.
      recorders: One recorder per environment.
      title: Figure title.
      time_of_day: Plot against the hour of day (needs recorders made with `time_of_day`).

    Returns:
      `path`.

    Raises:
      CheckpointError: If the file cannot be written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 7), dpi=PLOT_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    reward_axes, action_axes = figure.subplots(2, 1)
    if time_of_day:
        _plot_time_of_day(reward_axes, action_axes, recorders)
    else:
        _plot_over_steps(reward_axes, action_axes, recorders)
    figure.suptitle(title)
    try:
        figure.savefig(path, format="png")
    except OSError as e:
        raise CheckpointError(f"cannot write the summary plot {path!r}: {e}") from e
    return path


def _plot_time_of_day(
    reward_axes: Any, action_axes: Any, recorders: Sequence[StepRecorder]
) -> None:
    hours = np.concatenate([np.asarray(r.hours, np.float64) for r in recorders])
    rewards = np.concatenate([np.asarray(r.rewards, np.float64) for r in recorders])
    actions = np.concatenate([np.stack(r.actions) for r in recorders if r.actions])
    slots = np.round(hours * STEPS_PER_DAY / 24.0).astype(int) % STEPS_PER_DAY
    slot_hours = np.arange(STEPS_PER_DAY) * 24.0 / STEPS_PER_DAY

    def slot_means(values: np.ndarray) -> np.ndarray:
        sums = np.bincount(slots, weights=values, minlength=STEPS_PER_DAY)
        counts = np.bincount(slots, minlength=STEPS_PER_DAY)
        return np.divide(sums, counts, out=np.full(STEPS_PER_DAY, np.nan), where=counts > 0)

    reward_axes.scatter(hours, rewards, s=4, alpha=0.25, label="step")
    reward_axes.plot(slot_hours, slot_means(rewards), color="black", label="mean per 15 min")
    reward_axes.set(ylabel="reward per step", title="reward by time of day")
    reward_axes.legend(loc="best")
    names = _action_names(actions.shape[1], BUILDING_ACTION_NAMES)
    for column, name in enumerate(names):
        line = action_axes.plot(slot_hours, slot_means(actions[:, column]), label=f"{name} (mean)")
        action_axes.scatter(hours, actions[:, column], s=4, alpha=0.15, color=line[0].get_color())
    action_axes.set(ylabel="action", title="actions by time of day")
    action_axes.legend(loc="best")
    for axes in (reward_axes, action_axes):
        axes.set(xlim=(0, 24), xticks=range(0, 25, 3), xlabel="hour of day")
        axes.grid(alpha=0.3)


def _plot_over_steps(reward_axes: Any, action_axes: Any, recorders: Sequence[StepRecorder]) -> None:
    for index, recorder in enumerate(recorders):
        reward_axes.plot(recorder.rewards, linewidth=0.8, label=f"env {index}")
    reward_axes.set(xlabel="step", ylabel="reward per step", title="reward over steps")
    reward_axes.grid(alpha=0.3)
    if len(recorders) > 1:
        reward_axes.legend(loc="best")
    actions = np.concatenate([np.stack(r.actions) for r in recorders if r.actions])
    for column, name in enumerate(_action_names(actions.shape[1], ())):
        action_axes.hist(actions[:, column], bins=min(50, len(actions)), alpha=0.6, label=name)
    action_axes.set(xlabel="action value", ylabel="steps", title="action distribution")
    action_axes.legend(loc="best")


def _action_names(count: int, known: Sequence[str]) -> list[str]:
    if len(known) == count:
        return list(known)
    return ["action"] if count == 1 else [f"action[{i}]" for i in range(count)]


# ------------------------------------------------------------------------------------- populate


@dataclasses.dataclass(frozen=True)
class _Plan:
    """A checked `PopulateConfig` with everything resolved, before anything is written."""

    config: PopulateConfig
    output_dir: str
    path: str
    plot_path: str
    stored: StoreMetadata | None
    capacity: int
    sequence_length: int
    seed: int
    envs: list[py_environment.PyEnvironment]
    policies: list[py_policy.PyPolicy]
    data_spec: Any

    @property
    def description(self) -> str:
        c = self.config
        return f"{c.num_envs} env(s) x {c.num_runs} run(s) x {c.steps_per_run} steps"

    @property
    def new_items(self) -> int:
        return max_new_items(self.config.total_steps, self.sequence_length)

    @property
    def time_of_day(self) -> bool:
        return isinstance(self.envs[0], BuildingEnv)


@dataclasses.dataclass(frozen=True)
class _Collected:
    items_before: int
    items: int
    elapsed_s: float
    recorders: list[StepRecorder]


def populate(
    config: PopulateConfig,
    *,
    progress: Progress | None = None,
    timeouts: Timeouts | None = None,
) -> PopulateResult:
    """Fills a starter buffer from a baseline policy; see the module docstring for the layout.

    Every input is checked before anything is written. The buffer is built (for `append`: a
    copy of the existing one is extended) in `.<name>.partial-<pid>` beside it, checkpointed
    after every run, and renamed to `<name>` only when all runs succeeded; an existing buffer is
    removed only after its replacement is complete. On failure the partial directory is removed
    and the exception carries a note saying so.

    Each environment keeps its episode going from one run to the next: a run is a slice of
    `steps_per_run` steps, not an episode. With stride 1 an episode of T observed steps (its
    boundary step included once the driver stepped past it) gives T - sequence_length + 1 items.

    Args:
      config: What to collect and where.
      progress: Called as `progress(steps_done, steps_total)` while collecting.
      timeouts: Timeouts of the buffer's manager (default `Timeouts()`).

    Returns:
      What was collected and where it is stored.

    Raises:
      ConfigError: If the environment, policy or sizes are invalid, or the capacity is too small
        to keep every run.
      CheckpointExistsError: If the buffer exists and neither `overwrite` nor `append` is set.
      NoCheckpointError: If `append` is set and there is no complete buffer to add to.
      CheckpointError: If the output directory cannot be written, holds a foreign directory of
        that name, or the buffer is in use.
      SpecMismatchError: If appending data of another env or policy than the buffer's.
      ReplayServiceError: If collecting fails.
    """
    plan = _make_plan(config)
    _make_dirs(plan.output_dir)
    partial = _sibling(plan.path, PARTIAL_TAG)
    plot_partial = _sibling(plan.plot_path, PARTIAL_TAG)
    try:
        with _locked_if_store(plan.path, plan.stored is not None):
            collected = _build(plan, partial, progress, timeouts)
            write_summary_plot(
                plot_partial, collected.recorders, _plot_title(config), time_of_day=plan.time_of_day
            )
            _install(partial, plan.path)
            os.replace(plot_partial, plan.plot_path)
    except BaseException as e:
        if os.path.lexists(partial):
            remove_path(partial)
            kept = f"; {plan.path!r} is unchanged" if plan.stored is not None else ""
            e.add_note(f"nothing was kept: removed the unfinished buffer {partial!r}{kept}")
        remove_path(plot_partial)
        raise
    return _result(plan, collected)


def _make_plan(config: PopulateConfig) -> _Plan:
    """Checks everything that can be checked without writing and resolves the defaults."""
    output_dir = os.path.abspath(config.output_dir)
    path = starter_buffer_path(output_dir, config.buffer_name)
    _check_output_dir(output_dir)
    stored = _check_existing(path, config)
    capacity, sequence_length = _resolve_sizes(config, stored, path)
    seed = config.seed if config.seed is not None else secrets.randbelow(SEED_RANGE)
    envs, policies = make_envs_and_policies(config.env, config.policy, config.num_envs, seed)
    plan = _Plan(
        config=config,
        output_dir=output_dir,
        path=path,
        plot_path=path + SUMMARY_PLOT_SUFFIX,
        stored=stored,
        capacity=capacity,
        sequence_length=sequence_length,
        seed=seed,
        envs=envs,
        policies=policies,
        data_spec=starter_data_spec(envs[0], policies[0]),
    )
    check_capacity(capacity, 0, plan.new_items, plan.description)
    return plan


def _build(
    plan: _Plan, partial: str, progress: Progress | None, timeouts: Timeouts | None
) -> _Collected:
    """Creates (or, to append, copies) the buffer in `partial` and collects every run into it."""
    remove_path(partial)
    if plan.config.append:
        copy_buffer(plan.path, partial)
    recorders = [StepRecorder(plan.time_of_day) for _ in plan.envs]
    with ReplayBufferManager(
        plan.data_spec,
        plan.capacity,
        partial,
        plan.sequence_length,
        timeouts=timeouts,
        keep_checkpoints=STARTER_KEEP_CHECKPOINTS,
    ) as manager:
        observers = _open_observers(manager, len(plan.envs), append=plan.config.append)
        items_before = manager.num_frames()
        check_capacity(plan.capacity, items_before, plan.new_items, plan.description)
        start = time.perf_counter()
        _collect(manager, plan, observers, recorders, progress)
        elapsed = time.perf_counter() - start
        return _Collected(items_before, manager.num_frames(), elapsed, recorders)


def _plot_title(config: PopulateConfig) -> str:
    appended = " (the appended steps)" if config.append else ""
    return (
        f"{config.buffer_name}: {config.total_steps} steps of {config.env!r} with policy "
        f"{config.policy!r}{appended}"
    )


def _result(plan: _Plan, collected: _Collected) -> PopulateResult:
    config, recorders = plan.config, collected.recorders
    rewards = np.concatenate([np.asarray(r.rewards, np.float64) for r in recorders])
    replaced = "replaced" if plan.stored is not None else "created"
    mode = "appended" if config.append else replaced
    return PopulateResult(
        buffer_name=config.buffer_name,
        path=plan.path,
        plot_path=plan.plot_path,
        env=config.env,
        policy=config.policy,
        seed=plan.seed,
        capacity=plan.capacity,
        sequence_length=plan.sequence_length,
        num_envs=config.num_envs,
        num_runs=config.num_runs,
        steps_per_run=config.steps_per_run,
        steps=int(rewards.size),
        items=collected.items,
        items_before=collected.items_before,
        episodes=sum(r.episodes for r in recorders),
        episodes_finished=sum(r.episodes_finished for r in recorders),
        reward_mean=float(rewards.mean()),
        reward_min=float(rewards.min()),
        reward_max=float(rewards.max()),
        elapsed_s=collected.elapsed_s,
        mode=mode,
    )


def _check_output_dir(output_dir: str) -> None:
    """Checks, without writing, that `output_dir` is (or can be created as) a writable dir."""
    existing = output_dir
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        blocker = "" if existing == output_dir else f" ({existing!r} is a file)"
        raise CheckpointError(f"output dir {output_dir!r} is not a directory{blocker}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CheckpointError(f"output dir {output_dir!r} is not writable ({existing!r})")


def _make_dirs(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create output dir {path!r}: {e}") from e


def _check_existing(final: str, config: PopulateConfig) -> StoreMetadata | None:
    """Returns the metadata of an existing buffer that may be replaced or extended, else None."""
    if not os.path.lexists(final) or (os.path.isdir(final) and not os.listdir(final)):
        if config.append:
            raise NoCheckpointError(f"there is no starter buffer {final!r} to append to")
        return None
    store = CheckpointStore(final)
    metadata = store.read_metadata()
    if not (config.overwrite or config.append):
        raise CheckpointExistsError(
            f"starter buffer {final!r} already exists and is never modified silently; pass "
            "--overwrite (overwrite=True) to replace it, --append (append=True) to add to it, or "
            "choose another buffer name"
        )
    _check_own_entries(final)
    if config.append and store.latest() is None:
        raise NoCheckpointError(f"starter buffer {final!r} holds no complete checkpoint")
    return metadata


def _resolve_sizes(
    config: PopulateConfig, stored: StoreMetadata | None, final: str
) -> tuple[int, int]:
    """Returns `(capacity, sequence_length)`: the config's, or the stored ones when appending."""
    if not config.append or stored is None:
        return (
            config.capacity or DEFAULT_CAPACITY,
            config.sequence_length or DEFAULT_SEQUENCE_LENGTH,
        )
    for name in ("capacity", "sequence_length"):
        requested, kept = getattr(config, name), getattr(stored, name)
        if requested is not None and requested != kept:
            raise ConfigError(
                f"cannot append to {final!r} with {name} {requested}: the buffer has {name} "
                f"{kept} (leave it out to use the buffer's)"
            )
    return stored.capacity, stored.sequence_length


def _open_observers(manager: ReplayBufferManager, count: int, *, append: bool) -> list[Any]:
    _, first = manager.load_replay_buffer() if append else manager.create_replay_buffer()
    return [first] + [manager.get_replay_buffer_and_observer()[1] for _ in range(count - 1)]


def _collect(
    manager: ReplayBufferManager,
    plan: _Plan,
    observers: Sequence[Any],
    recorders: Sequence[StepRecorder],
    progress: Progress | None,
) -> None:
    """Steps the environments in turn, one step each, and checkpoints after every run."""
    config = plan.config
    drivers = [
        py_driver.PyDriver(env, policy, [observer, recorder], max_steps=1)
        for env, policy, observer, recorder in zip(
            plan.envs, plan.policies, observers, recorders, strict=True
        )
    ]
    time_steps = [env.reset() for env in plan.envs]
    states = [
        _initial_state(env, policy) for env, policy in zip(plan.envs, plan.policies, strict=True)
    ]
    done, total = 0, config.total_steps
    for run in range(1, config.num_runs + 1):
        try:
            for _ in range(config.steps_per_run):
                for i, driver in enumerate(drivers):
                    time_steps[i], states[i] = driver.run(time_steps[i], states[i])
                done += len(drivers)
                if progress is not None:
                    progress(done, total)
            manager.checkpoint()
        except ReplayServiceError:
            raise
        except Exception as e:
            raise ReplayServiceError(
                f"run {run} of {config.num_runs} of buffer {config.buffer_name!r} failed: "
                f"{type(e).__name__}: {e}"
            ) from e


def _initial_state(env: py_environment.PyEnvironment, policy: py_policy.PyPolicy) -> Any:
    """The policy's initial state, or () for a stateless policy (as `PyDriver.run` assumes)."""
    if not tf.nest.flatten(policy.policy_state_spec):
        return ()
    return policy.get_initial_state(env.batch_size or 1)


@contextlib.contextmanager
def _locked_if_store(path: str, is_store: bool) -> Iterator[None]:
    """Holds the lock of an existing buffer, so one in use is never replaced."""
    if not is_store:
        yield
        return
    with CheckpointStore(path).locked():
        yield


# ------------------------------------------------------------------------------------ copying


def copy_buffer(
    source_dir: str | os.PathLike[str],
    target_dir: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    data_spec: Any = None,
) -> str:
    """Copies the newest complete checkpoint of a buffer into a new checkpoint directory.

    The target gets the same layout with only that checkpoint, renumbered as the first:
    `replay_service.json`, `checkpoints/ckpt-...1/` and an empty `.reverb/`. It is written to a
    hidden sibling and renamed into place, so it never exists half-copied. The source is only
    read. `ReplayBufferManager(<same spec, capacity, sequence length>, checkpoint_dir=target)
    .load_replay_buffer()` then restores the copy, and collecting into it or checkpointing it
    leaves the source unchanged.

    The source may also be a bare Reverb checkpoint root, as Reverb's `DefaultCheckpointer`
    writes it (e.g. an sbsim starter buffer, `starter_buffers/default/`: subdirectories named by
    time, each with `tables.tfrecord`, `chunks.tfrecord`, `items.tfrecord` and `DONE`). Its
    newest checkpoint (largest name) is read back in full and validated: exactly one table,
    with items of one sequence length, a signature that matches `data_spec` when both are
    there, and the dtype and per-step shape of every stored column (read from the chunks)
    matching the spec field for field. A table without a signature (sbsim's) needs
    `data_spec`. The copy is a normal replay_service checkpoint directory recording that
    table's name, capacity and sequence length and the data spec (`data_spec`'s, or the stored
    signature's), with the table's signature stored with the sequence length as its leading
    dimension as replay_service's tables have it.

    If the newest checkpoint directory of a bare root lacks `DONE` (a save still running, or
    one that died), nothing is copied and the error names it. Reverb itself would load the
    previous complete checkpoint instead, but that is not what the root's writer last saved:
    while a save runs it is about to be replaced (and deleted by Reverb), and after a crash the
    items of the lost save would be missing from the copy without a word.

    Args:
      source_dir: A replay_service checkpoint directory, e.g. a starter buffer, or a bare
        Reverb checkpoint root.
      target_dir: The new checkpoint directory, e.g. a training run's own one. It must not
        exist or be empty, unless `overwrite` is set.
      overwrite: Replace a target that is a replay_service checkpoint directory. A target
        holding files that are not replay_service's is never deleted.
      data_spec: The per-step data spec the buffer holds (e.g. `agent.collect_data_spec`, or
        sbsim's `ReplayBufferManager.data_spec`), a TF-Agents `Trajectory`. Required for a bare
        root whose table has no signature; otherwise checked against the source when given.

    Returns:
      The absolute target path.

    Raises:
      NoCheckpointError: If the source is missing, empty or has no complete checkpoint.
      CheckpointError: If the source is not a replay_service checkpoint directory, the newest
        checkpoint of a bare root is incomplete, the two paths overlap, the target holds
        foreign files or is in use, or copying fails.
      CheckpointExistsError: If the target is not empty and `overwrite` is False.
      SpecMismatchError: If `data_spec` is not a `Trajectory` of specs or differs from what the
        source holds; the message names each field that differs.
    """
    source = os.path.abspath(os.fspath(source_dir))
    target = os.path.abspath(os.fspath(target_dir))
    if not os.path.lexists(source):
        raise NoCheckpointError(f"there is no buffer {source!r} to copy: it does not exist")
    _check_distinct(source, target)
    store = CheckpointStore(source)
    if not store.is_store() and bare_checkpoint_dirs(source):
        return _copy_bare_root(source, target, overwrite, data_spec)
    stored = store.read_metadata()
    latest = store.latest()
    if latest is None:
        raise NoCheckpointError(
            f"buffer {source!r} holds no complete checkpoint to copy (it was never checkpointed)"
        )
    if data_spec is not None:
        problems = diff_descriptions(
            describe_spec(check_collect_spec(data_spec, "copy_buffer")), stored.data_spec
        )
        if problems:
            raise SpecMismatchError(
                f"buffer {source!r} does not hold the given data_spec: " + "; ".join(problems)
            )
    replacing = _check_copy_target(target, overwrite)
    staging = _sibling(target, COPY_TAG)
    try:
        with _locked_if_store(target, replacing):
            remove_path(staging)
            _write_copy(store, latest.path, latest.info, staging)
            _install(staging, target)
    except OSError as e:
        raise CheckpointError(f"cannot copy {latest.path!r} to {target!r}: {e}") from e
    finally:
        remove_path(staging)
    return target


def _copy_bare_root(source: str, target: str, overwrite: bool, data_spec: Any) -> str:
    """`copy_buffer` for a bare Reverb checkpoint root (see there)."""
    found = bare_checkpoint_dirs(source)
    newest = found[-1]
    if not is_reverb_checkpoint(newest):
        _refuse_incomplete(source, newest, [p for p in found if is_reverb_checkpoint(p)])
    num_items, _ = verify_files(newest)
    tables = read_stored_tables(newest)
    if len(tables) != 1:
        raise CheckpointError(
            f"Reverb checkpoint {newest!r} holds {len(tables)} tables "
            f"{[t.name for t in tables]}; only a checkpoint of one table can be copied"
        )
    table = tables[0]
    if table.num_items != num_items or table.sequence_length is None:
        raise CheckpointError(
            f"table {table.name!r} of Reverb checkpoint {newest!r} holds {table.num_items} "
            f"items of {num_items} in the checkpoint; there is nothing to copy"
        )
    description, signature = _bare_spec(newest, table, data_spec)
    metadata = StoreMetadata(
        table_name=table.name,
        sequence_length=table.sequence_length,
        capacity=table.max_size,
        data_spec=description,
    )
    replacing = _check_copy_target(target, overwrite)
    staging = _sibling(target, COPY_TAG)
    try:
        with _locked_if_store(target, replacing):
            remove_path(staging)
            _write_bare_copy(newest, table.name, signature, metadata, staging)
            _install(staging, target)
    except OSError as e:
        raise CheckpointError(f"cannot copy {newest!r} to {target!r}: {e}") from e
    finally:
        remove_path(staging)
    return target


def _refuse_incomplete(root: str, newest: str, complete: list[str]) -> None:
    """Raises the error of a bare root whose newest checkpoint lacks `DONE` (see `copy_buffer`).

    Raises:
      CheckpointError: Always; `NoCheckpointError` if no checkpoint of the root is complete.
    """
    message = (
        f"the newest checkpoint of Reverb checkpoint root {root!r}, {newest!r}, is incomplete "
        "(no DONE file): the save writing it is still running or was interrupted. Nothing was "
        "copied. If its writer still runs, wait until the save finishes and copy again; "
    )
    if not complete:
        raise NoCheckpointError(
            message + "if it was interrupted, the root holds no complete checkpoint to copy"
        )
    raise CheckpointError(
        message + f"if it was interrupted, move {newest!r} out of the root (it is never deleted "
        f"here) to copy the previous complete checkpoint {complete[-1]!r}, which lacks "
        "whatever that save held"
    )


def _bare_spec(checkpoint: str, table: StoredTable, data_spec: Any) -> tuple[list[Any], Any]:
    """The per-step spec description and the table signature a bare checkpoint's copy gets.

    Raises:
      SpecMismatchError: If the stored signature or the stored columns differ from
        `data_spec`, or the signature's leading dimension from the items' length.
      CheckpointError: If the table has no signature and no `data_spec` is given, or its
        signature differs from its stored columns.
    """
    length = table.sequence_length
    assert length is not None
    stored = None
    if table.signature is not None:
        leading = {f["shape"][0] if f["shape"] else None for f in describe_spec(table.signature)}
        if not leading <= {None, length}:
            raise SpecMismatchError(
                f"table {table.name!r} of {checkpoint!r}: the signature's leading dimensions "
                f"{sorted(leading, key=str)} differ from the items' sequence length {length}"
            )
        stored = [{**f, "shape": f["shape"][1:]} for f in describe_spec(table.signature)]
    if data_spec is not None:
        spec = check_collect_spec(data_spec, "copy_buffer")
        wanted = describe_spec(spec)
        problems = diff_descriptions(wanted, stored) if stored is not None else []
        problems = problems or diff_columns(wanted, read_column_types(checkpoint, table.name))
        if problems:
            raise SpecMismatchError(
                f"table {table.name!r} of {checkpoint!r} does not hold the given data_spec: "
                + "; ".join(problems)
            )
        return wanted, table_signature(spec, length)
    if stored is None:
        raise CheckpointError(
            f"table {table.name!r} of {checkpoint!r} has no signature (sbsim's and TF-Agents' "
            "ReverbReplayBuffer tables have none); pass data_spec (e.g. agent.collect_data_spec "
            "or sbsim's manager.data_spec), or --data-spec to replay-populate, to say what it "
            "holds"
        )
    problems = diff_columns(stored, read_column_types(checkpoint, table.name))
    if problems:
        raise CheckpointError(
            f"table {table.name!r} of {checkpoint!r}: its signature does not describe its "
            "items: " + "; ".join(problems)
        )
    signature = tf.nest.map_structure(
        lambda s: tf.TensorSpec([length, *s.shape[1:]], s.dtype, s.name), table.signature
    )
    return stored, signature


def diff_columns(fields: list[FieldDescription], columns: list[ColumnType]) -> list[str]:
    """Lists how a per-step spec departs from the columns a table's items are stored in.

    Fields and columns pair up in order (items store the flattened spec). When their counts
    differ by one, the field or column without a partner is named if pairing up the rest
    leaves no other difference.

    Args:
      fields: The spec's `describe_spec` description.
      columns: The stored columns (`reverb_internals.read_column_types`); empty for a table
        without items, which matches any spec.

    Returns:
      Human-readable differences, empty when the spec describes the columns.
    """
    if not columns:
        return []
    if len(fields) == len(columns):
        return [
            f"field {f['path']!r}: the data_spec says {_field_type(f)}, the stored items hold {c}"
            for f, c in zip(fields, columns, strict=True)
            if not _fits(f, c)
        ]
    if len(fields) == len(columns) + 1:
        for i, field in enumerate(fields):
            if _all_fit(fields[:i] + fields[i + 1 :], columns):
                return [
                    f"field {field['path']!r} ({_field_type(field)}) is not in the stored items"
                ]
    if len(columns) == len(fields) + 1:
        for i, column in enumerate(columns):
            if _all_fit(fields, columns[:i] + columns[i + 1 :]):
                where = ", ".join(
                    f"{side} field {fields[j]['path']!r}"
                    for side, j in (("after", i - 1), ("before", i))
                    if 0 <= j < len(fields)
                )
                return [
                    f"the stored items have a column {column} (column {i + 1} of "
                    f"{len(columns)}, {where}) for which the data_spec has no field"
                ]
    described = ", ".join(f"{f['path']}: {_field_type(f)}" for f in fields)
    return [
        f"the data_spec has {len(fields)} fields ({described}), the stored items have "
        f"{len(columns)} columns ({', '.join(map(str, columns))})"
    ]


def _field_type(field: FieldDescription) -> str:
    return f"{field['dtype']}{list(field['shape'])}"


def _fits(field: FieldDescription, column: ColumnType) -> bool:
    shape = list(field["shape"])
    return (
        field["dtype"] == column.dtype
        and len(shape) == len(column.shape)
        and all(d is None or d == c for d, c in zip(shape, column.shape, strict=True))
    )


def _all_fit(fields: list[FieldDescription], columns: list[ColumnType]) -> bool:
    return all(_fits(f, c) for f, c in zip(fields, columns, strict=True))


def _write_bare_copy(
    checkpoint: str, table_name: str, signature: Any, metadata: StoreMetadata, dest: str
) -> None:
    """Writes `dest` as a checkpoint directory whose first checkpoint is `checkpoint`."""
    os.makedirs(os.path.join(dest, REVERB_DIR))
    with open(os.path.join(dest, STORE_FILE), "w", encoding="utf-8") as f:
        json.dump(metadata.to_json(), f, indent=2, sort_keys=True)
    first = os.path.join(dest, CHECKPOINTS_DIR, f"{CHECKPOINT_PREFIX}{1:08d}")
    os.makedirs(os.path.dirname(first))
    copy_with_signature(checkpoint, table_name, signature, first)
    num_items, files = verify_files(first)
    info = {
        "format": CHECKPOINT_FORMAT,
        "sequence": 1,
        "created_at": datetime.datetime.now(datetime.UTC).isoformat(),
        "reverb_name": os.path.basename(checkpoint),
        "num_items": num_items,
        "files": {name: {"size": f["size"], "sha256": f["sha256"]} for name, f in files.items()},
        "store": metadata.to_json(),
        "copied_from": {"path": checkpoint, "reverb_checkpoint_root": os.path.dirname(checkpoint)},
    }
    with open(os.path.join(first, CHECKPOINT_META_FILE), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=2, sort_keys=True)
    _fsync_tree(dest)


def _check_distinct(source: str, target: str) -> None:
    real_source, real_target = os.path.realpath(source), os.path.realpath(target)
    for a, b in ((real_source, real_target), (real_target, real_source)):
        if a == b or a.startswith(b.rstrip(os.sep) + os.sep):
            raise CheckpointError(
                f"cannot copy {source!r} to {target!r}: the source and target overlap"
            )


def _check_copy_target(target: str, overwrite: bool) -> bool:
    """Returns whether an existing buffer at `target` will be replaced.

    Raises:
      CheckpointError: If `target` is a symbolic link (it is never written through or
        replaced), exists and is not a directory, or holds foreign files.
      CheckpointExistsError: If it is not empty and `overwrite` is False.
    """
    if not os.path.lexists(target):
        return False
    if os.path.islink(target):
        raise CheckpointError(
            f"copy target {target!r} is a symbolic link (to {os.readlink(target)!r}); a copy is "
            "renamed into place as a new directory and never writes through or replaces a link: "
            f"pass the directory itself ({os.path.realpath(target)!r}) or a new path"
        )
    if not os.path.isdir(target):
        raise CheckpointError(f"copy target {target!r} exists and is not a directory")
    if not os.listdir(target):
        return False
    if not overwrite:
        raise CheckpointExistsError(
            f"copy target {target!r} is not empty; choose a new or empty directory, or pass "
            "overwrite=True (--overwrite) to replace the buffer there"
        )
    _check_own_entries(target)
    return True


def _check_own_entries(path: str) -> None:
    """Refuses to replace a directory holding anything but replay_service's own files."""
    entries = sorted(os.listdir(path))
    foreign = [e for e in entries if e not in STORE_ENTRIES]
    if foreign or not CheckpointStore(path).is_store():
        shown = ", ".join(foreign[:5] or entries[:5])
        raise CheckpointError(
            f"{path!r} is not only a replay_service checkpoint directory (it contains {shown}); "
            "it is never replaced or deleted: move it away or choose another name"
        )


def _write_copy(store: CheckpointStore, checkpoint: str, info: dict[str, Any], dest: str) -> None:
    """Writes `dest` as a checkpoint directory holding only `checkpoint`, as the first one."""
    name = os.path.basename(checkpoint)
    width = len(name) - len(CHECKPOINT_PREFIX)
    first = f"{CHECKPOINT_PREFIX}{1:0{width}d}"
    os.makedirs(os.path.join(dest, REVERB_DIR))
    checkpoints = os.path.join(dest, CHECKPOINTS_DIR)
    shutil.copy2(store.store_file, os.path.join(dest, STORE_FILE))
    shutil.copytree(checkpoint, os.path.join(checkpoints, first))
    source = {"path": checkpoint, "sequence": info.get("sequence")}
    copied = {**info, "sequence": 1, "copied_from": source}
    with open(os.path.join(checkpoints, first, CHECKPOINT_META_FILE), "w", encoding="utf-8") as f:
        json.dump(copied, f, indent=2, sort_keys=True)
    _fsync_tree(dest)


def _install(staging: str, target: str) -> None:
    """Renames the complete `staging` to `target`; an existing `target` is removed afterwards.

    Raises:
      CheckpointError: If `target` is a non-empty directory that appeared meanwhile, or a rename
        fails.
    """
    old = _sibling(target, OLD_TAG)
    replace = os.path.isdir(target) and bool(os.listdir(target))
    try:
        if replace:
            remove_path(old)
            os.rename(target, old)
        try:
            os.rename(staging, target)
        except OSError:
            if replace:
                os.rename(old, target)
            raise
        fsync_dir(os.path.dirname(target))
    except OSError as e:
        raise CheckpointError(f"cannot move {staging!r} to {target!r}: {e}") from e
    remove_path(old)


def _fsync_tree(root: str) -> None:
    for directory, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(directory)

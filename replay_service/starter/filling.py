"""`populate`: fills a starter buffer from a baseline policy, run by run, then puts it in place.

`populate` builds the buffer in the hidden `.partial-<pid>` sibling and renames it to `<name>` only
after every run was collected and checkpointed, so a directory under its final name is always
complete; on failure the partial directory is removed. An existing buffer is never modified
silently: populating it again is refused unless the caller asks to replace it (`overwrite`) or to
add to it (`append`), and both build the new version beside it before swapping it in.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from tf_agents.drivers import py_driver
from tf_agents.environments import py_environment
from tf_agents.policies import py_policy

from replay_service.config.options import Timeouts
from replay_service.errors import CheckpointError, ReplayServiceError
from replay_service.manager import ReplayBufferManager
from replay_service.starter.checks import PopulateTarget, check_target, describe_collection
from replay_service.starter.copying import copy_buffer
from replay_service.starter.envs import BuildingEnv
from replay_service.starter.options import SEED_RANGE, PopulateConfig, check_capacity, max_new_items
from replay_service.starter.plots import write_summary_plot
from replay_service.starter.results import PopulateResult, StepRecorder
from replay_service.starter.sources import make_envs_and_policies, starter_data_spec
from replay_service.starter.staging import PARTIAL_TAG, hidden_sibling, install, locked_if_store
from replay_service.storage.files import remove_path

STARTER_KEEP_CHECKPOINTS = 1

Progress = Callable[[int, int], None]
"""Called as `progress(steps_done, steps_total)` while collecting."""


@dataclasses.dataclass(frozen=True)
class _PopulatePlan(PopulateTarget):
    """A checked `PopulateConfig` with everything resolved, before anything is written."""

    config: PopulateConfig
    seed: int
    envs: list[py_environment.PyEnvironment]
    policies: list[py_policy.PyPolicy]
    data_spec: Any

    @property
    def description(self) -> str:
        return describe_collection(self.config)

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
    """Fills a starter buffer from a baseline policy; see `replay_service.starter` for the layout.

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
    partial = hidden_sibling(plan.path, PARTIAL_TAG)
    plot_partial = hidden_sibling(plan.plot_path, PARTIAL_TAG)
    try:
        with locked_if_store(plan.path, plan.stored is not None):
            collected = _build(plan, partial, progress, timeouts)
            write_summary_plot(
                plot_partial, collected.recorders, _plot_title(config), time_of_day=plan.time_of_day
            )
            install(partial, plan.path)
            os.replace(plot_partial, plan.plot_path)
    except BaseException as e:
        if os.path.lexists(partial):
            remove_path(partial)
            kept = f"; {plan.path!r} is unchanged" if plan.stored is not None else ""
            e.add_note(f"nothing was kept: removed the unfinished buffer {partial!r}{kept}")
        remove_path(plot_partial)
        raise
    return _result(plan, collected)


def _make_plan(config: PopulateConfig) -> _PopulatePlan:
    """Checks everything that can be checked without writing and resolves the defaults."""
    target = check_target(config)
    seed = config.seed if config.seed is not None else secrets.randbelow(SEED_RANGE)
    envs, policies = make_envs_and_policies(config.env, config.policy, config.num_envs, seed)
    return _PopulatePlan(
        **vars(target),
        config=config,
        seed=seed,
        envs=envs,
        policies=policies,
        data_spec=starter_data_spec(envs[0], policies[0]),
    )


def _build(
    plan: _PopulatePlan, partial: str, progress: Progress | None, timeouts: Timeouts | None
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


def _result(plan: _PopulatePlan, collected: _Collected) -> PopulateResult:
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


def _make_dirs(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create output dir {path!r}: {e}") from e


def _open_observers(manager: ReplayBufferManager, count: int, *, append: bool) -> list[Any]:
    _, first = manager.load_replay_buffer() if append else manager.create_replay_buffer()
    return [first] + [manager.get_replay_buffer_and_observer()[1] for _ in range(count - 1)]


def _collect(
    manager: ReplayBufferManager,
    plan: _PopulatePlan,
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

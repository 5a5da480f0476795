"""What a `populate` run collected: per-environment step records, the result and its summary."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import tensorflow as tf

from replay_service.starter.envs import decode_time


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

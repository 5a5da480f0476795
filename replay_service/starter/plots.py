"""The summary plot written beside a starter buffer: the rewards and actions collected."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from replay_service.errors import CheckpointError
from replay_service.starter.envs import STEPS_PER_DAY
from replay_service.starter.results import StepRecorder

BUILDING_ACTION_NAMES = ("heating setpoint", "cooling setpoint")
PLOT_DPI = 100


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

"""n-step returns from TF-Agents trajectory steps, and n-step transitions from sampled windows.

Step `t` of a TF-Agents trajectory holds `step_type[t]`, `observation[t]`, `action[t]` and what
followed the action: `reward[t]`, `discount[t]` (the environment's: 0 on termination, 1
otherwise, a time limit included) and `next_step_type[t]` (LAST when the episode ended after this
step). The step after the last transition of an episode is its boundary step (`step_type` LAST),
holding the final observation. For a start `t`, with `m = min(n, transitions left in the
episode)`:

- return `R_t = sum_{k<m} gamma^k * (prod_{j<k} discount[t+j]) * reward[t+k]`; inside an episode
  every discount before the last is 1, so this is the usual `sum_{k<m} gamma^k * reward[t+k]`;
- bootstrap discount `gamma^m * prod_{k<m} discount[t+k]`: 0 when the episode terminated within
  the `m` steps, `gamma^m` when it was truncated (bootstrap from the final observation) or goes on;
- next state: `observation[t + m]`, the boundary step's final observation when the episode ended.

The target is `R_t + bootstrap_discount * V(observation[t + m])`.

**Reading n-step transitions from the table.** Use a table with `sequence_length = n + 1`,
filled by the usual `TrajectoryObserver` or `TransitionWriter`, and `windows_to_n_step` on
sampled batches. An item is a window of `n + 1` steps of one episode, so its first step always
has `n` transitions ahead within the window: the window's episode can only end at its last step
(the boundary), so each item gives one complete n-step transition, next state `observation[:, n]`.
An episode of `T` transitions gives `T - n + 1` items (stride 1), so its last `n - 1` transitions
(whose shortened returns would run into the episode end) never start a window. They are not lost:
they are positions `1..n-1` of the episode's final window (the one ending at the boundary), and
`include_episode_tails=True` returns them too, with `m < n` steps. With that option every
transition of an episode is returned from exactly one item, so uniform sampling of items samples
every transition equally often; the batch size then varies, and `item_index` says which item
(row of the sample info, for priorities and importance weights) each transition came from.
Episodes shorter than `n` transitions have no window and are never written at all.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np
import tree

from replay_service.config.options import require_int
from replay_service.errors import ConfigError, SpecMismatchError
from replay_service.specs.arrays import StepType, to_numpy

LAST = StepType.LAST
MID = StepType.MID
# Padding behind the last step: a step that neither ends the episode nor discounts.
_PAD_REWARD = 0.0
_PAD_DISCOUNT = 1.0
_FIELDS = ("rewards", "discounts", "step_types", "next_step_types")


@dataclasses.dataclass(frozen=True)
class NStepTargets:
    """n-step targets of every start step, arrays shaped like the inputs (`[..., T]`).

    Attributes:
      returns: Discounted sum of the rewards of the `num_steps` steps from `t` (rewards' dtype).
      discounts: Bootstrap discount `gamma^m * prod(env discounts)` (rewards' dtype).
      num_steps: `m`, the steps summed; the next state is at index `t + m` (int64).
      valid: `t` starts an n-step transition: it is not a boundary step and either `n` steps
        or the rest of its episode lie inside the arrays (with the next state). Invalid entries
        hold 0.
    """

    returns: np.ndarray
    discounts: np.ndarray
    num_steps: np.ndarray
    valid: np.ndarray


def _check_n_gamma(n: int, gamma: float) -> None:
    require_int("n", n, 1, maximum=None)
    if isinstance(gamma, bool) or not isinstance(gamma, int | float) or not 0 <= gamma <= 1:
        raise ConfigError(f"gamma must be a number in [0, 1], got {gamma!r}")


def _shifted(array: np.ndarray, k: int, fill: float) -> np.ndarray:
    """`out[..., t] = array[..., t + k]`, `fill` past the end."""
    if k == 0:
        return array
    pad = np.full((*array.shape[:-1], min(k, array.shape[-1])), fill, array.dtype)
    return np.concatenate([array[..., k:], pad], axis=-1)


def n_step_targets(
    rewards: Any,
    discounts: Any,
    step_types: Any,
    next_step_types: Any,
    *,
    n: int,
    gamma: float,
) -> NStepTargets:
    """Computes the n-step return and bootstrap discount of every start step (vectorized).

    The last axis is time: consecutive TF-Agents trajectory steps, possibly several episodes
    separated by their boundary steps (as collected, or a sampled window `[B, T]`). A step is
    summed only if the step after it (its next state) is in the arrays, so the last step of the
    arrays serves only as a next state. The loop runs over `k < n`, never over steps or items.

    Args:
      rewards: `reward[..., T]` (numpy-convertible: numpy, torch on CPU, eager tf).
      discounts: Environment `discount[..., T]`.
      step_types: `step_type[..., T]` (boundary steps are LAST).
      next_step_types: `next_step_type[..., T]` (LAST after an episode's last transition).
      n: Steps of the return, >= 1.
      gamma: Discount factor in [0, 1].

    Returns:
      `NStepTargets` of shape `[..., T]`; see the module docstring for the formulas.

    Raises:
      ConfigError: If `n` or `gamma` is out of range.
      SpecMismatchError: If the four arrays do not have the same shape.
    """
    _check_n_gamma(n, gamma)
    reward = np.asarray(rewards)
    arrays = [np.asarray(x) for x in (discounts, step_types, next_step_types)]
    if reward.ndim == 0 or any(a.shape != reward.shape for a in arrays):
        got = ", ".join(
            f"{name} {list(a.shape)}" for name, a in zip(_FIELDS, [reward, *arrays], strict=True)
        )
        raise SpecMismatchError(
            f"rewards, discounts, step_types and next_step_types must share one shape [..., T], "
            f"got {got}"
        )
    discount, step_type, next_step_type = arrays
    r = reward.astype(np.float64)
    d = discount.astype(np.float64)
    length = reward.shape[-1]
    start = np.arange(length)
    returns = np.zeros(reward.shape, np.float64)
    weight = np.ones(reward.shape, np.float64)
    num_steps = np.zeros(reward.shape, np.int64)
    ended = np.zeros(reward.shape, bool)
    running = step_type != LAST
    for k in range(n):
        usable = running & (start + k + 1 < length)
        returns += np.where(usable, weight * _shifted(r, k, _PAD_REWARD), 0.0)
        weight = np.where(usable, weight * gamma * _shifted(d, k, _PAD_DISCOUNT), weight)
        num_steps += usable
        step_ends = _shifted(next_step_type, k, MID) == LAST
        ended |= usable & step_ends
        running = usable & ~step_ends
    valid = (step_type != LAST) & (num_steps > 0) & ((num_steps == n) | ended)
    dtype = reward.dtype if np.issubdtype(reward.dtype, np.floating) else np.float64
    return NStepTargets(
        returns=np.where(valid, returns, 0.0).astype(dtype),
        discounts=np.where(valid, weight, 0.0).astype(dtype),
        num_steps=np.where(valid, num_steps, 0),
        valid=valid,
    )


@dataclasses.dataclass(frozen=True)
class NStepBatch:
    """n-step transitions read from sampled windows (numpy arrays or torch tensors).

    Train with `returns + discounts * V(next_states)`.

    Attributes:
      states: Observation at the start (a nest if the spec's observation is one).
      actions: Action taken at the start.
      returns: n-step discounted returns, `[M]`.
      discounts: Bootstrap discounts, `[M]` (0 after a termination).
      next_states: Observation `num_steps` steps later (the final one if the episode ended).
      num_steps: Steps summed, `[M]` (`n`, or fewer for an episode's tail).
      item_index: Row of the sampled batch each transition comes from, `[M]`.
    """

    states: Any
    actions: Any
    returns: Any
    discounts: Any
    next_states: Any
    num_steps: Any
    item_index: Any


def _backend(template: Any) -> tuple[Any, Any]:
    """Returns `(to_backend, index)`: converts numpy arrays to `template`'s kind, indexes it."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(template, torch.Tensor):
        device = template.device

        def to_torch(array: np.ndarray) -> Any:
            return torch.from_numpy(np.ascontiguousarray(array)).to(device)

        return to_torch, to_torch
    return (lambda array: array), (lambda array: array)


def windows_to_n_step(
    trajectory: Any, *, n: int, gamma: float, include_episode_tails: bool = False
) -> NStepBatch:
    """Turns sampled windows of `n + 1` trajectory steps into n-step transitions.

    Args:
      trajectory: A TF-Agents `Trajectory` batch with fields `[B, n + 1, ...]` (numpy arrays or
        torch tensors, e.g. `manager.torch_batches(B)` on a table with `sequence_length=n+1`;
        for tf use `.numpy()`). Rewards and discounts must be scalar per step.
      n: Steps of the return; the windows must have `n + 1` steps.
      gamma: Discount factor in [0, 1].
      include_episode_tails: Also return the shortened transitions of positions `1..n-1` of
        windows that end an episode (see the module docstring); the batch then has `B` or more
        rows.

    Returns:
      An `NStepBatch` of the same kind (numpy or torch) as `trajectory.reward`.

    Raises:
      ConfigError: If `n` or `gamma` is out of range or the windows do not have `n + 1` steps.
      SpecMismatchError: If rewards are not scalar per step, or a window's first step does not
        start a complete n-step transition (a window spanning two episodes, not written by
        replay_service).
    """
    _check_n_gamma(n, gamma)
    reward = to_numpy(trajectory.reward)
    if reward.ndim != 2:
        raise SpecMismatchError(
            f"windows_to_n_step needs scalar rewards shaped [batch, n + 1], got shape "
            f"{list(reward.shape)}"
        )
    if reward.shape[1] != n + 1:
        raise ConfigError(
            f"n={n} needs windows of n + 1 = {n + 1} steps (table sequence_length), got "
            f"{reward.shape[1]}"
        )
    targets = n_step_targets(
        reward,
        to_numpy(trajectory.discount),
        to_numpy(trajectory.step_type),
        to_numpy(trajectory.next_step_type),
        n=n,
        gamma=gamma,
    )
    incomplete = np.flatnonzero(~targets.valid[:, 0])
    if incomplete.size:
        raise SpecMismatchError(
            f"windows {incomplete.tolist()[:5]} do not start a complete {n}-step transition "
            "(a window spans two episodes or starts at a boundary step)"
        )
    mask = targets.valid if include_episode_tails else np.zeros_like(targets.valid)
    mask[:, 0] = True
    rows, cols = np.nonzero(mask)
    next_cols = cols + targets.num_steps[rows, cols]
    convert, index = _backend(trajectory.reward)
    rows_i, cols_i, next_i = index(rows), index(cols), index(next_cols)
    return NStepBatch(
        states=tree.map_structure(lambda x: x[rows_i, cols_i], trajectory.observation),
        actions=tree.map_structure(lambda x: x[rows_i, cols_i], trajectory.action),
        returns=convert(targets.returns[rows, cols]),
        discounts=convert(targets.discounts[rows, cols]),
        next_states=tree.map_structure(lambda x: x[rows_i, next_i], trajectory.observation),
        num_steps=convert(targets.num_steps[rows, cols]),
        item_index=convert(rows),
    )

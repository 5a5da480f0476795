"""Prioritized experience replay (PER) on a table with `SamplingConfig(sampler="prioritized")`.

Reverb's prioritized selector draws item `i` with probability `P(i) = p_i^alpha / sum_j p_j^alpha`
(`alpha` = `SamplingConfig.priority_exponent`); every sample carries `info.key`,
`info.probability`, `info.table_size` and `info.priority`. This module adds the learner's side:

- `importance_weights(probability, table_size, beta)`: the bias-correcting weights
  `w_i = (N * P(i))^-beta / max_j w_j` for numpy arrays, tf tensors or torch tensors;
- `BetaSchedule`: `beta` annealed linearly from `start` to `end`;
- `update_priorities(client, table, keys, priorities)`: new priorities (e.g. `|TD error| + eps`)
  for sampled items, validated, deduplicated and sent in one `mutate_priorities` call;
- `MaxPriorityTracker`: the largest priority sent so far, the usual priority of new items;
- `check_updates(updates)`: the check of `mutate_priorities(table, updates={key: priority})`
  that `ReplayBufferManager.py_client` makes on both backends before anything is applied.

Keys of items that were evicted since they were sampled are ignored by Reverb
(`mutate_priorities` skips unknown keys), so updating late is safe; so are keys of another
table of the buffer. Both backends accept and refuse the same inputs (the table in
docs/guide/sampling.md): a priority must be a finite real number >= 0 (`ConfigError`), a key an
integer in [0, 2**64) (`SpecMismatchError`); a refused call changes no priority.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import sys
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import tree

from replay_service.bounded import call_with_timeout
from replay_service.config.options import require_positive_int
from replay_service.errors import ConfigError, SpecMismatchError
from replay_service.specs.arrays import is_tf_tensor, is_torch_tensor, to_numpy

if TYPE_CHECKING:
    import reverb

DEFAULT_BETA_START = 0.4
DEFAULT_BETA_END = 1.0
DEFAULT_BETA_STEPS = 100_000
DEFAULT_INITIAL_PRIORITY = 1.0
# Offending values quoted in an error message, at most.
MAX_REPORTED_VALUES = 5


def _check_beta(beta: float) -> float:
    ok = isinstance(beta, int | float) and not isinstance(beta, bool) and 0 <= beta <= 1
    if not ok:
        raise ConfigError(f"beta must be a number in [0, 1], got {beta!r}")
    return float(beta)


def importance_weights(probabilities: Any, table_size: Any, beta: float) -> Any:
    """Returns the PER importance-sampling weights of a sampled batch.

    `w_i = (N_i * P(i))^-beta`, divided by the largest weight of the batch so that every weight
    is in (0, 1]. `probabilities` and `table_size` are Reverb's `info.probability` and
    `info.table_size` (shape `[B]`, or `[B, T]` as broadcast by `get_dataset`).

    Args:
      probabilities: Sampling probabilities `P(i) > 0`: a numpy array, tf tensor or torch
        tensor.
      table_size: Items in the table when sampled, `N`: a number or an array/tensor of the same
        kind that broadcasts against `probabilities`.
      beta: Bias-correction exponent in [0, 1] (0: no correction, all weights 1).

    Returns:
      Weights of the same kind (numpy, tf or torch) and shape as `probabilities`, in the
      floating dtype of `probabilities` (float64 for integer input).

    Raises:
      ConfigError: If `beta` is not in [0, 1].
    """
    beta = _check_beta(beta)
    if is_torch_tensor(probabilities):
        torch = sys.modules["torch"]
        dtype = probabilities.dtype if probabilities.is_floating_point() else torch.float64
        p = probabilities.to(dtype)
        n = torch.as_tensor(table_size, device=p.device).to(dtype)
        weights = (n * p) ** -beta
        return weights / weights.max() if weights.numel() else weights
    if is_tf_tensor(probabilities):
        tf = sys.modules["tensorflow"]
        dtype = probabilities.dtype if probabilities.dtype.is_floating else tf.float64
        p = tf.cast(probabilities, dtype)
        n = tf.cast(table_size, dtype)
        weights = (n * p) ** -beta
        return tf.math.divide_no_nan(weights, tf.reduce_max(weights))
    p = np.asarray(probabilities)
    p = p if np.issubdtype(p.dtype, np.floating) else p.astype(np.float64)
    weights = (np.asarray(table_size, p.dtype) * p) ** -beta
    return weights / weights.max() if weights.size else weights


@dataclasses.dataclass(frozen=True)
class BetaSchedule:
    """`beta` of `importance_weights`, annealed linearly from `start` to `end` over `steps`.

    Attributes:
      start: `beta` at step 0, in [0, 1].
      end: `beta` from step `steps` on, in [0, 1].
      steps: Training steps of the annealing, a positive integer.

    Raises:
      ConfigError: If a value is out of range.
    """

    start: float = DEFAULT_BETA_START
    end: float = DEFAULT_BETA_END
    steps: int = DEFAULT_BETA_STEPS

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            value = getattr(self, name)
            ok = isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= 1
            if not ok:
                raise ConfigError(f"BetaSchedule.{name} must be a number in [0, 1], got {value!r}")
        steps = self.steps
        require_positive_int("BetaSchedule.steps", steps, maximum=None)

    def value(self, step: int) -> float:
        """Returns `beta` at training step `step` (constant `end` after `steps`).

        Raises:
          ConfigError: If `step` is negative or not an integer.
        """
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
            raise ConfigError(f"step must be an integer >= 0, got {step!r}")
        fraction = min(int(step) / self.steps, 1.0)
        return float(self.start + fraction * (self.end - self.start))


class MaxPriorityTracker:
    """Remembers the largest priority sent through `update_priorities` (thread-safe).

    Standard PER gives a new item the largest priority seen so far, so that it is sampled at
    least once soon. Reverb items written by `TrajectoryObserver` or `TransitionWriter` get the
    constant priority of their `StructuredWriter` config, fixed when the observer or writer is
    created; the tracker cannot change it for an existing one. Use `value` when creating one:

        tracker = MaxPriorityTracker()
        update_priorities(client, table, keys, new_priorities, tracker=tracker)
        writer = manager.transition_writer(priority=tracker.value)

    Re-creating the observer/writer (e.g. once per episode or every few thousand steps) keeps
    the priority of new items close to the running maximum; items written in between get the
    value of their writer's creation time, which is a lower bound of the true maximum.

    Args:
      initial: Value before any update (also the floor of `value`), finite and > 0.

    Raises:
      ConfigError: If `initial` is not finite and > 0.
    """

    def __init__(self, initial: float = DEFAULT_INITIAL_PRIORITY) -> None:
        ok = isinstance(initial, int | float) and math.isfinite(initial) and initial > 0
        if not ok:
            raise ConfigError(f"initial priority must be a finite number > 0, got {initial!r}")
        self._lock = threading.Lock()
        self._value = float(initial)

    @property
    def value(self) -> float:
        """The priority new items should get: the largest seen, at least `initial`."""
        with self._lock:
            return self._value

    def observe(self, priorities: Any) -> float:
        """Raises the maximum to the largest of `priorities` (an empty batch changes nothing).

        Args:
          priorities: Finite priorities >= 0 (numpy array, list, or a number).

        Returns:
          The maximum after the update.

        Raises:
          ConfigError: If a priority is NaN, infinite or negative.
        """
        array = np.asarray(priorities, np.float64)
        _check_priorities(np.arange(array.size), array.reshape(-1), label="index")
        with self._lock:
            if array.size:
                self._value = max(self._value, float(array.max()))
            return self._value


def _keys_to_numpy(keys: Any) -> np.ndarray:
    """Like `to_numpy`, but Python lists of keys above 2**63 stay exact (not float64)."""
    if not isinstance(keys, list | tuple):
        return to_numpy(keys)
    flat = tree.flatten(keys)
    bad = [k for k in flat if isinstance(k, bool) or not isinstance(k, int | np.integer)]
    if bad or any(not 0 <= k < 1 << 64 for k in flat):
        out_of_range = [k for k in flat if not 0 <= k < 1 << 64]
        shown = bad[:MAX_REPORTED_VALUES] or out_of_range[:MAX_REPORTED_VALUES]
        raise SpecMismatchError(f"item keys must be integers in [0, 2**64), got {shown}")
    return np.array(keys, dtype=np.uint64)


def _first_column(name: str, array: np.ndarray) -> np.ndarray:
    """Accepts `[B]`, or `[B, T]` info broadcast over time (every column equal)."""
    if array.ndim == 0:
        return array.reshape(1)
    if array.ndim == 2:
        return array[:, 0]
    if array.ndim != 1:
        raise SpecMismatchError(
            f"{name} must have shape [batch] or [batch, time], got shape {list(array.shape)}"
        )
    return array


def _check_priorities(keys: np.ndarray, priorities: np.ndarray, label: str = "key") -> None:
    bad = ~np.isfinite(priorities) | (priorities < 0)
    if bad.any():
        where = np.flatnonzero(bad)[:MAX_REPORTED_VALUES]
        shown = ", ".join(f"{label} {int(keys[i])}: {float(priorities[i])!r}" for i in where)
        raise ConfigError(
            f"priorities must be finite and >= 0, got {int(bad.sum())} bad value(s) ({shown})"
        )


def _bad_priority(value: Any) -> bool:
    """Whether `value` is not a finite real number >= 0 (bools are not numbers here)."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        return True
    return not (math.isfinite(value) and value >= 0)


def _bad_key(key: Any) -> bool:
    """Whether `key` is not an integer in [0, 2**64) (bools are not integers here)."""
    if isinstance(key, bool | np.bool_) or not isinstance(key, int | np.integer):
        return True
    return not 0 <= int(key) < 1 << 64


def describe_bad_priorities(priorities: Mapping[Any, Any], label: str = "key") -> str:
    """The priorities of `priorities` (anything -> priority) that are not finite real numbers
    >= 0, as "N bad value(s) (key 3: nan, ...)"; "" if there are none.

    Args:
      priorities: What each priority belongs to (a key, a table name) -> priority.
      label: What the mapping's keys are, in the text.
    """
    bad = [(k, p) for k, p in priorities.items() if _bad_priority(p)]
    if not bad:
        return ""
    shown = ", ".join(
        f"{label} {k if isinstance(k, int | np.integer) else repr(k)}: {p!r}"
        for k, p in bad[:MAX_REPORTED_VALUES]
    )
    return f"{len(bad)} bad value(s) ({shown})"


def check_updates(updates: Mapping[Any, Any] | None) -> dict[int, float]:
    """Checks `mutate_priorities`' `updates` whole, before any priority is applied.

    Reverb's own `Client.mutate_priorities` applies a batch key by key: a NaN or negative
    priority is refused (`ValueError`) only once the updates before it were applied and the
    bad value was stored on its item, and +inf is accepted and breaks the prioritized table's
    sampling (`info.probability` NaN). This check refuses all of them first, on both backends.

    Args:
      updates: `{key: priority}`: keys are Python or numpy integers in [0, 2**64) (unknown ones
        are ignored by the table), priorities finite real numbers >= 0; None: no update.

    Returns:
      `{int key: float priority}`, in the order given.

    Raises:
      SpecMismatchError: If `updates` is not a mapping or a key is not an integer in
        [0, 2**64) (a float, a bool, a string, a negative number...); the keys are named.
      ConfigError: If a priority is NaN, infinite, negative or not a real number (a bool, a
        string, None...); the values and their keys are named.
    """
    if updates is None:
        return {}
    if not isinstance(updates, Mapping):
        raise SpecMismatchError(
            f"updates must be a mapping of item key -> priority, got {type(updates).__name__}"
        )
    bad_keys = [k for k in updates if _bad_key(k)]
    if bad_keys:
        raise SpecMismatchError(
            f"item keys must be integers in [0, 2**64), got {len(bad_keys)} bad key(s): "
            f"{bad_keys[:MAX_REPORTED_VALUES]!r}"
        )
    bad = describe_bad_priorities(updates)
    if bad:
        raise ConfigError(
            f"priorities must be finite real numbers >= 0, got {bad}; no priority was changed"
        )
    return {int(k): float(p) for k, p in updates.items()}


def prepare_updates(keys: Any, priorities: Any) -> dict[int, float]:
    """Validates a batch of priority updates and turns it into `{key: priority}`.

    Args:
      keys: Item keys (`info.key`), shape `[B]` or `[B, T]`: numpy, tf or torch (uint64 or
        int64).
      priorities: New priorities, same leading shape as `keys`.

    Returns:
      One entry per distinct key; for a repeated key the last value wins.

    Raises:
      SpecMismatchError: If the shapes differ or are not `[B]` / `[B, T]`.
      ConfigError: If a priority is NaN, infinite or negative (the value and its key are named),
        or the priorities are not real numbers (bools, strings).
    """
    key_array = _first_column("keys", _keys_to_numpy(keys))
    priority_array = _first_column("priorities", to_numpy(priorities))
    if priority_array.size and priority_array.dtype.kind not in "iuf":
        raise ConfigError(
            f"priorities must be real numbers, got dtype {priority_array.dtype} "
            f"(first value {priority_array.reshape(-1)[0]!r})"
        )
    priority_array = priority_array.astype(np.float64)
    if key_array.shape != priority_array.shape:
        raise SpecMismatchError(
            f"keys and priorities must have the same batch size, got {key_array.shape[0]} keys "
            f"and {priority_array.shape[0]} priorities"
        )
    if key_array.size and not np.issubdtype(key_array.dtype, np.integer):
        raise SpecMismatchError(f"keys must be integers, got dtype {key_array.dtype}")
    _check_priorities(key_array, priority_array)
    return dict(zip(key_array.astype(np.uint64).tolist(), priority_array.tolist(), strict=True))


def update_priorities(
    client: reverb.Client,
    table_name: str,
    keys: Any,
    priorities: Any,
    *,
    timeout: float | None = None,
    tracker: MaxPriorityTracker | None = None,
) -> dict[int, float]:
    """Sets new priorities of sampled items in one `mutate_priorities` call.

    Keys of items no longer in the table (evicted, or sampled `max_times_sampled` times) are
    ignored by the server; the other updates still apply.

    Args:
      client: Client of the server holding the table.
      table_name: The prioritized table.
      keys: Item keys from the sample info (`info.key`), `[B]` or `[B, T]`.
      priorities: New priorities (e.g. `abs(td_error) + 1e-6`), same shape as `keys`.
      timeout: Seconds to wait for the server; None waits forever.
      tracker: If given, raised to the largest new priority.

    Returns:
      The `{key: priority}` updates sent (after deduplication, last wins).

    Raises:
      SpecMismatchError: If the shapes of `keys` and `priorities` do not match.
      ConfigError: If a priority is NaN, infinite or negative.
      TimeoutError: If the server does not answer within `timeout`.
    """
    updates = prepare_updates(keys, priorities)
    if not updates:
        return updates
    call_with_timeout(
        lambda: client.mutate_priorities(table_name, updates=updates),
        timeout,
        f"mutate_priorities on table {table_name!r}",
    )
    if tracker is not None:
        tracker.observe(list(updates.values()))
    return updates

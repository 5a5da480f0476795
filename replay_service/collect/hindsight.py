"""Hindsight experience replay (HER): relabelled copies of each episode, written at its end.

For goal-conditioned environments with gymnasium-robotics' Dict observations (`observation`,
`achieved_goal`, `desired_goal`) and a reward function `compute_reward(achieved_goal,
desired_goal, info)`, `HindsightWriter` writes every transition as it comes (through a
`TransitionWriter`) and, when the episode ends, `k` relabelled copies of each of its
transitions whose goal is one the episode actually achieved (Andrychowicz et al. 2017; as
pytorchrl's `HERBuffer`, which relabels at episode end):

- `strategy="future"`: for transition `t` of an episode of `T` transitions, `k` indices `j`
  drawn uniformly from `t .. T - 1` (with replacement); the goal is the achieved goal of
  transition `j`'s next observation (`next_state["achieved_goal"]`), as Stable-Baselines3's
  `HerReplayBuffer`;
- `strategy="final"`: one copy per transition, the goal being the achieved goal of the
  episode's final observation.

A relabelled transition is the original with `desired_goal` replaced by the new goal in both
`state` and `next_state`, and the reward `compute_reward(next_state["achieved_goal"], goal,
info)`, computed for the whole episode in one vectorised call (`achieved_goal` and
`desired_goal` `[N, *goal_shape]`, `info` a numpy object array of the `N` transitions' info
dicts, gymnasium-robotics' convention). Its `done` is the original's; it is written as an
episode of its own (one item in a 2-step table), so a non-terminal copy is marked `truncated`:
learners bootstrap from its `next_state` as from any transition.

Why at episode end rather than at sampling time (SB3's way): relabelled transitions are then
ordinary items, so they work on both backends, with every sampling path (tf.data, torch
streams, epochs, priorities) and survive checkpoints and exports, at the cost of `k` times the
storage of each episode and goals fixed when written.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from replay_service.collect.writing import WritingClient
from replay_service.errors import ConfigError, SpecMismatchError
from replay_service.specs.arrays import to_numpy

if TYPE_CHECKING:
    from replay_service.collect.view import CollectView

GOAL_KEYS = ("observation", "achieved_goal", "desired_goal")
"""The keys of a gymnasium-robotics goal observation."""

STRATEGIES = ("future", "final")
DEFAULT_K = {"future": 4, "final": 1}


def check_goal_spec(observation_spec: Any) -> None:
    """Refuses an observation spec that is not a gymnasium-robotics goal observation.

    Args:
      observation_spec: The data spec's `observation` (a dict of specs for a Dict space).

    Raises:
      ConfigError: If it is not a dict with `observation`, `achieved_goal` and
        `desired_goal`, or the two goals differ in shape or dtype (naming what it is).
    """
    if not isinstance(observation_spec, dict) or not set(GOAL_KEYS) <= set(observation_spec):
        what = (
            f"a dict with keys {sorted(observation_spec)}"
            if isinstance(observation_spec, dict)
            else repr(observation_spec)
        )
        raise ConfigError(
            "hindsight relabelling needs a goal observation space: a gymnasium Dict space with "
            f"keys {list(GOAL_KEYS)} (gymnasium-robotics' GoalEnv); this buffer's observation "
            f"is {what}"
        )
    achieved, desired = observation_spec["achieved_goal"], observation_spec["desired_goal"]
    if tuple(achieved.shape) != tuple(desired.shape) or achieved.dtype != desired.dtype:
        raise ConfigError(
            "achieved_goal and desired_goal must have one shape and dtype, got "
            f"{list(achieved.shape)} {achieved.dtype} and {list(desired.shape)} {desired.dtype}"
        )


def check_options(compute_reward: Any, strategy: Any, k: Any, seed: Any) -> int:
    """Checks the relabelling options.

    Returns:
      `k`, its default for the strategy when None.

    Raises:
      ConfigError: Naming the option and its value.
    """
    if not callable(compute_reward):
        raise ConfigError(
            "compute_reward must be callable as compute_reward(achieved_goal, desired_goal, "
            f"info), got {compute_reward!r}"
        )
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy must be one of {list(STRATEGIES)}, got {strategy!r}")
    if k is None:
        k = DEFAULT_K[strategy]
    if not isinstance(k, numbers.Integral) or isinstance(k, bool) or k < 1:
        raise ConfigError(f"k must be a positive integer (relabels per transition), got {k!r}")
    if strategy == "final" and k != 1:
        raise ConfigError(
            f"strategy='final' relabels each transition once, with the episode's final "
            f"achieved goal; k={k!r} would write identical copies (use strategy='future')"
        )
    if seed is not None and (
        not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or seed < 0
    ):
        raise ConfigError(f"seed must be a non-negative integer or None, got {seed!r}")
    return int(k)


class HindsightWriter:
    """Writes transitions of one goal-conditioned environment and their HER relabels.

    Get it from `ReplayBufferManager.hindsight_writer(compute_reward, ...)`. Call `add` after
    every step, as `TransitionWriter.add`, with the step's `info` dict; the episode's
    relabelled transitions are written by the `add` that ends it (`done` or `truncated`).
    `reset()` drops the current episode's pending relabels (its transitions stay written).

    Args:
      writer: The `TransitionWriter` every transition goes through.
      compute_reward: `compute_reward(achieved_goal, desired_goal, info) -> rewards`,
        vectorised (gymnasium-robotics' `env.unwrapped.compute_reward`).
      strategy: "future" or "final" (see the module docstring).
      k: Relabels per transition ("future"; "final" takes 1); None: 4 for "future".
      seed: Seed of the "future" draws; None draws fresh ones.

    Raises:
      ConfigError: If an option is invalid (`check_options`).
    """

    def __init__(
        self,
        writer: Any,
        compute_reward: Callable[[Any, Any, Any], Any],
        *,
        strategy: str = "future",
        k: int | None = None,
        seed: int | None = None,
    ) -> None:
        self.k = check_options(compute_reward, strategy, k, seed)
        self.strategy = strategy
        self._writer = writer
        self._compute_reward = compute_reward
        self._rng = np.random.default_rng(seed)
        self._episode: list[tuple[Any, ...]] = []
        self.relabelled = 0
        """Relabelled transitions written so far."""

    @property
    def py_client(self) -> WritingClient:
        """The client written through."""
        return self._writer.py_client

    def add(
        self,
        state: Any,
        action: Any,
        reward: Any,
        next_state: Any,
        done: Any,
        truncated: Any = False,
        info: dict[str, Any] | None = None,
        **extras: Any,
    ) -> None:
        """Writes one transition; at the episode's end, its relabelled copies too.

        Args:
          state: The goal observation before the action (a dict with `observation`,
            `achieved_goal`, `desired_goal`).
          action: The action taken.
          reward: The environment's reward.
          next_state: The goal observation after the action (the final one at an episode's
            end).
          done: The episode terminated.
          truncated: The episode ended without terminating (a time limit).
          info: The step's info dict, handed to `compute_reward` (None: `{}`).
          **extras: Declared extra fields, as `TransitionWriter.add` takes them.

        Raises:
          SpecMismatchError: As `TransitionWriter.add` (nothing of this call is written), or
            if `compute_reward` does not return one finite reward per transition (the
            episode's relabels are then not written; its transitions are).
          WriteTimeoutError, ManagerClosedError: As `TransitionWriter.add`.
        """
        if info is not None and not isinstance(info, dict):
            raise SpecMismatchError(f"info must be the step's info dict or None, got {info!r}")
        self._writer.add(state, action, reward, next_state, done, truncated, **extras)
        self._episode.append(
            (state, action, next_state, bool(done), {} if info is None else info, extras)
        )
        if bool(done) or bool(truncated):
            episode, self._episode = self._episode, []
            self._relabel(episode)

    def reset(self) -> None:
        """Ends the current episode without relabelling it (e.g. after a manual env reset)."""
        self._episode = []
        self._writer.reset()

    def flush(self) -> None:
        """Blocks until everything written is confirmed (`TransitionWriter.flush`)."""
        self._writer.flush()

    def close(self) -> None:
        """Closes the underlying writer (a pending episode's relabels are not written)."""
        self._episode = []
        self._writer.close()

    def _relabel(self, episode: list[tuple[Any, ...]]) -> None:
        count = len(episode)
        achieved = np.stack([_goal(t[2], "achieved_goal") for t in episode])  # next states
        if self.strategy == "final":
            sources = [np.full(1, count - 1) for _ in range(count)]
        else:
            sources = [self._rng.integers(t, count, size=self.k) for t in range(count)]
        rows = [(t, int(j)) for t in range(count) for j in sources[t]]
        goals = np.stack([achieved[j] for _, j in rows])
        infos = np.empty(len(rows), dtype=object)
        for position, (t, _) in enumerate(rows):
            infos[position] = episode[t][4]
        next_achieved = np.stack([achieved[t] for t, _ in rows])
        rewards = self._rewards(next_achieved, goals, infos)
        for (t, _), goal, reward in zip(rows, goals, rewards, strict=True):
            state, action, next_state, done, _, extras = episode[t]
            self._writer.add(
                _with_goal(state, goal),
                action,
                reward,
                _with_goal(next_state, goal),
                done,
                not done,
                **extras,
            )
            self.relabelled += 1

    def _rewards(self, achieved: np.ndarray, desired: np.ndarray, infos: np.ndarray) -> Any:
        try:
            rewards = np.asarray(self._compute_reward(achieved, desired, infos))
        except Exception as e:
            raise SpecMismatchError(
                f"compute_reward(achieved_goal {list(achieved.shape)}, desired_goal "
                f"{list(desired.shape)}, info [{len(infos)}]) failed: {e!r}"
            ) from e
        if rewards.shape != (len(infos),) or not np.issubdtype(rewards.dtype, np.number):
            raise SpecMismatchError(
                f"compute_reward must return one number per transition (shape "
                f"[{len(infos)}]), got {rewards.dtype} of shape {list(rewards.shape)}"
            )
        if not np.isfinite(rewards).all():
            raise SpecMismatchError(f"compute_reward returned non-finite rewards: {rewards!r}")
        return rewards


def _goal(observation: Any, key: str) -> np.ndarray:
    if not isinstance(observation, dict) or key not in observation:
        raise SpecMismatchError(
            f"a goal observation must be a dict with {key!r}, got {type(observation).__name__}"
        )
    return np.array(to_numpy(observation[key]))


def _with_goal(observation: dict[str, Any], goal: np.ndarray) -> dict[str, Any]:
    relabelled = dict(observation)
    relabelled["desired_goal"] = goal
    return relabelled


def hindsight_writer(
    view: CollectView,
    compute_reward: Callable[[Any, Any, Any], Any],
    strategy: str,
    k: int | None,
    seed: int | None,
    priority: float,
) -> HindsightWriter:
    """A `HindsightWriter` over a new transition writer of the buffer (see module docs).

    Args:
      view: The buffer; its observation must be a gymnasium-robotics goal observation (a Dict
        of `observation`, `achieved_goal` and `desired_goal`).
      compute_reward: The environment's vectorised `compute_reward(achieved_goal,
        desired_goal, info)`.
      strategy: "future" or "final".
      k: Relabels per transition; None: 4 for "future", 1 for "final".
      seed: Seed of the "future" draws; None draws fresh ones.
      priority: Initial priority of new items.

    Returns:
      The writer; its transition writer joins `view.writers`.

    Raises:
      ConfigError: If an option is invalid, the observation is not a goal observation, or a
        table's items are not single transitions (sequence_length 2, stride_length 1); all
        checked before `view.require_client`.
      BufferStateError: If the buffer was not created or loaded.
    """
    from replay_service.collect.view import transition_writer

    check_options(compute_reward, strategy, k, seed)
    check_goal_spec(getattr(view.data_spec, "observation", None))
    for config in view.tables:
        if config.sequence_length != 2 or view.stride_length != 1:
            raise ConfigError(
                f"hindsight_writer writes relabelled transitions as items of 2 steps; table "
                f"{config.name!r} has sequence_length={config.sequence_length} and "
                f"stride_length={view.stride_length} (it needs 2 and 1)"
            )
    writer = transition_writer(view, priority=priority)
    return HindsightWriter(writer, compute_reward, strategy=strategy, k=k, seed=seed)

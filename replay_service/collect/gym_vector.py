"""Collect from a gymnasium vector env as its `step` returns, in either auto-reset mode.

A gymnasium (>= 1.0) vector env resets an environment whose episode ended by itself, in one of
two ways (`envs.metadata["autoreset_mode"]`):

- NEXT_STEP (the default): the step that ends an episode returns its real final observation;
  the *next* step of that environment ignores the action and returns the reset observation,
  with reward 0 and neither `terminated` nor `truncated`. That reset step is not a transition.
- SAME_STEP: the step that ends an episode already returns the reset observation; the final one
  is in `infos["final_obs"][i]` (older gymnasium and gym: `infos["final_observation"]`), marked
  by `infos["_final_obs"][i]`.

Passing either as it comes to `TransitionWriter.add_multi` is wrong for NEXT_STEP (a reset step
would be stored as a transition from the final observation to the reset one). `GymVectorWriter`
takes the step outputs unchanged, `writer.add(actions, *envs.step(actions))`, keeps each
environment's previous observation, and writes exactly the environments' real transitions, each
environment's episodes through its own `TransitionWriter`::

    envs = gymnasium.vector.SyncVectorEnv([make_env] * 8)
    writer = manager.gym_vector_writer(envs)          # reads the env's autoreset mode
    obs, _ = envs.reset(seed=0)
    writer.reset(obs)
    for _ in range(steps):
        actions = policy(obs)
        obs, rewards, terminated, truncated, infos = envs.step(actions)
        writer.add(actions, obs, rewards, terminated, truncated, infos)

Mismatches that can be seen are refused, naming the environment and what was seen, before
anything of that step is written: final observations in `infos` under NEXT_STEP, an ended
episode without one under SAME_STEP, and a NEXT_STEP reset step with a reward or an end flag.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from replay_service.errors import ConfigError, SpecMismatchError

if TYPE_CHECKING:
    from replay_service.collect.transitions import TransitionWriter
    from replay_service.collect.view import CollectView

FINAL_OBS_KEYS = ("final_obs", "final_observation")
"""Keys of `infos` holding SAME_STEP final observations: gymnasium >= 1.0, then older ones."""


class AutoresetMode(enum.Enum):
    """How the vector env resets an environment whose episode ended (see module docs)."""

    NEXT_STEP = "next_step"
    SAME_STEP = "same_step"

    @classmethod
    def parse(cls, value: Any) -> AutoresetMode:
        """Accepts this enum, gymnasium's `AutoresetMode`, or "next_step"/"same_step".

        Raises:
          ConfigError: For anything else, e.g. gymnasium's DISABLED mode.
        """
        if isinstance(value, cls):
            return value
        raw = getattr(value, "value", value)  # gymnasium's values are "NextStep", "SameStep"
        text = str(raw).lower().replace("_", "")
        for mode in cls:
            if text == mode.value.replace("_", ""):
                return mode
        raise ConfigError(
            f"autoreset_mode must be NEXT_STEP or SAME_STEP, got {value!r} (with DISABLED the "
            "env does not reset itself: use TransitionWriter.add per environment)"
        )


class GymVectorWriter:
    """Writes the real transitions of a gymnasium vector env's steps (see module docs).

    Args:
      writers: One `TransitionWriter` per environment (e.g. from `manager.transition_writer()`).
      autoreset_mode: The env's mode: `envs.metadata["autoreset_mode"]`, a gymnasium
        `AutoresetMode`, or "next_step"/"same_step".

    Raises:
      ConfigError: If `writers` is empty or the mode is not NEXT_STEP or SAME_STEP.
    """

    def __init__(self, writers: Sequence[TransitionWriter], autoreset_mode: Any) -> None:
        if not writers:
            raise ConfigError("GymVectorWriter needs one TransitionWriter per environment, got 0")
        self._writers = list(writers)
        self._mode = AutoresetMode.parse(autoreset_mode)
        self._previous: list[Any] | None = None
        # NEXT_STEP: environments whose next step is the reset step.
        self._resetting = np.zeros(len(self._writers), bool)
        self.transitions = 0
        """Transitions written so far."""
        self.reset_steps = 0
        """NEXT_STEP reset steps recognised and left out so far."""

    @property
    def num_envs(self) -> int:
        """Number of environments."""
        return len(self._writers)

    @property
    def autoreset_mode(self) -> AutoresetMode:
        """The auto-reset mode the steps are read with."""
        return self._mode

    def reset(self, observations: Any) -> None:
        """Starts from the observations `envs.reset()` returned; ends every open episode.

        Args:
          observations: `[num_envs, ...]` observations (a dict of such arrays for dict spaces).

        Raises:
          SpecMismatchError: If the leading dimension is not `num_envs`.
        """
        rows = self._rows("observations", observations)
        for writer in self._writers:
            writer.reset()
        self._previous = rows
        self._resetting[:] = False

    def add(
        self,
        actions: Any,
        observations: Any,
        rewards: Any,
        terminated: Any,
        truncated: Any,
        infos: Mapping[str, Any] | None = None,
        *,
        end_episodes: bool = False,
        **extras: Any,
    ) -> int:
        """Writes the transitions of one `envs.step(actions)` call.

        Args:
          actions: `[num_envs, ...]` actions passed to `envs.step`.
          observations: `[num_envs, ...]` observations it returned.
          rewards: `[num_envs]` rewards it returned.
          terminated: `[num_envs]` terminated flags it returned.
          truncated: `[num_envs]` truncated flags it returned.
          infos: The infos dict it returned (final observations under SAME_STEP).
          end_episodes: This is the last step collected: every episode still running ends
            with it, written as truncated with `observations[i]` as its final observation
            (a time limit of the collection, bootstrapped from like any truncation), so that
            its last transition is stored too; call `reset(obs)` before writing more steps.
          **extras: The data spec's extra per-step fields (`from_spaces(extras=...)`), one
            keyword each, `[num_envs, ...]` (a dict of such arrays for a dict extra): row `i`
            goes with environment `i`'s transition, like the other fields.

        Returns:
          The number of transitions written (`num_envs` minus the NEXT_STEP reset steps).

        Raises:
          BufferStateError: If `reset` was not called first.
          SpecMismatchError: If a size differs from `num_envs`, the step does not fit the
            auto-reset mode (named, with the environment), or it is the old gym API's four
            values (`infos` as `truncated`); nothing of the step is written.
            Values that do not fit the data spec, and missing or unknown extras, are refused
            by the environment's `TransitionWriter` (environments before it in the step are
            written).
        """
        if infos is None and isinstance(truncated, Mapping):
            raise SpecMismatchError(
                "GymVectorWriter.add(actions, observations, rewards, terminated, truncated, "
                "infos) takes the five values of gymnasium's envs.step(), but got four "
                "(observations, rewards, dones, infos: the infos dict came as `truncated`), as "
                "the old gym vector API (gym < 0.26) returns; its dones do not say whether an "
                "episode terminated or was truncated. Make the vector env with gymnasium (or "
                "wrap each env with shimmy's GymV21Environment-v0); nothing was written"
            )
        if self._previous is None:
            from replay_service.errors import BufferStateError

            raise BufferStateError("call GymVectorWriter.reset(obs) with envs.reset()'s first")
        infos = infos or {}
        action_rows = self._rows("actions", actions)
        next_rows = self._rows("observations", observations)
        extra_rows = {name: self._rows(name, value) for name, value in extras.items()}
        reward_rows = self._flags_or_values("rewards", rewards, float)
        ended_terminated = self._flags_or_values("terminated", terminated, bool)
        ended_truncated = self._flags_or_values("truncated", truncated, bool)
        finals = self._final_observations(infos)
        ended = ended_terminated | ended_truncated
        self._check_mode(finals, ended, reward_rows)
        written = 0
        for i, writer in enumerate(self._writers):
            if self._mode is AutoresetMode.NEXT_STEP and self._resetting[i]:
                self.reset_steps += 1
                continue
            next_state = next_rows[i]
            if ended[i] and self._mode is AutoresetMode.SAME_STEP:
                next_state = finals[i]
            terminal = bool(ended_terminated[i])
            writer.add(
                self._previous[i],
                action_rows[i],
                reward_rows[i],
                next_state,
                terminal,
                (bool(ended_truncated[i]) or end_episodes) and not terminal,
                **{name: rows[i] for name, rows in extra_rows.items()},
            )
            written += 1
        self._previous = None if end_episodes else next_rows
        if self._mode is AutoresetMode.NEXT_STEP:
            self._resetting = ended & ~self._resetting
        self.transitions += written
        return written

    def flush(self) -> None:
        """Blocks until every item written so far is confirmed (see `TransitionWriter.flush`)."""
        for writer in self._writers:
            writer.flush()

    def close(self) -> None:
        """Closes every environment's writer (ending their episodes). Idempotent."""
        for writer in self._writers:
            writer.close()

    # ---------------------------------------------------------------------------- helpers

    def _check_mode(self, finals: dict[int, Any], ended: np.ndarray, rewards: list[Any]) -> None:
        if self._mode is AutoresetMode.NEXT_STEP:
            if finals:
                raise SpecMismatchError(
                    f"infos holds final observations for envs {sorted(finals)}, as an env with "
                    "autoreset_mode SAME_STEP returns them, but this writer reads NEXT_STEP "
                    "steps; pass the env's envs.metadata['autoreset_mode']"
                )
            for i in np.flatnonzero(self._resetting):
                if ended[i] or rewards[i] != 0:
                    raise SpecMismatchError(
                        f"env {int(i)}: the step after its episode ended should be "
                        f"autoreset_mode NEXT_STEP's reset step (reward 0, not ended), got "
                        f"reward {rewards[i]!r}, ended {bool(ended[i])}; is the env SAME_STEP?"
                    )
            return
        missing = [int(i) for i in np.flatnonzero(ended) if int(i) not in finals]
        if missing:
            raise SpecMismatchError(
                f"envs {missing} ended, but infos has no final observation for them "
                f"({' / '.join(FINAL_OBS_KEYS)}) as autoreset_mode SAME_STEP returns; is the "
                "env NEXT_STEP? Pass the env's envs.metadata['autoreset_mode']"
            )

    def _final_observations(self, infos: Mapping[str, Any]) -> dict[int, Any]:
        for key in FINAL_OBS_KEYS:
            if key in infos:
                values = infos[key]
                mask = np.asarray(infos.get(f"_{key}", [v is not None for v in values]), bool)
                if mask.shape != (self.num_envs,):
                    raise SpecMismatchError(
                        f"infos['_{key}'] must have shape [{self.num_envs}], got {list(mask.shape)}"
                    )
                rows = self._rows(f"infos[{key!r}]", values, allow_objects=True)
                return {int(i): rows[i] for i in np.flatnonzero(mask)}
        return {}

    def _rows(self, name: str, value: Any, allow_objects: bool = False) -> list[Any]:
        """Splits `[num_envs, ...]` values (or a dict of them) into one value per env."""
        if isinstance(value, Mapping):
            parts = {k: self._rows(f"{name}[{k!r}]", v, allow_objects) for k, v in value.items()}
            return [{k: rows[i] for k, rows in parts.items()} for i in range(self.num_envs)]
        if isinstance(value, tuple):
            parts_t = [self._rows(f"{name}[{j}]", v, allow_objects) for j, v in enumerate(value)]
            return [tuple(rows[i] for rows in parts_t) for i in range(self.num_envs)]
        array = value if allow_objects and isinstance(value, np.ndarray) else np.asarray(value)
        if array.ndim == 0 or array.shape[0] != self.num_envs:
            raise SpecMismatchError(
                f"{name}: expected a leading dimension of {self.num_envs} (one row per env), got "
                f"shape {list(array.shape)}"
            )
        return [array[i] for i in range(self.num_envs)]

    def _flags_or_values(self, name: str, value: Any, kind: type) -> Any:
        array = np.asarray(value)
        if array.shape != (self.num_envs,):
            raise SpecMismatchError(
                f"{name}: expected shape [{self.num_envs}], got {list(array.shape)}"
            )
        return array.astype(bool) if kind is bool else [array[i] for i in range(self.num_envs)]


def gym_vector_writer(
    view: CollectView, envs: Any, autoreset_mode: Any = None, priority: float = 1.0
) -> GymVectorWriter:
    """A `GymVectorWriter` over one new transition writer of the buffer per environment.

    Args:
      view: The buffer.
      envs: The vector env (its `num_envs` and `metadata["autoreset_mode"]` are read), or the
        number of environments.
      autoreset_mode: Overrides the env's mode; required when `envs` is a number or its
        metadata has none (gymnasium < 1.0 envs reset in the same step).
      priority: Initial priority of new items.

    Returns:
      The writer; its transition writers join `view.writers`.

    Raises:
      ConfigError: If the number of envs or the mode is invalid (before
        `view.require_client`).
      BufferStateError: If the buffer was not created or loaded.
    """
    from replay_service.collect.view import transition_writer

    num_envs = envs if isinstance(envs, int) else getattr(envs, "num_envs", None)
    if not isinstance(num_envs, int) or isinstance(num_envs, bool) or num_envs < 1:
        raise ConfigError(f"envs must be a vector env or a number of envs >= 1, got {envs!r}")
    if autoreset_mode is None:
        metadata = getattr(envs, "metadata", None) or {}
        autoreset_mode = metadata.get("autoreset_mode")
    if autoreset_mode is None:
        raise ConfigError(
            f"{envs!r} does not say its autoreset_mode; pass autoreset_mode='next_step' or "
            "'same_step'"
        )
    writers = [transition_writer(view, priority=priority) for _ in range(num_envs)]
    return GymVectorWriter(writers, autoreset_mode)

"""TF-Agents' episode-end padding: `ReverbAddTrajectoryObserver(pad_end_of_episodes=...)`.

TF-Agents' observer pads an episode differently from this project's `pad_end_of_episode`
tables (`replay_service.specs.windows`, `Masked` steps with a mask). When its boundary step
arrives (or `reset(write_cached_steps=True)` is called) with `pad_end_of_episodes=True`, it
appends zero "boundary" steps (`trajectory.boundary` of zeros: `step_type` LAST,
`next_step_type` FIRST, every other field 0) to the episode and writes every window those
steps complete, by its usual rule (an item once `sequence_length` steps are cached, then every
`stride_length` steps):

- `tile_end_of_episodes=False`: `sequence_length - steps` padding steps, only when the episode
  is shorter than `sequence_length` steps (so its one window is written);
- `tile_end_of_episodes=True`: `sequence_length - 1` padding steps, so the windows slide past
  the episode's last step: `F M L P`, `M L P P`, `L P P P` (stride 1).

Items are plain `Trajectory` windows, no mask (a padding step is recognisable by its zero
`discount` and LAST/FIRST step types). `EpisodePadding` says how many steps to append and
gives the padding step; the observer appends them through its usual writer, whose windows
follow the same rule, so Reverb (nested or packed) and local tables get the same items as
TF-Agents' observer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import tree

from replay_service.errors import ConfigError
from replay_service.specs.nests import normalize_spec, numpy_dtype

_LAST = 2  # TF-Agents' StepType.LAST
_FIRST = 0  # TF-Agents' StepType.FIRST


@dataclasses.dataclass(frozen=True)
class EpisodePadding:
    """TF-Agents' `pad_end_of_episodes` / `tile_end_of_episodes` for one observer.

    Attributes:
      sequence_length: Steps per item.
      tile: `tile_end_of_episodes`: pad `sequence_length - 1` steps after every episode.
      step: The padding step (a `Trajectory` of numpy zeros, LAST -> FIRST).
    """

    sequence_length: int
    tile: bool
    step: Any

    @classmethod
    def build(
        cls,
        data_spec: Any,
        sequence_length: int,
        pad_end_of_episodes: Any,
        tile_end_of_episodes: Any,
        *,
        masked_table: bool,
    ) -> EpisodePadding | None:
        """Checks the two flags; returns the padding, or None without `pad_end_of_episodes`.

        Args:
          data_spec: The per-step TF-Agents `Trajectory` spec.
          sequence_length: Steps per item.
          pad_end_of_episodes: TF-Agents' flag of the same name.
          tile_end_of_episodes: TF-Agents' flag of the same name (needs `pad_end_of_episodes`).
          masked_table: Whether the tables already pad with `Masked` steps
            (`pad_end_of_episode=True`), which stores other items.

        Returns:
          An `EpisodePadding`, or None when `pad_end_of_episodes` is False.

        Raises:
          ConfigError: If a flag is not a bool, `tile_end_of_episodes` is set without
            `pad_end_of_episodes`, or the tables are `Masked` (`pad_end_of_episode=True`).
        """
        for name, value in (
            ("pad_end_of_episodes", pad_end_of_episodes),
            ("tile_end_of_episodes", tile_end_of_episodes),
        ):
            if not isinstance(value, bool | np.bool_):
                raise ConfigError(f"{name} must be True or False, got {value!r}")
        if tile_end_of_episodes and not pad_end_of_episodes:
            raise ConfigError(
                "tile_end_of_episodes=True needs pad_end_of_episodes=True (as TF-Agents' "
                "ReverbAddTrajectoryObserver)"
            )
        if not pad_end_of_episodes:
            return None
        if masked_table:
            raise ConfigError(
                "pad_end_of_episodes=True (TF-Agents' zero boundary steps, plain Trajectory "
                "items) does not apply to tables made with pad_end_of_episode=True, which "
                "store Masked(step, mask) items and pad on their own; use one or the other"
            )
        return cls(
            sequence_length=int(sequence_length),
            tile=bool(tile_end_of_episodes),
            step=boundary_zeros(data_spec),
        )

    def count(self, episode_steps: int) -> int:
        """Padding steps to append after an episode of `episode_steps` steps (0 if empty)."""
        if episode_steps <= 0:
            return 0
        if self.tile:
            return self.sequence_length - 1
        return max(0, self.sequence_length - episode_steps)


def boundary_zeros(data_spec: Any) -> Any:
    """TF-Agents' padding step for `data_spec`: zeros everywhere, `step_type` LAST and
    `next_step_type` FIRST (`trajectory.boundary` of zeros, discount 0).

    Args:
      data_spec: A TF-Agents `Trajectory` spec (TF or `ArraySpec` leaves).

    Returns:
      A `Trajectory` of numpy arrays with the spec's shapes and dtypes.
    """
    spec = normalize_spec(data_spec)
    zeros = tree.map_structure(lambda s: np.zeros(s.shape, numpy_dtype(s)), spec)
    return zeros._replace(
        step_type=np.full(spec.step_type.shape, _LAST, numpy_dtype(spec.step_type)),
        next_step_type=np.full(spec.next_step_type.shape, _FIRST, numpy_dtype(spec.next_step_type)),
    )

"""What a buffer's collectors are built from (`CollectView`), and the two it hands out.

`ReplayBufferManager` gives each of its collector factories a `CollectView` of its buffer:
`observer` and `transition_writer` here, `hindsight.hindsight_writer`,
`gym_vector.gym_vector_writer` and `warm_up.fill` on top of them. Every collector made from a
view joins its `writers`, which the manager's `checkpoint()` flushes and `close()` closes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from replay_service.collect.observer import TrajectoryObserver
from replay_service.collect.transitions import TransitionWriter
from replay_service.config.options import TableConfig, Timeouts
from replay_service.specs.layouts import Layout


@dataclasses.dataclass(frozen=True)
class CollectView:
    """The parts of one buffer its collectors are built from.

    Attributes:
      require_client: Returns the client collectors write through (a Reverb client or the
        local backend's `LocalClient`); raises `BufferStateError` before the buffer is created
        or loaded and `ManagerClosedError` after `close()`.
      tables: The buffer's tables, the primary one first; every collector feeds all of them.
      data_spec: The per-step data spec.
      stride_length: A new item every `stride_length` steps.
      timeouts: `timeouts.write` bounds every wait for the server.
      layout: How the tables store steps.
      writers: The buffer's open collectors; each one made from this view is added.
    """

    require_client: Callable[[], Any]
    tables: tuple[TableConfig, ...]
    data_spec: Any
    stride_length: int
    timeouts: Timeouts
    layout: Layout
    writers: list[Any]

    def _targets(self) -> dict[str, Any]:
        """The arguments every collector of this buffer shares (the primary table's first)."""
        primary = self.tables[0]
        return {
            "client": self.require_client(),
            "table_name": primary.name,
            "sequence_length": primary.sequence_length,
            "data_spec": self.data_spec,
            "stride_length": self.stride_length,
            "timeouts": self.timeouts,
            "extra_tables": [(t.name, t.sequence_length) for t in self.tables[1:]],
            "pad_end_of_episode": primary.pad_end_of_episode,
            "layout": self.layout,
        }


def observer(
    view: CollectView, pad_end_of_episodes: bool = False, tile_end_of_episodes: bool = False
) -> TrajectoryObserver:
    """A new `TrajectoryObserver` writing to every table of the buffer.

    Args:
      view: The buffer.
      pad_end_of_episodes: TF-Agents' `ReverbAddTrajectoryObserver` option of that name (see
        `replay_service.collect.episode_padding`).
      tile_end_of_episodes: TF-Agents' option of that name (needs `pad_end_of_episodes`).

    Returns:
      The observer, added to `view.writers`.

    Raises:
      BufferStateError, ManagerClosedError: From `view.require_client`, first.
      ConfigError: If the padding flags are invalid (`EpisodePadding.build`).
    """
    made = TrajectoryObserver(
        **view._targets(),
        pad_end_of_episodes=pad_end_of_episodes,
        tile_end_of_episodes=tile_end_of_episodes,
    )
    view.writers.append(made)
    return made


def transition_writer(
    view: CollectView, *, priority: float = 1.0, check_continuity: bool = True
) -> TransitionWriter:
    """A new `TransitionWriter` writing the observer's items into every table of the buffer.

    Args:
      view: The buffer.
      priority: Initial priority of new items.
      check_continuity: Refuse a transition whose state is not the previous `next_state`.

    Returns:
      The writer, added to `view.writers`.

    Raises:
      BufferStateError, ManagerClosedError: From `view.require_client`, first.
      ConfigError: If `priority` is not a finite number >= 0.
    """
    made = TransitionWriter(**view._targets(), priority=priority, check_continuity=check_continuity)
    view.writers.append(made)
    return made

"""What a buffer's collectors are built from (`CollectView`), and the two it hands out.

`ReplayBufferManager` gives each of its collector factories a `CollectView` of its buffer:
`observer` and `transition_writer` here, `hindsight.hindsight_writer`,
`gym_vector.gym_vector_writer` and `warm_up.fill` on top of them. Every collector made from a
view joins its `Writers`, which the manager's `checkpoint()` flushes and `close()` closes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

from replay_service.collect.observer import TrajectoryObserver
from replay_service.collect.transitions import TransitionWriter
from replay_service.config.options import TableConfig, Timeouts
from replay_service.specs.layouts import Layout

_log = logging.getLogger(__name__)

_Writer = TypeVar("_Writer")


class Writers:
    """The open collectors (observers and writers) of one buffer, in the order they were made."""

    def __init__(self) -> None:
        self._open: list[Any] = []

    def add(self, writer: _Writer) -> _Writer:
        """Adds `writer` (flushed by `flush`, closed by `close_all`) and returns it."""
        self._open.append(writer)
        return writer

    def __iter__(self) -> Iterator[Any]:
        return iter(self._open)

    def flush(self) -> None:
        """Blocks until every collector's items are confirmed, each within its own timeout.

        Raises:
          WriteTimeoutError: If a collector's items are not confirmed in time.
        """
        for writer in self._open:
            writer.flush()

    def close_all(self) -> None:
        """Closes every collector and forgets them all; a collector whose close fails (a dead
        server) is logged and the others are closed still."""
        try:
            for writer in self._open:
                try:
                    writer.close()
                except Exception as e:  # a dead server must not prevent the rest of close()
                    _log.warning("observer close failed: %s", e)
        finally:
            self._open.clear()


class Tables(Protocol):
    """What describes a buffer's tables (its `Backend`)."""

    @property
    def tables(self) -> tuple[TableConfig, ...]:
        """The tables, the primary one first."""

    @property
    def layout(self) -> Layout:
        """How the tables store steps."""


@dataclasses.dataclass(frozen=True)
class CollectView:
    """The parts of one buffer its collectors are built from.

    Attributes:
      require_client: Returns the client collectors write through (a Reverb client or the
        local backend's `LocalClient`); raises `BufferStateError` before the buffer is created
        or loaded and `ManagerClosedError` after `close()`.
      described: The buffer's `tables` (every collector feeds all of them) and `layout`, as
        they are now (a remote server's layout is known once connected).
      data_spec: The per-step data spec.
      stride_length: A new item every `stride_length` steps.
      timeouts: `timeouts.write` bounds every wait for the server.
      writers: The buffer's open collectors; each one made from this view is added.
    """

    require_client: Callable[[], Any]
    described: Tables
    data_spec: Any
    stride_length: int
    timeouts: Timeouts
    writers: Writers

    @property
    def tables(self) -> tuple[TableConfig, ...]:
        """The buffer's tables, the primary one first."""
        return self.described.tables

    def _targets(self) -> dict[str, Any]:
        """The arguments every collector of this buffer shares (the primary table's first)."""
        client = self.require_client()
        primary = self.tables[0]
        return {
            "client": client,
            "table_name": primary.name,
            "sequence_length": primary.sequence_length,
            "data_spec": self.data_spec,
            "stride_length": self.stride_length,
            "timeouts": self.timeouts,
            "extra_tables": [(t.name, t.sequence_length) for t in self.tables[1:]],
            "pad_end_of_episode": primary.pad_end_of_episode,
            "layout": self.described.layout,
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
    return view.writers.add(made)


def transition_writer(
    view: CollectView, priority: float = 1.0, check_continuity: bool = True
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
    primary = view.tables[0]
    made = TransitionWriter(
        **view._targets(),
        priority=priority,
        check_continuity=check_continuity,
        frame_stack=primary.frame_stack,
        frame_axis=primary.frame_axis,
    )
    return view.writers.add(made)

"""A TF-Agents trajectory observer that writes fixed-length windows to a Reverb table.

It is a drop-in for `tf_agents.replay_buffers.reverb_utils.ReverbAddTrajectoryObserver` (same
windows: every `stride_length` steps, the last `sequence_length` steps of the current episode)
with what that observer lacks: every wait has a timeout, items are flushed as they accumulate and
on close, a wrongly shaped step fails at once with the field that is wrong, and a window never
spans two episodes.

Items are created by the writer the tables' client hands out (`collect.writing`): on Reverb a
`StructuredWriter` whose pattern and conditions are fixed up front (a nested table) or a packed
writer that cuts the same windows itself, so the per-step Python work is one `append`;
TF-Agents' observer slices the writer history and calls `create_item` in Python for every step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from replay_service.collect.episode_padding import EpisodePadding
from replay_service.collect.writing import TableWindows, WindowWriter, WritingClient
from replay_service.config.options import Timeouts, require_int, require_number, to_ms
from replay_service.errors import (
    ConfigError,
    ManagerClosedError,
    SpecMismatchError,
    WriteTimeoutError,
)
from replay_service.specs.layout_registry import as_layout
from replay_service.specs.layouts import NESTED, Layout
from replay_service.specs.nests import check_collect_spec, diff_value
from replay_service.specs.windows import Masked, padding_needed, padding_step, stored_spec

# Steps appended between waits for the server, which keeps unconfirmed items well below the
# ~50 at which Reverb warns; the wait lets the newest half stay in flight.
MAX_IN_FLIGHT_ITEMS = 32

# Collectors that append one step at a time wait for the server every `FLUSH_EVERY` steps, until
# at most `FLUSH_DOWN_TO` items are unconfirmed: never more than 48 are, below the 50 at which
# Reverb warns, and waiting often but briefly keeps the server busy while Python appends.
FLUSH_EVERY = 16
FLUSH_DOWN_TO = 32

LAST = 2  # TF-Agents' StepType.LAST


def flush_every(num_tables: int) -> int:
    """Steps between waits for a writer feeding `num_tables` tables (up to one item per table
    per step), so that no more than `FLUSH_DOWN_TO + FLUSH_EVERY` items are ever in flight."""
    return max(1, FLUSH_EVERY // max(1, num_tables))


@dataclasses.dataclass(frozen=True)
class WriteTarget:
    """What a collector writes to, shared by `TrajectoryObserver` and `TransitionWriter`: the
    tables' windows, how often to wait for the server, and padding.

    Attributes:
      client: Client of the tables, which hands out their writers (`collect.writing`): the
        manager's `py_client` (a Reverb backend's `BoundedClient`, the local backend's
        `LocalClient`).
      table_name: The primary table (named in errors).
      sequence_length: Steps per item.
      stride_length: A new item every `stride_length` steps.
      windows: Per table `(name, sequence_length, stride_length, priority, padded)`, the
        primary table first.
      data_spec: The per-step data spec.
      flush_every: Steps between waits for the server (`flush_every`).
      timeout_ms: Bound on every wait, in milliseconds (None: forever).
      pad_end_of_episode: Whether steps are `Masked` and episode ends padded.
      layout: How the tables store steps (the client's writer writes steps as it says).
    """

    client: WritingClient
    table_name: str
    sequence_length: int
    stride_length: int
    windows: list[TableWindows]
    data_spec: Any
    flush_every: int
    timeout_ms: int | None
    pad_end_of_episode: bool
    layout: Layout

    @classmethod
    def build(
        cls,
        client: WritingClient,
        table_name: str,
        sequence_length: int,
        data_spec: Any,
        *,
        stride_length: int,
        priority: float,
        timeouts: Timeouts | None,
        extra_tables: Sequence[tuple[str, int]],
        pad_end_of_episode: bool,
        layout: Layout | str = NESTED,
    ) -> WriteTarget:
        """Validates the lengths and describes the windows (arguments as `TrajectoryObserver`'s).

        Raises:
          ConfigError: If `client` hands out no writers (it is not a `WritingClient`),
            `sequence_length` or `stride_length` is not an integer in 1..`INT32_MAX` (bools
            are refused), `priority` is not a finite number >= 0, or `layout` is not a layout
            name.
        """
        if not isinstance(client, WritingClient):
            raise ConfigError(
                "client must be the client of a buffer's tables that hands out their writers "
                "(a collect.writing.WritingClient: the manager's py_client), got "
                f"{type(client).__name__} {client!r}"
            )
        require_int("sequence_length", sequence_length, 1)
        require_int("stride_length", stride_length, 1)
        require_number("priority", priority, 0)
        windows = [
            (name, length, stride_length, float(priority), pad_end_of_episode)
            for name, length in [(table_name, sequence_length), *extra_tables]
        ]
        return cls(
            client=client,
            table_name=table_name,
            sequence_length=sequence_length,
            stride_length=stride_length,
            windows=windows,
            data_spec=data_spec,
            flush_every=flush_every(len(windows)),
            timeout_ms=to_ms((timeouts or Timeouts()).write),
            pad_end_of_episode=pad_end_of_episode,
            layout=as_layout(layout, stored_spec(data_spec, pad_end_of_episode)),
        )

    def open_writer(self) -> WindowWriter:
        """A new writer of these windows, from the client (`WritingClient.window_writer`)."""
        return self.client.window_writer(self.windows, self.layout, timeout_ms=self.timeout_ms)

    def padding(self, num_steps: int) -> int:
        """Padding steps that end an episode of `num_steps` steps (0 unless padded)."""
        if not self.pad_end_of_episode:
            return 0
        return padding_needed(num_steps, self.sequence_length, self.stride_length)

    def wait(self, call: Callable[[], Any], timeout_ms: int | None = None) -> None:
        """Runs a blocking writer call (given `timeout_ms`, or the target's `timeout_ms`).

        Raises:
          WriteTimeoutError: If the server does not confirm in time, naming table and server.
        """
        try:
            call()
        except _deadline_errors() as e:
            waited = self.timeout_ms if timeout_ms is None else timeout_ms
            raise WriteTimeoutError(
                f"table {self.table_name!r}: written items were not confirmed within "
                f"{waited} ms; the server at {self.client.server_address!r} is down "
                "or its rate limiter blocks inserts (too few samples per insert)"
            ) from e


class TrajectoryObserver:
    """Writes overlapping windows of unbatched TF-Agents trajectories to one or more tables.

    Pass it in `observers=[...]` of `tf_agents.train.actor.Actor` or a `PyDriver`.

    Args:
      client: Client of the server holding the table.
      table_name: Table to write to.
      sequence_length: Steps per item; must equal the table's.
      data_spec: Per-step spec (e.g. `agent.collect_data_spec`).
      stride_length: A new item every `stride_length` steps (1: every window).
      priority: Initial priority of new items.
      timeouts: `timeouts.write` bounds every wait for the server.
      extra_tables: `(name, sequence_length)` of further tables on the same server that get
        the windows of the same steps.
      pad_end_of_episode: Write `Masked(step, mask)` steps and pad each episode's end (the
        tables must be padded too, with one sequence length; see `replay_service.specs.windows`).
      layout: The tables' storage layout, "nested" or "packed" (see `config.TableConfig`), or
        the `specs.layouts.Layout` it resolves to.
      pad_end_of_episodes: TF-Agents' `ReverbAddTrajectoryObserver` option of that name: at
        each episode's end append zero boundary steps and write the windows they complete
        (plain `Trajectory` items; see `replay_service.collect.episode_padding`).
      tile_end_of_episodes: TF-Agents' option of that name (needs `pad_end_of_episodes`).

    Raises:
      ConfigError: If `sequence_length` or `stride_length` is not an integer >= 1,
        `priority` not a finite number >= 0, the TF-Agents padding flags are invalid
        (`EpisodePadding.build`), or `layout` is not a layout name.
      SpecMismatchError: If `data_spec` is not a TF-Agents `Trajectory` spec.
    """

    def __init__(
        self,
        client: WritingClient,
        table_name: str,
        sequence_length: int,
        data_spec: Any,
        *,
        stride_length: int = 1,
        priority: float = 1.0,
        timeouts: Timeouts | None = None,
        extra_tables: Sequence[tuple[str, int]] = (),
        pad_end_of_episode: bool = False,
        layout: Layout | str = NESTED,
        pad_end_of_episodes: bool = False,
        tile_end_of_episodes: bool = False,
    ) -> None:
        check_collect_spec(data_spec, "TrajectoryObserver")
        self._tf_agents_padding = EpisodePadding.build(
            data_spec,
            sequence_length,
            pad_end_of_episodes,
            tile_end_of_episodes,
            masked_table=pad_end_of_episode,
        )
        self._target = target = WriteTarget.build(
            client,
            table_name,
            sequence_length,
            data_spec,
            stride_length=stride_length,
            priority=priority,
            timeouts=timeouts,
            extra_tables=extra_tables,
            pad_end_of_episode=pad_end_of_episode,
            layout=layout,
        )
        self._data_spec = data_spec
        self._pad = pad_end_of_episode
        self._flush_every = target.flush_every  # read on every step
        self._padding = padding_step(data_spec) if pad_end_of_episode else None
        self._episode_steps = 0
        self._writer: WindowWriter | None = None
        self._steps_since_flush = 0
        self._checked = False
        self._closed = False

    @property
    def py_client(self) -> WritingClient:
        """The client written through (TF-Agents observers expose the same)."""
        return self._target.client

    def __call__(self, trajectory: Any) -> None:
        """Appends one step; creates an item when a full window is available.

        Args:
          trajectory: One unbatched `Trajectory` (numpy arrays or eager tensors).

        Raises:
          SpecMismatchError: If the step does not match the data spec.
          WriteTimeoutError: If the server does not confirm items within the write timeout.
          ManagerClosedError: If the observer was closed.
        """
        writer = self._writer
        if writer is None:
            writer = self._open(trajectory)
        try:
            writer.append(Masked(trajectory, True) if self._pad else trajectory)
        except ValueError as e:
            self._raise_mismatch(trajectory, e)
        self._episode_steps += 1
        if trajectory.step_type == LAST and self._end_episode(confirm=False, pad=True):
            return  # (`is_boundary()`, without its tensor check)
        since_flush = self._steps_since_flush + 1
        if since_flush >= self._flush_every:
            self._target.wait(
                lambda: writer.flush(FLUSH_DOWN_TO, timeout_ms=self._target.timeout_ms)
            )
            since_flush = 0
        self._steps_since_flush = since_flush

    def flush(self, timeout_ms: int | None = None) -> None:
        """Blocks until every item written so far is confirmed by the server.

        Args:
          timeout_ms: Bound on the wait in milliseconds; None: the write timeout.

        Raises:
          WriteTimeoutError: If that takes longer than the bound (the items stay on their way
            to the server; the observer stays usable).
        """
        if self._writer is not None:
            wait_ms = self._target.timeout_ms if timeout_ms is None else timeout_ms
            self._target.wait(lambda: self._writer.flush(timeout_ms=wait_ms), wait_ms)
            self._steps_since_flush = 0

    def reset(self, write_cached_steps: bool = False) -> None:
        """Ends the current episode: its written items stay, pending steps start a new window.

        Args:
          write_cached_steps: As TF-Agents observers: with `pad_end_of_episodes`, pad the
            episode's end first (its windows are written); otherwise steps that do not fill a
            window are never written.
        """
        if self._writer is not None:
            self._end_episode(pad=bool(write_cached_steps))

    def close(self) -> None:
        """Flushes pending items and releases the writer. Idempotent.

        Raises:
          WriteTimeoutError: If pending items are not confirmed within the write timeout (the
            server is down); the observer is closed all the same and those items are lost.
        """
        if self._closed:
            return
        try:
            if self._writer is not None:
                self._end_episode()
        except Exception:
            if self._writer is not None:
                self._writer.abandon()
            raise
        finally:
            self._writer = None
            self._closed = True

    def __enter__(self) -> TrajectoryObserver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self, trajectory: Any) -> WindowWriter:
        """Checks the first step against the spec and creates the writer.

        Raises:
          ManagerClosedError: If the observer was closed.
          SpecMismatchError: If the step does not match the data spec.
        """
        if self._closed:
            raise ManagerClosedError("this observer is closed; get a new one from the manager")
        if not self._checked:
            self._check(trajectory)
        self._writer = self._target.open_writer()
        return self._writer

    def _end_episode(self, *, confirm: bool = True, pad: bool = False) -> bool:
        """Ends the episode (padding it first where the table pads).

        Args:
          pad: Append TF-Agents' padding steps first (with `pad_end_of_episodes`).
          confirm: Wait until the writer's items are confirmed (reset, close). False, at a
            boundary step: a writer that can end an episode without waiting
            (`WindowWriter.next_episode`) does, and its items stay counted for the periodic
            wait, which bounds them as within an episode.

        Returns:
          Whether every item written so far is confirmed.
        """
        writer = self._writer
        padding = self._target.padding(self._episode_steps)
        for _ in range(padding):
            writer.append(self._padding)
        tf_agents_padding = self._tf_agents_padding
        if pad and tf_agents_padding is not None:
            extra = tf_agents_padding.count(self._episode_steps)
            for _ in range(extra):
                writer.append(tf_agents_padding.step)
            padding += extra
        self._episode_steps = 0
        if not confirm and writer.next_episode():
            self._steps_since_flush += padding
            return False
        self._steps_since_flush = 0
        target = self._target
        target.wait(lambda: writer.end_episode(clear_buffers=True, timeout_ms=target.timeout_ms))
        return True

    def _check(self, trajectory: Any) -> None:
        problems = diff_value(trajectory, self._data_spec)
        if problems:
            raise SpecMismatchError(self._mismatch_message(problems))
        self._checked = True

    def _raise_mismatch(self, trajectory: Any, error: Exception) -> None:
        problems = diff_value(trajectory, self._data_spec) or [str(error)]
        raise SpecMismatchError(self._mismatch_message(problems)) from error

    def _mismatch_message(self, problems: list[str]) -> str:
        return (
            f"trajectory does not match the data spec of table {self._target.table_name!r} "
            "(the observer takes one unbatched step at a time): " + "; ".join(problems)
        )


def _deadline_errors() -> tuple[type[BaseException], ...]:
    """Reverb's write-timeout error, if Reverb is installed (the local backend never times
    out a write)."""
    try:
        import reverb
    except ImportError:
        return ()
    return (reverb.errors.DeadlineExceededError,)

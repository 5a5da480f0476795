"""What collectors write through: the writers a backend's client hands out.

A collector (`TrajectoryObserver`, `TransitionWriter`) never builds a backend's writer itself:
it asks the client of the buffer's tables (a `WritingClient`) for a `WindowWriter` of its
windows, appends steps to it and waits for it with a timeout. Implementations:

- the Reverb backend's `backends.reverb.bounded_client.BoundedClient` (the manager's
  `py_client`) and its `PackingClient` (a packed layout), whose writers are in
  `backends.reverb.layout_writers`; they also hand out the `ItemWriter` of an import;
- the local backend's `backends.local.client.LocalClient`, whose `LocalWindowWriter` inserts
  into its tables at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from replay_service.specs.layouts import Layout


class CheckedStep(list):
    """The flat leaves of one step that a collector has already cast: each of its subclasses
    (`checked_step_type`, one per collector's flattened spec) holds, at every position, a
    value of the same dtype and shape (an array or numpy scalar) in every step. A writer that
    checked one step of a subclass whole against its tables (`takes_checked_steps`) may take
    the others of that subclass as they are; any other writer sees a list. The collector makes
    a new list per step and never changes it afterwards."""

    __slots__ = ()


def checked_step_type() -> type[CheckedStep]:
    """A new `CheckedStep` subclass, for the steps of one flattened spec."""
    return type("PlanStep", (CheckedStep,), {"__slots__": ()})


TableWindows = tuple[str, int, int, float, bool]
"""One table's windows: `(name, sequence_length, stride_length, priority, padded)`; an item
every `stride_length` steps of the last `sequence_length` steps of the episode (padded tables:
windows starting at multiples of the stride, see `specs.windows`)."""


@runtime_checkable
class WindowWriter(Protocol):
    """Writes the steps of one episode at a time and inserts every window they complete."""

    def append(self, step: Any) -> None:
        """Appends one step (a nest shaped like the stored spec, or its flat leaves as a list).

        Raises:
          ValueError or SpecMismatchError: If the step does not match the stored spec.
        """

    def flush(self, block_until_num_items: int = 0, timeout_ms: int | None = None) -> None:
        """Waits until at most `block_until_num_items` written items are unconfirmed.

        Raises:
          reverb.errors.DeadlineExceededError: If that takes longer than `timeout_ms`.
        """

    def end_episode(self, clear_buffers: bool = True, timeout_ms: int | None = None) -> None:
        """Waits until every written item is confirmed, then ends the episode: the next step
        starts a new one (no window spans both).

        Raises:
          reverb.errors.DeadlineExceededError: If that takes longer than `timeout_ms`.
        """

    def next_episode(self) -> bool:
        """Ends the episode without waiting where the writer can (its items stay pending until
        a `flush`).

        Returns:
          True if the episode ended; False, having done nothing, if ending one means waiting
          (then call `end_episode`).
        """

    def abandon(self) -> None:
        """Gives the writer up without waiting for anything (its pending items are lost): what a
        collector does with a writer whose wait failed, so that nothing waits for it again."""


class ItemWriter(Protocol):
    """Writes whole items of consecutive steps (an import), with Reverb's `TrajectoryWriter`
    API; a context manager that closes the writer."""

    @property
    def history(self) -> Any:
        """The appended steps, per column (`history[column][-n:]`: the last `n` steps)."""

    def append(self, step: Any) -> None:
        """Appends one step: one value per stored column."""

    def create_item(self, table: str, priority: float, trajectory: Any) -> None:
        """Inserts the steps `trajectory` references (slices of `history`) as one item."""

    def flush(self, block_until_num_items: int = 0, timeout_ms: int | None = None) -> None:
        """Waits until at most `block_until_num_items` items are unconfirmed."""

    def end_episode(self, clear_buffers: bool = True, timeout_ms: int | None = None) -> None:
        """Waits until every item is confirmed and ends the episode."""

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> Any: ...


@runtime_checkable
class WritingClient(Protocol):
    """The client of a buffer's tables that collectors write through. A client whose
    `takes_checked_steps` is True (the local backend's) hands out writers that take
    `CheckedStep`s (see there); others are given plain lists."""

    @property
    def server_address(self) -> str:
        """Where the tables are ("host:port", or "local"), for error messages."""

    def window_writer(
        self, windows: Sequence[TableWindows], layout: Layout, *, timeout_ms: int | None
    ) -> WindowWriter:
        """A new writer of `windows`.

        Args:
          windows: The windows of every table written, the primary table first.
          layout: How the tables store steps (`layout.structure`: the stored step spec).
          timeout_ms: `Timeouts.write` in milliseconds (None: no limit): the longest a writer
            waits for its items where no caller gives a timeout (e.g. at interpreter exit).

        Raises:
          ConfigError or SpecMismatchError: If the tables cannot take these windows (named).
        """


@runtime_checkable
class ItemWritingClient(WritingClient, Protocol):
    """A `WritingClient` of a server that also takes whole items written one by one (an
    import, `backends.reverb.transfer.insert_items`): the Reverb clients."""

    def item_writer(self, layout: Layout, sequence_length: int) -> ItemWriter:
        """A new writer of whole items of `sequence_length` steps stored as `layout` says."""

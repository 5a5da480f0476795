"""A `reverb.Client` of a packed-layout server whose trajectory writers pack what they append.

A packed table stores each step as one `uint8` row (`replay_service.specs.packed`). Writers
that know nothing of it, such as TF-Agents' `ReverbAddTrajectoryObserver` and
`ReverbTrajectorySequenceObserver`, call `py_client.trajectory_writer(...)`, append nested steps
and create items from `writer.history` slices; Reverb 0.13's server stores whatever a writer
sends, so on a plain client their nested items would enter the packed table and fail only when
sampled. `PackingClient` is the client such writers are handed (`ReplayBufferManager.py_client`
and its TF-Agents replay buffer's `py_client` on a packed buffer): its `trajectory_writer`
packs every appended step into the table's row and turns each item the writer asks for into
the same window of rows, so those items are the ones this project's own observer writes. What
cannot be packed is refused at the writer with `SpecMismatchError` naming it: a step that does
not match the table's spec, an item that is not every field of the same consecutive steps,
an item whose length is not its table's sequence length, partial steps, and the legacy
`writer()`/`insert()`/`structured_writer()` calls (which write nested columns). As every client
the manager hands out it is a `bounded_client.BoundedClient`: its writers' `flush` and
`end_episode` (which TF-Agents' observers call without a timeout) raise `WriteTimeoutError` after
`Timeouts.write` instead of waiting forever for a dead server.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import reverb
import tree

from replay_service.backends.reverb.bounded_client import BoundedClient, WriteBound
from replay_service.backends.reverb.packed_writers import SentWriter
from replay_service.collect.writing import TableWindows, WindowWriter
from replay_service.config.options import Timeouts
from replay_service.errors import ConfigError, SpecMismatchError
from replay_service.specs.framed import FramedLayout
from replay_service.specs.layouts import Layout
from replay_service.specs.packed import PackedLayout, chunk_length

# The writer appends each row inside a one-element list: its column's path.
_ROW_PATH = (0,)


class _FieldHistory:
    """`writer.history` of one field: indexing it gives the same steps' rows, marked with
    the field (what `create_item` checks)."""

    __slots__ = ("_column", "_field")

    def __init__(self, column: Any, field: int) -> None:
        self._column = column
        self._field = field

    def __len__(self) -> int:
        return len(self._column)

    def __getitem__(self, index: Any) -> _FieldColumn:
        return _FieldColumn(self._column[index], self._field)


class _FieldColumn:
    """One field of a window of steps, as `history[...]` gives it."""

    __slots__ = ("column", "field")

    def __init__(self, column: Any, field: int) -> None:
        self.column = column
        self.field = field

    def __len__(self) -> int:
        return len(self.column)


class PackingTrajectoryWriter(SentWriter):
    """A Reverb `TrajectoryWriter`'s API over one packed column (see the module docstring).

    An item waits in its unfinished chunk (up to `MAX_CHUNK_LENGTH` steps) until the chunk
    fills or is flushed: as the packed writers of this project, the process's sender
    (`packed_writers.SentWriter`) flushes the writer's new items within `SEND_AFTER_S`, so
    that samplers, `num_frames()` and checkpoints see them mid-episode as a nested table's
    (whose chunks never outgrow the item) without the writer waiting.

    Args:
      writer: A Reverb `TrajectoryWriter` whose column `(0,)` is configured in constant chunks.
      layout: The tables' `PackedLayout`.
      lengths: Sequence length of each table of the server, by name.
      bound: The client's write timeout: `writer` (a `BoundedTrajectoryWriter`) bounds its
        `flush` and `end_episode` by it, and an unclosed writer's items are waited for at
        most that long at exit (`SentWriter.bound_waits`).
    """

    def __init__(
        self,
        writer: Any,
        layout: PackedLayout,
        lengths: Mapping[str, int],
        bound: WriteBound | None = None,
    ) -> None:
        self._layout = layout
        self._lengths = dict(lengths)
        self._structure: Any = None
        self._start_sending(writer)
        if bound is not None:
            self.bound_waits(bound.timeout_ms)

    def __enter__(self) -> PackingTrajectoryWriter:
        return self

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        self._writer.__exit__(exc_type, exc_value, traceback)

    @property
    def history(self) -> Any:
        """The appended steps, structured like them: each field's history, indexed as Reverb's
        (`history.observation[-2:]`), gives that field of those steps.

        Raises:
          RuntimeError: If nothing was appended yet (as Reverb's writer).
        """
        if self._structure is None:
            raise RuntimeError("history cannot be accessed before `append` is called once")
        column = self._writer.history[0]
        fields = [_FieldHistory(column, i) for i in range(len(self._layout.fields))]
        return tree.unflatten_as(self._structure, fields)

    @property
    def episode_steps(self) -> int:
        """Steps appended since the last `end_episode`."""
        return self._writer.episode_steps

    def append(self, data: Any, *, partial_step: bool = False) -> None:
        """Packs one whole step (a nest shaped like the table's step) and appends its row.

        Raises:
          SpecMismatchError: If `partial_step` is set or the step does not match the spec.
        """
        if partial_step:
            raise SpecMismatchError(
                "a layout='packed' table stores whole steps: append each step in one call "
                "(partial_step=True is not supported)"
            )
        leaves = tree.flatten(data)
        try:
            row = self._layout.encode_step([np.asarray(leaf) for leaf in leaves])
        except ValueError as error:
            raise SpecMismatchError(
                f"this step does not match the layout='packed' table's step spec: {error}"
            ) from None
        if self._structure is None:
            self._structure = data
        self._writer.append([row])

    def create_item(self, table: str, priority: float, trajectory: Any) -> None:
        """Inserts the rows of the steps `trajectory` takes every field of, as one item.

        Raises:
          SpecMismatchError: If `table` is not a table of the server, `trajectory` is not every
            field (once, in order) of the same steps, or its length is not the table's sequence
            length.
        """
        if table not in self._lengths:
            raise SpecMismatchError(
                f"no table {table!r} on this server; its tables: {sorted(self._lengths)}"
            )
        flat = tree.flatten(trajectory)
        if not all(isinstance(leaf, _FieldColumn) for leaf in flat):
            raise SpecMismatchError(
                "a layout='packed' table's items must be built from this writer's `history`; "
                f"got {trajectory!r}"
            )
        fields = [leaf.field for leaf in flat]
        if fields != list(range(len(self._layout.fields))):
            paths = [self._layout.fields[i].path for i in fields]
            raise SpecMismatchError(
                f"table {table!r} stores whole steps (layout='packed'): an item takes every field "
                f"of its steps once, in order; this one takes {paths}"
            )
        first = list(flat[0].column)
        if any(
            len(refs) != len(first) or any(a is not b for a, b in zip(refs, first, strict=True))
            for refs in (list(leaf.column) for leaf in flat[1:])
        ):
            raise SpecMismatchError(
                f"table {table!r} stores whole steps (layout='packed'): every field of an item "
                "must come from the same steps"
            )
        column = flat[0].column
        length = self._lengths[table]
        if column.is_squeezed or len(first) != length:
            got = "one squeezed step" if column.is_squeezed else f"{len(first)} steps"
            raise SpecMismatchError(
                f"table {table!r} holds items of sequence_length={length} steps; this item has "
                f"{got}"
            )
        self._writer.create_item(table, priority, column)
        self._unsent = True

    def flush(self, block_until_num_items: int = 0, timeout_ms: int | None = None) -> None:
        """Reverb's `flush`: waits until at most `block_until_num_items` items are pending.

        Raises:
          WriteTimeoutError: If `timeout_ms` is None and that takes longer than the client's
            `Timeouts.write` (the server is gone or its rate limiter blocks inserts).
          reverb.errors.DeadlineExceededError: If it takes longer than `timeout_ms`.
        """
        self._writer.flush(block_until_num_items, timeout_ms=timeout_ms)

    def end_episode(self, clear_buffers: bool = True, timeout_ms: int | None = None) -> None:
        """Reverb's `end_episode`: flushes, and clears the history if `clear_buffers`.

        Raises:
          WriteTimeoutError: If `timeout_ms` is None and the flush takes longer than the
            client's `Timeouts.write`.
          reverb.errors.DeadlineExceededError: If it takes longer than `timeout_ms`.
        """
        self._writer.end_episode(clear_buffers, timeout_ms=timeout_ms)


def _reconnect(
    address: str, layout: PackedLayout, lengths: Mapping[str, int], timeouts: Timeouts
) -> PackingClient:
    return PackingClient(reverb.Client(address), layout, lengths, timeouts)


class PackingClient(BoundedClient):
    """A `reverb.Client` (sharing `client`'s connection) whose trajectory writers pack, and
    whose blocking calls are bounded by `timeouts` (`bounded_client.BoundedClient`).

    Args:
      client: The client of the packed-layout server.
      layout: Its tables' `PackedLayout`.
      lengths: Sequence length of each table of the server, by name.
      timeouts: The manager's `Timeouts` (`timeouts.write` bounds the writers' waits).
    """

    def __init__(
        self,
        client: reverb.Client,
        layout: PackedLayout,
        lengths: Mapping[str, int],
        timeouts: Timeouts | None = None,
    ) -> None:
        super().__init__(client, timeouts or Timeouts())
        self._layout = layout
        self._lengths = dict(lengths)

    @property
    def layout(self) -> PackedLayout:
        """The tables' layout: `layout.unpack(rows)` reads what `sample` returns."""
        return self._layout

    def __reduce__(self) -> Any:
        return _reconnect, (self._server_address, self._layout, self._lengths, self._timeouts)

    def __repr__(self) -> str:
        return f"PackingClient, server_address={self._server_address}"

    def trajectory_writer(
        self, num_keep_alive_refs: int, *, validate_items: bool = True
    ) -> PackingTrajectoryWriter:
        """A writer with Reverb's `TrajectoryWriter` API that packs each appended step.

        Args:
          num_keep_alive_refs: Steps the history keeps (at least; the packed column's chunk
            length may keep more).
          validate_items: Ignored: every item is checked against its table here.

        Raises:
          ValueError: If `num_keep_alive_refs` < 1 (as Reverb).
          ConfigError: On a frame-stacked buffer (`specs.framed`): its rows hold one frame.
        """
        del validate_items
        if isinstance(self._layout, FramedLayout):
            raise ConfigError(
                f"frame_stack={self._layout.frame_stack}: trajectory_writer() of a "
                "frame-stacked buffer's py_client would write whole stacks; write with the "
                "manager's observer(), transition_writer() or writers (one frame per step)"
            )
        if num_keep_alive_refs < 1:
            raise ValueError(
                f"num_keep_alive_refs ({num_keep_alive_refs}) must be a positive integer"
            )
        chunk = chunk_length(self._layout.step_bytes)
        keep = max(chunk, int(num_keep_alive_refs))
        writer = super().trajectory_writer(keep, validate_items=False)
        writer.configure(_ROW_PATH, num_keep_alive_refs=keep, max_chunk_length=chunk)
        return PackingTrajectoryWriter(writer, self._layout, self._lengths, self._bound)

    def window_writer(
        self, windows: Sequence[TableWindows], layout: Layout, *, timeout_ms: int | None
    ) -> WindowWriter:
        """A collector's writer of `windows`: a `PackedWindowWriter` (`BoundedClient`'s).

        Raises:
          SpecMismatchError: If `layout` is not packed (a nested writer's StructuredWriter
            writes one column per field).
        """
        if not isinstance(layout, PackedLayout):
            raise self._refuse("Client.structured_writer()")
        return super().window_writer(windows, layout, timeout_ms=timeout_ms)

    def _refuse(self, call: str) -> SpecMismatchError:
        return SpecMismatchError(
            f"{call} writes one column per field, which a layout='packed' table cannot read; "
            "write with trajectory_writer() (it packs), the manager's observer() or its writers"
        )

    def writer(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: the legacy writer writes nested columns.

        Raises:
          SpecMismatchError: Always.
        """
        raise self._refuse("Client.writer()")

    def insert(self, data: Any, priorities: dict[str, float]) -> None:
        """Refused: `insert` writes nested columns.

        Raises:
          SpecMismatchError: Always.
        """
        raise self._refuse("Client.insert()")

    def structured_writer(self, configs: Any) -> Any:
        """Refused: StructuredWriter configs name nested columns.

        Raises:
          SpecMismatchError: Always.
        """
        raise self._refuse("Client.structured_writer()")

"""The Reverb writers of each layout: what the Reverb clients hand collectors and imports.

- `window_writer`: the writer of a collector's windows (a `collect.writing.WindowWriter`): for a
  nested table Reverb's `StructuredWriter` of `window_configs` (one config per table), as a
  `StructuredWindowWriter`; for a packed one a `packed_writers.PackedWindowWriter`, which cuts
  the same windows itself.
- `item_writer`: a Reverb `TrajectoryWriter` of whole items (an import), chunked as the layout
  says (`Layout.writer_chunking`).

`bounded_client.BoundedClient` (and so `PackingClient`) opens them on its plain client: these
writers are given a timeout at every wait.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tree
from reverb import structured_writer as sw

from replay_service.backends.reverb.framed_writers import FramedWindowWriter
from replay_service.backends.reverb.internals import abandon_writer
from replay_service.backends.reverb.packed_writers import PackedWindowWriter, SentWriter
from replay_service.collect.writing import TableWindows, WindowWriter
from replay_service.specs.framed import FramedLayout
from replay_service.specs.layouts import Layout
from replay_service.specs.packed import PackedLayout


def last_steps_config(
    step_spec: Any, table_name: str, sequence_length: int, when: Any, priority: float
) -> Any:
    """A `StructuredWriter` config inserting the last `sequence_length` steps of the episode
    into `table_name`, at each step from the `sequence_length`-th on where `when` holds.

    Args:
      step_spec: Spec of one appended step (its structure is what the writer indexes).
      table_name: Table to insert into.
      sequence_length: Steps per item.
      when: A `structured_writer.Condition` on the step.
      priority: Priority of every item.

    Returns:
      The config.
    """
    structure = tree.map_structure(lambda _: None, step_spec)
    pattern = sw.pattern_from_transform(
        structure, lambda step: tree.map_structure(lambda c: c[-sequence_length:], step)
    )
    return sw.create_config(
        pattern,
        table_name,
        conditions=[sw.Condition.step_index() >= sequence_length - 1, when],
        priority=sw.constant_priority_fn(priority),
    )


def window_config(
    step_spec: Any,
    table_name: str,
    sequence_length: int,
    stride_length: int,
    priority: float,
    padded: bool = False,
) -> Any:
    """The `StructuredWriter` config that inserts the last `sequence_length` steps of an episode
    into `table_name` every `stride_length` steps; for a padded table (`specs.windows`), every
    window starting at a multiple of `stride_length`.

    Args:
      step_spec: Spec of one appended step (the stored spec: `Masked` steps if padded).
      table_name: Table to insert into.
      sequence_length: Steps per item.
      stride_length: Steps between items.
      priority: Priority of every item.
      padded: Whether the table is padded.

    Returns:
      The config.
    """
    if padded:
        when = sw.Condition.step_index() % stride_length == (sequence_length - 1) % stride_length
    else:
        when = sw.Condition.steps_since_applied() >= stride_length
    return last_steps_config(step_spec, table_name, sequence_length, when, priority)


def window_configs(step_spec: Any, windows: Sequence[TableWindows]) -> list[Any]:
    """One `StructuredWriter` config per window (`window_config`): a single `StructuredWriter`
    given this list feeds every table with the windows of the same steps, each table with its
    own window length.

    Args:
      step_spec: Spec of one appended step (the stored spec).
      windows: Per table `(name, sequence_length, stride_length, priority, padded)`.

    Returns:
      The configs, in the order of `windows`.
    """
    return [window_config(step_spec, *window) for window in windows]


class StructuredWindowWriter:
    """Reverb's `StructuredWriter` of a nested table's windows, as a collector's
    `WindowWriter`.

    Args:
      writer: The `StructuredWriter` of `window_configs`.
    """

    def __init__(self, writer: Any) -> None:
        self._writer = writer

    def append(self, step: Any) -> None:
        """Appends one step (a nest, or its flat leaves as a list); Reverb inserts the windows
        it completes.

        Raises:
          ValueError: If the step does not match the configs' structure (as Reverb).
        """
        self._writer.append(step)

    def flush(self, block_until_num_items: int = 0, timeout_ms: int | None = None) -> None:
        """Reverb's `flush`: waits until at most `block_until_num_items` items are pending.

        Raises:
          reverb.errors.DeadlineExceededError: If that takes longer than `timeout_ms`.
        """
        self._writer.flush(block_until_num_items, timeout_ms=timeout_ms)

    def end_episode(self, clear_buffers: bool = True, timeout_ms: int | None = None) -> None:
        """Reverb's `end_episode`: waits until every item is confirmed, then ends the episode.

        Raises:
          reverb.errors.DeadlineExceededError: If that takes longer than `timeout_ms`.
        """
        self._writer.end_episode(clear_buffers, timeout_ms=timeout_ms)

    def next_episode(self) -> bool:
        """False: Reverb ends a structured writer's episode only by waiting (`end_episode`)."""
        return False

    def abandon(self) -> None:
        """Keeps Reverb's writer alive until the process exits (its pending items are lost), so
        that its destructor, which waits without a timeout, never runs
        (`internals.abandon_writer`)."""
        abandon_writer(self._writer)


def window_writer(
    client: Any, windows: Sequence[TableWindows], layout: Layout, timeout_ms: int | None
) -> WindowWriter:
    """The writer of `windows` for tables of `layout` (see the module docstring).

    Args:
      client: A plain `reverb.Client` (the writers pass a timeout at every wait).
      windows: Per table `(name, sequence_length, stride_length, priority, padded)`.
      layout: How the tables store steps.
      timeout_ms: `Timeouts.write`: the longest a packed writer that is never closed waits for
        its items at interpreter exit (`SentWriter.bound_waits`).

    Returns:
      A `StructuredWindowWriter` (nested), a `PackedWindowWriter` (packed) or a
      `FramedWindowWriter` (packed, `frame_stack`).

    Raises:
      ValueError: If the configs are invalid (as Reverb).
    """
    if isinstance(layout, FramedLayout):
        writer: SentWriter = FramedWindowWriter(client, windows, layout)
        writer.bound_waits(timeout_ms)
        return writer
    if isinstance(layout, PackedLayout):
        writer = PackedWindowWriter(client, windows, layout)
        writer.bound_waits(timeout_ms)
        return writer
    return StructuredWindowWriter(
        client.structured_writer(window_configs(layout.structure, windows))
    )


def item_writer(client: Any, layout: Layout, sequence_length: int) -> Any:
    """A Reverb `TrajectoryWriter` of whole items of `sequence_length` steps of `layout`, kept
    alive and chunked as `layout.writer_chunking` says (a packed column in constant chunks).

    Args:
      client: A plain `reverb.Client` (the packed writer appends the rows it is given).
      layout: How the table stores steps.
      sequence_length: Steps per item.

    Returns:
      The writer (Reverb's `TrajectoryWriter` API).
    """
    keep, chunk = layout.writer_chunking(sequence_length)
    writer = client.trajectory_writer(num_keep_alive_refs=keep)
    if isinstance(layout, PackedLayout):
        writer.configure((0,), num_keep_alive_refs=keep, max_chunk_length=chunk)
    return writer

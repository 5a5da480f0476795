"""The local tables' client: the calls collectors and priority updates make on a Reverb client.

`LocalClient` gives the collectors (`TrajectoryObserver`, `TransitionWriter`) the few calls
they make on a Reverb client, on the tables of a `LocalBackend`, and `LocalWindowWriter` cuts
the same windows as Reverb's structured writer configs do.
"""

from __future__ import annotations

import math
import types
from collections.abc import Sequence
from typing import Any

import numpy as np
import tree

from replay_service.backends.local.table import LocalTable
from replay_service.collect.writing import CheckedStep, TableWindows
from replay_service.errors import ConfigError, SpecMismatchError
from replay_service.sample.priorities import check_updates
from replay_service.specs.layouts import Layout

LOCAL_ADDRESS = "local"


class Window:
    """One table's windows: the last `sequence_length` steps of an episode, every
    `stride_length` steps (padded tables: windows starting at multiples of the stride).

    Attributes:
      table: The table the windows go into.
      sequence_length: Steps per item.
      stride_length: Steps between the ends of consecutive items.
      priority: Priority of every item.
      padded: The table stores `Masked` steps and windows start at multiples of the stride.
    """

    __slots__ = ("padded", "priority", "sequence_length", "stream", "stride_length", "table")

    def __init__(
        self,
        table: LocalTable,
        sequence_length: int,
        stride_length: int,
        priority: float,
        padded: bool,
    ) -> None:
        if sequence_length != table.config.sequence_length:
            raise ConfigError(
                f"table {table.name!r} holds items of {table.config.sequence_length} steps, "
                f"a writer asked for {sequence_length}"
            )
        self.table = table
        self.sequence_length = sequence_length
        self.stride_length = stride_length
        self.priority = priority
        self.padded = padded
        self.stream = table.stream()  # the steps this writer stored in the table


class LocalWindowWriter:
    """Appends steps of one episode at a time and inserts windows into local tables.

    A collector's `collect.writing.WindowWriter`, with the items of Reverb's `StructuredWriter`
    configs: for an unpadded table, at step index
    `i >= sequence_length - 1` when at least `stride_length` steps passed since its last item;
    for a padded one, when `i % stride_length == (sequence_length - 1) % stride_length`.

    Args:
      windows: One `Window` per table.
    """

    def __init__(self, windows: Sequence[Window]) -> None:
        self._windows = list(windows)
        fields = self._windows[0].table.fields
        self._fields = [
            (str(f["path"]), np.dtype(f["dtype"]), tuple(int(d) for d in f["shape"]))
            for f in fields
        ]
        self._history: list[list[np.ndarray]] = []
        self._since = [0] * len(self._windows)
        self._step_index = -1
        self._longest = max(w.sequence_length for w in self._windows)
        # A writer of one unpadded table at stride 1 (a collector's usual one): its windows'
        # bookkeeping without the loop over tables (`_store`).
        only = self._windows[0]
        self._single = (
            only
            if len(self._windows) == 1 and not only.padded and only.stride_length == 1
            else None
        )
        self._frames = self._windows[0].table.frames  # stacked observations: checked
        # Named by the frames' errors, as the Reverb writers and `TransitionWriter` name it.
        self._where = (
            f"table {self._windows[0].table.name!r}"
            if self._frames is None
            else f"table {self._windows[0].table.name!r} (frame_stack={self._frames.k})"
        )
        self._exact = [(dtype.type, dtype, shape) for _, dtype, shape in self._fields]
        # Stacks along axis 0: each step's stack is kept as one byte copy (`_store`), the
        # history's array over it and the bytes the next stack's first K-1 frames are compared
        # with in place; `_previous` is the episode's previous stack's copy (None: none yet).
        self._framed = self._frames is not None and self._frames.axis == 0
        # A host ring's writer keeps a stack that is a read-only array over a `bytes` object
        # of its size (`TransitionWriter` hands its continuity copy so) as it is: it cannot
        # change. A device ring's takes writable copies (`torch.as_tensor`).
        self._keeps_bytes = self._framed and self._windows[0].table.on_host
        self._previous: bytes | bytearray | None = None
        if self._frames is not None:
            field = self._frames.field
            _, dtype, shape = self._fields[field]
            self._stack = (dtype, shape)
            self._frame_bytes = dtype.itemsize * math.prod(shape) // self._frames.k
            self._field = field
            self._others = [i for i in range(len(self._fields)) if i != field]
            self._earlier = (self._frames.k - 1) * self._frames.channels  # frames 0..K-2
        # The `CheckedStep` subclass of the step last checked whole: its others are taken as
        # they are.
        self._checked: type | None = None

    def append(self, step: Any) -> None:
        """Appends one step (a nest, or the flat list of its leaves); inserts due windows.

        Raises:
          SpecMismatchError: If the step has the wrong number of fields, or a field the wrong
            shape or a value that does not convert to its dtype (naming the field).
        """
        step_kind = type(step)
        if step_kind is self._checked:  # a step of a kind whose first step was checked whole
            self._store(step)
            return
        checked = isinstance(step, CheckedStep)
        leaves = step if step_kind is list or checked else tree.flatten(step)
        fields = self._fields
        if len(leaves) != len(fields):
            raise SpecMismatchError(
                f"a step has {len(leaves)} fields, the table stores {len(fields)} "
                f"({[path for path, _, _ in fields]})"
            )
        # What the collectors' fast paths hand over: arrays or numpy scalars of the fields'
        # dtypes and shapes, taken as they are.
        for value, (kind, dtype, shape) in zip(leaves, self._exact):  # noqa: B905
            if (
                (type(value) is np.ndarray or type(value) is kind)
                and (value.dtype is dtype or value.dtype == dtype)
                and value.shape == shape
            ):
                continue
            break
        else:
            if checked:  # its kind's other steps have the same dtypes and shapes
                self._checked = step_kind
            self._store(list(leaves))
            return
        arrays = []
        for value, (path, dtype, shape) in zip(leaves, fields, strict=True):
            if type(value) is np.ndarray and value.dtype == dtype and value.shape == shape:
                arrays.append(value)
                continue
            try:
                array = np.asarray(value, dtype=dtype)
            except (TypeError, ValueError) as e:
                raise SpecMismatchError(f"field {path!r}: {value!r} is not {dtype}: {e}") from e
            if array.shape != shape:
                raise SpecMismatchError(
                    f"field {path!r}: expected shape {list(shape)}, got {list(array.shape)}"
                )
            arrays.append(array)
        self._store(arrays)

    def _store(self, arrays: list[np.ndarray]) -> None:
        """`append` of a step whose fields are checked and converted: checks its frames and
        inserts the due windows.

        The step is kept as copies of its arrays: a caller may fill the same array in place
        for its next step (a vectorised environment's observation, a torch tensor's memory),
        and the step waits in the history until its windows are written (an episode's first
        step until the second is appended; any step whose window cannot share its steps)."""
        history = self._history
        frames = self._frames
        if self._framed:
            assert frames is not None
            kept = list(arrays)
            for index in self._others:
                value = kept[index]
                if type(value) is np.ndarray:
                    kept[index] = value.copy()
            field = frames.field
            stack = kept[field]
            raw: bytes | bytearray | None = stack.base
            if (
                type(raw) is not bytes
                or not self._keeps_bytes
                or stack.flags.writeable
                or not stack.flags.c_contiguous
                or len(raw) != stack.nbytes
            ):
                raw = bytearray(stack if stack.flags.c_contiguous else np.ascontiguousarray(stack))
                dtype, shape = self._stack
                stack = kept[field] = np.ndarray(shape, dtype, raw)
            previous = self._previous
            # The common case: the stack follows the previous one (`FrameStack.check_step`'s
            # first comparison, the previous copy's bytes read in place).
            if previous is None or not previous.startswith(
                stack[: self._earlier], self._frame_bytes
            ):
                frames.check_step(
                    stack,
                    history[-1][field] if history else None,
                    self._step_index + 1,
                    self._where,
                )
            self._previous = raw
            arrays = kept
        else:
            arrays = [value.copy() if type(value) is np.ndarray else value for value in arrays]
            if frames is not None:
                field = frames.field
                frames.check_step(
                    arrays[field],
                    history[-1][field] if history else None,
                    self._step_index + 1,
                    self._where,
                )
        history.append(arrays)
        if len(history) > self._longest:
            del history[0]
        index = self._step_index = self._step_index + 1
        since = self._since
        single = self._single
        if single is not None:  # one table, every window: each step from the first full one
            since[0] += 1
            length = single.sequence_length
            if index >= length - 1:
                fresh = since[0]
                since[0] = 0
                single.table.insert_window(history[-length:], single.priority, single.stream, fresh)
            return
        for position, window in enumerate(self._windows):
            since[position] += 1
            length = window.sequence_length
            if index < length - 1:
                continue
            if window.padded:
                due = index % window.stride_length == (length - 1) % window.stride_length
            else:
                due = since[position] >= window.stride_length
            if due:
                fresh = since[position]
                since[position] = 0
                window.table.insert_window(history[-length:], window.priority, window.stream, fresh)

    def stacked_path(self) -> Any:
        """`append_stacked`, where this writer takes a transition writer's steps straight: one
        unpadded table at stride 1 in host memory, stacks along axis 0; else None. Its caller
        need not count steps for `flush`, which never waits."""
        if self._single is None or not self._keeps_bytes:
            return None
        return self.append_stacked

    def append_stacked(self, step: list[Any], buffer: bytearray) -> None:
        """`append` of a transition writer's step within an episode (`stacked_path`): its
        fields of the table's dtypes and shapes, none the caller's array, its stack a
        read-only C-contiguous array over `buffer`, which the writer fills again only once the
        step left the history (`TransitionWriter._keep_next`): the step keeps it as it is. Its
        window goes straight to the ring where it continues the writer's previous item
        (`LocalTable.insert_next`).

        Raises:
          SpecMismatchError: If the stack does not follow the previous one (`_store`'s check,
            naming the step); nothing is changed then.
        """
        stack = step[self._field]
        previous = self._previous
        # `FrameStack.check_step`'s first comparison, as in `_store`; anything else is
        # checked (and refused or kept as a copy) there.
        if previous is None or not previous.startswith(stack[: self._earlier], self._frame_bytes):
            self._store(step)
            return
        history = self._history
        history.append(step)
        if len(history) > self._longest:
            del history[0]
        self._previous = buffer
        index = self._step_index = self._step_index + 1
        single = self._single
        assert single is not None
        since = self._since
        since[0] += 1
        length = single.sequence_length
        if index >= length - 1:
            fresh = since[0]
            since[0] = 0
            table = single.table
            if fresh != 1 or table.insert_next(step, single.priority, single.stream) is None:
                table.insert_window(history[-length:], single.priority, single.stream, fresh)

    def flush(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to wait for: items are in the table once `append` returns."""

    def end_episode(self, clear_buffers: bool = True, timeout_ms: int | None = None) -> None:
        """Ends the episode: the next step starts new windows."""
        del clear_buffers, timeout_ms
        self._history = []
        self._previous = None
        self._since = [0] * len(self._windows)
        self._step_index = -1
        for window in self._windows:
            window.stream.reset()

    def next_episode(self) -> bool:
        """False: `end_episode` ends the episode (it never waits)."""
        return False

    def abandon(self) -> None:
        """Nothing to give up: nothing is pending."""

    def close(self) -> None:
        """Nothing to release."""


class LocalClient:
    """The calls of a Reverb client that collectors and priority updates make, on local tables.

    Args:
      tables: The buffer's tables by name.
    """

    server_address = LOCAL_ADDRESS
    takes_checked_steps = True  # its writers take a `CheckedStep` as it is once one is checked

    def __init__(self, tables: dict[str, LocalTable]) -> None:
        self.tables = tables

    def window_writer(
        self,
        windows: Sequence[TableWindows],
        layout: Layout | None = None,
        *,
        timeout_ms: int | None = None,
    ) -> LocalWindowWriter:
        """A writer of `(table, sequence_length, stride_length, priority, padded)` windows
        (`collect.writing.WritingClient`).

        Args:
          windows: The windows of every table written.
          layout: Not read: local tables store the step nest (`LocalWindowWriter` checks each
            step against their fields).
          timeout_ms: Not read: items are in the table once `append` returns.

        Raises:
          ConfigError: If a table is unknown or holds items of another length.
        """
        del layout, timeout_ms
        return LocalWindowWriter(
            [Window(self.table(name), *rest) for name, *rest in windows]  # type: ignore[arg-type]
        )

    def table(self, name: str) -> LocalTable:
        """The table `name`.

        Raises:
          ConfigError: If there is none.
        """
        try:
            return self.tables[name]
        except KeyError:
            raise ConfigError(
                f"the local buffer has no table {name!r}; its tables are {sorted(self.tables)}"
            ) from None

    def reset(self, table: str) -> None:
        """Removes every item of `table`."""
        self.table(table).reset()

    def server_info(self, timeout: int | None = None) -> dict[str, Any]:
        """Per table, the fields of Reverb's `TableInfo` that `stats` and `num_frames` read."""
        del timeout
        return {name: _table_info(table) for name, table in self.tables.items()}

    def mutate_priorities(
        self, table: str, updates: dict[int, float] | None = None, deletes: Any = None
    ) -> None:
        """Sets priorities by item key, as `reverb.Client.mutate_priorities` through the Reverb
        backend's `BoundedClient`: the batch is checked whole first, keys of items no longer
        held (or of another table) are ignored.

        Args:
          table: Name of the table.
          updates: Item key -> new priority.
          deletes: Unsupported (must be empty).

        Raises:
          ConfigError: If `table` is unknown, `deletes` is given, or a priority is NaN,
            infinite, negative or not a real number (`priorities.check_updates`).
          SpecMismatchError: If a key is not an integer in [0, 2**64).
        """
        if deletes:
            raise ConfigError("deleting items by key is not supported by the local backend")
        checked = check_updates(updates)
        self.table(table).update_priorities(checked)


def _table_info(table: LocalTable) -> Any:
    """A `TableInfo`-shaped view of a local table (no rate limiter beyond its minimum size)."""
    ns = types.SimpleNamespace
    return ns(
        name=table.name,
        max_size=table.config.capacity,
        current_size=table.size,
        signature=None,
        rate_limiter_info=ns(
            samples_per_insert=1.0,
            min_diff=-float("inf"),
            max_diff=float("inf"),
            min_size_to_sample=table.config.sampling.min_size_to_sample,
            insert_stats=ns(completed=table.inserts),
            sample_stats=ns(completed=table.samples),
        ),
        table_worker_time=ns(waiting_for_sampling_ms=0, waiting_for_inserts_ms=0),
    )

"""The packed storage layout: every field of a step in one `uint8` row.

A table of the default "nested" layout stores one Reverb column per field of the step (its
signature is the data spec with a leading time dimension). A "packed" table stores one column:
each step is the bytes of all its fields, in `tree.flatten` order of the stored step (the
`Trajectory` fields; for a padded table `Masked(step, mask)`, the mask last), each field's
values in C order and native byte order. The table signature is `uint8[sequence_length,
step_bytes]`.

Why: Reverb's cost per stored step is mostly per column and per chunk, not per byte. One column
written in chunks of up to `MAX_CHUNK_LENGTH` steps (instead of the StructuredWriter's
auto-tuned chunks, which never grow beyond the sequence length) cuts the server's memory per
CartPole step several times and makes inserts cheaper (one cell per step).

Reading: `unpack(array, data_spec)` turns a `uint8[..., step_bytes]` array (numpy) back into
the nest; `PackedLayout.unpack_tf` does the same in a tf.data pipeline (a slice, `tf.bitcast`
and reshape per field). Every reader of this project (`get_dataset`, `as_dataset`, torch,
export, checkpoints) unpacks, so their items are the same in both layouts.

`PackedLayout` is the packed implementation of `replay_service.specs.layouts.Layout`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tree

from replay_service.specs.layouts import (
    PACKED,
    Layout,
    resolve_layout,
    steps_of,
)
from replay_service.specs.nests import flatten_with_paths, numpy_dtype

# Constant chunk length of a packed column, bounded so that a chunk holds about
# `CHUNK_BYTES` (a sample transfers whole chunks: long chunks of big steps cost bandwidth).
MAX_CHUNK_LENGTH = 64
CHUNK_BYTES = 8192


def chunk_length(step_bytes: int) -> int:
    """The constant chunk length of a packed column of `step_bytes` per step: as many steps
    as fit in `CHUNK_BYTES`, between 1 and `MAX_CHUNK_LENGTH` (a window may span several
    chunks)."""
    return max(1, min(MAX_CHUNK_LENGTH, CHUNK_BYTES // max(1, step_bytes)))


_NUMPY = (np.ndarray, np.generic)


class _Field:
    __slots__ = ("dtype", "nbytes", "path", "shape", "size", "start", "stop")

    def __init__(self, path: str, spec: Any, start: int) -> None:
        self.path = path
        self.dtype = np.dtype(numpy_dtype(spec)).newbyteorder("=")
        self.shape = tuple(int(d) for d in spec.shape)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self.nbytes = self.size * self.dtype.itemsize
        self.start = start
        self.stop = start + self.nbytes


class PackedLayout(Layout):
    """How the steps of a packed table are laid out: the "packed" `Layout`.

    Args:
      stored_spec: The per-step spec the table stores (`data_spec`, or `Masked(data_spec,
        mask)` for padded tables); TF specs or `ArraySpec`.

    Attributes:
      structure: `stored_spec`.
      fields: Per leaf (`tree.flatten` order): path, dtype, shape and byte range in a row.
      step_bytes: Bytes of one packed step.
    """

    name = PACKED
    reverb_only = True

    def __init__(self, stored_spec: Any) -> None:
        super().__init__(stored_spec)
        self.fields: list[_Field] = []
        offset = 0
        for path, leaf in flatten_with_paths(stored_spec):
            field = _Field(path, leaf, offset)
            self.fields.append(field)
            offset = field.stop
        self.step_bytes = offset
        self._dtypes = [f.dtype for f in self.fields]
        self._shapes = [f.shape for f in self.fields]

    def mismatch_notes(self) -> list[str]:
        """The layout, and how this spec's fields fill a row (a packed signature names only
        the row's bytes)."""
        fields = ", ".join(
            f"{f.path!r} {f.dtype.name}{list(f.shape)} {f.nbytes} B" for f in self.fields
        )
        return [
            f"this manager's layout is 'packed': its data_spec packs a step into "
            f"{self.step_bytes} bytes ({fields})"
        ]

    # ------------------------------------------------------------------------------ writing

    def pack(self, leaves: Sequence[Any]) -> np.ndarray:
        """One step's leaves (`tree.flatten` order of the stored step) as a `uint8` row.

        Raises:
          ValueError: If the number of leaves, a leaf's dtype or its shape differs from the
            spec (naming the field).
        """
        return self.encode_step(leaves if type(leaves) is list else list(leaves))

    def encode_step(self, step: Any) -> np.ndarray:
        """One step, given as a nest shaped like the stored spec or as its flat leaves in a
        list (`tree.flatten` order), as a `uint8` row: what a packed writer appends.

        Raises:
          ValueError: If the number of leaves, a leaf's dtype or its shape differs from the
            spec (naming the field).
        """
        leaves = step if type(step) is list else tree.flatten(step)
        if len(leaves) != len(self.fields):
            raise ValueError(
                f"a step of this table has {len(self.fields)} fields, got {len(leaves)}"
            )
        parts = []
        for leaf, dtype, shape in zip(leaves, self._dtypes, self._shapes, strict=True):
            if not isinstance(leaf, _NUMPY):
                leaf = np.asarray(leaf)
            if leaf.dtype != dtype or leaf.shape != shape:
                self._raise(leaves)
            parts.append(leaf.tobytes())
        return np.frombuffer(b"".join(parts), np.uint8)

    def pack_items(self, columns: Sequence[np.ndarray]) -> np.ndarray:
        """Items given as one array per field (`[num_items, sequence_length, *shape]`, in
        `tree.flatten` order) as packed rows `uint8[num_items, sequence_length, step_bytes]`."""
        parts = []
        for column, field in zip(columns, self.fields, strict=True):
            array = np.ascontiguousarray(column, dtype=field.dtype)
            lead = array.shape[: array.ndim - len(field.shape)]
            parts.append(array.view(np.uint8).reshape(*lead, field.nbytes))
        return np.concatenate(parts, axis=-1)

    def pack_nest(self, step: Any) -> np.ndarray:
        """`pack` of a step given as a nest shaped like the stored spec."""
        return self.pack(tree.flatten(step))

    def encode_columns(self, columns: Sequence[np.ndarray]) -> list[np.ndarray]:
        """`[pack_items(columns)]`: the one packed column."""
        return [self.pack_items(columns)]

    def window_writer(
        self,
        client: Any,
        windows: Sequence[tuple[str, int, int, float, bool]],
        configs: Callable[[], Sequence[Any]],
    ) -> PackedWindowWriter:
        """A `PackedWindowWriter` of `windows` (it makes the windows itself: no `configs`)."""
        del configs
        return PackedWindowWriter(client, windows, self)

    def writer_chunking(self, sequence_length: int) -> tuple[int, int]:
        """Constant chunks of `chunk_length(step_bytes)` steps, as the packed writers write,
        and at least one item's steps kept alive."""
        chunk = chunk_length(self.step_bytes)
        return max(chunk, sequence_length), chunk

    def item_writer(self, client: Any, sequence_length: int) -> Any:
        """`client.trajectory_writer` with the packed column in constant chunks."""
        keep, chunk = self.writer_chunking(sequence_length)
        writer = plain_client(client).trajectory_writer(num_keep_alive_refs=keep)
        writer.configure((0,), num_keep_alive_refs=keep, max_chunk_length=chunk)
        return writer

    def _raise(self, leaves: Sequence[Any]) -> None:
        for leaf, field in zip(leaves, self.fields, strict=True):
            array = np.asarray(leaf)
            if array.dtype != field.dtype or array.shape != field.shape:
                raise ValueError(
                    f"field {field.path!r}: expected {field.dtype.name}{list(field.shape)}, "
                    f"got {array.dtype.name}{list(array.shape)}"
                )

    # ------------------------------------------------------------------------------ reading

    def unpack(self, rows: Any) -> Any:
        """numpy `uint8[..., step_bytes]` rows back into the stored nest of `[..., *shape]`
        arrays (views of `rows` where the alignment allows, else copies)."""
        return tree.unflatten_as(self.structure, self.unpack_leaves(rows))

    def decode_columns(self, columns: Sequence[np.ndarray], *, copy: bool = False) -> list[Any]:
        """`unpack_leaves` of the one packed column.

        Raises:
          ValueError: If `columns` is not one `uint8[..., step_bytes]` array.
        """
        if len(columns) != 1:
            raise ValueError(f"a packed table stores one column, got {len(columns)}")
        return self.unpack_leaves(columns[0], copy=copy)

    def unpack_leaves(self, rows: Any, *, copy: bool = False) -> list[np.ndarray]:
        """`unpack`'s leaves, in `fields` order.

        Args:
          rows: numpy `uint8[..., step_bytes]`.
          copy: Whether every leaf is a contiguous array of its own (else views of `rows`
            where the alignment allows).

        Returns:
          One `[..., *shape]` array per field.

        Raises:
          ValueError: If `rows` is not `uint8[..., step_bytes]`.
        """
        rows = self._checked(rows)
        lead = rows.shape[:-1]
        flat = rows.reshape(-1, self.step_bytes)
        return [self._leaf(flat, field, copy).reshape(*lead, *field.shape) for field in self.fields]

    def leaf(self, rows: Any, index: int) -> np.ndarray:
        """Field `index` (`fields` order) of numpy rows `uint8[..., step_bytes]`, as a
        contiguous array `[..., *shape]` of its own: one copy of only that field's bytes (e.g.
        of one step of every item: `leaf(rows[:, 0], index)`).

        Raises:
          ValueError: If `rows` is not `uint8[..., step_bytes]`.
        """
        rows = self._checked(rows)
        field = self.fields[index]
        return self._leaf(rows, field, True).reshape(*rows.shape[:-1], *field.shape)

    def _checked(self, rows: Any) -> np.ndarray:
        rows = np.asarray(rows)
        if rows.dtype != np.uint8 or rows.shape[-1:] != (self.step_bytes,):
            raise ValueError(
                f"packed rows must be uint8[..., {self.step_bytes}], got "
                f"{rows.dtype.name}{list(rows.shape)}"
            )
        return rows

    @staticmethod
    def _leaf(rows: np.ndarray, field: _Field, copy: bool) -> np.ndarray:
        """`field`'s bytes of `rows` viewed as its dtype (`[..., size]`); a copy if `copy` or
        where the alignment asks for one."""
        part = rows[..., field.start : field.stop]
        if copy:
            part = part.copy()
        elif field.dtype.itemsize > 1:
            part = np.ascontiguousarray(part)
        return part.view(field.dtype)

    def unpack_tf(self, rows: Any) -> Any:
        """`unpack` of a `tf.uint8` tensor `[..., step_bytes]` (static rank), in TF ops."""
        import tensorflow as tf

        lead = tf.shape(rows)[:-1]
        leaves = []
        for field in self.fields:
            part = rows[..., field.start : field.stop]
            size = field.dtype.itemsize
            if field.dtype == np.bool_:
                value = tf.cast(part, tf.bool)
            elif size == 1:
                value = tf.bitcast(part, tf.as_dtype(field.dtype))
            else:
                grouped = tf.reshape(part, tf.concat([lead, [field.size, size]], 0))
                value = tf.bitcast(grouped, tf.as_dtype(field.dtype))
            value = tf.reshape(value, tf.concat([lead, list(field.shape)], 0))
            leaves.append(value)
        return tf.nest.pack_sequence_as(self.structure, leaves)

    def unpack_samples(self, dataset: Any) -> Any:
        """`dataset` with the data of every `ReplaySample` batch unpacked (`unpack_tf`)."""

        def unpack(sample: Any) -> Any:
            return sample._replace(data=self.unpack_tf(sample.data))

        return dataset.map(unpack)

    def sequence_preprocess(self, fn: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
        """Unpacks each sequence (`unpack_tf`), then applies `fn`."""
        import tensorflow as tf

        @tf.autograph.experimental.do_not_convert
        def unpack_then(data: Any) -> Any:
            data = self.unpack_tf(data)
            return data if fn is None else fn(data)

        return unpack_then

    def batch_reader(
        self,
        max_step_bytes: int,
        read_nest: Callable[[Any], Any],
        rows_reader: Callable[[PackedLayout], Callable[[Any], Any]],
    ) -> tuple[Callable[[Any], Any], bool]:
        """The reader unpacks steps of up to `max_step_bytes` itself (`rows_reader(self)`, and
        the pipeline yields the rows); larger ones are unpacked by the pipeline."""
        if self.step_bytes > max_step_bytes:
            return read_nest, True
        return rows_reader(self), False

    # ---------------------------------------------------------------------------- signature

    def step_spec(self) -> Any:
        """`tf.TensorSpec([step_bytes], tf.uint8)`: one stored step."""
        import tensorflow as tf

        return tf.TensorSpec([self.step_bytes], tf.uint8, "packed")

    def signature(self, sequence_length: int) -> Any:
        """The table signature: `tf.TensorSpec([sequence_length, step_bytes], tf.uint8)`."""
        import tensorflow as tf

        return tf.TensorSpec([sequence_length, self.step_bytes], tf.uint8, "packed")

    def item_signature(self, sequence_length: int) -> Any:
        """`signature(sequence_length)`."""
        return self.signature(sequence_length)

    def describe(self, sequence_length: int) -> list[dict[str, Any]]:
        """`specs.describe_spec` of the signature, without TensorFlow."""
        return [{"path": "", "dtype": "uint8", "shape": [sequence_length, self.step_bytes]}]


def item_signature(stored_spec: Any, sequence_length: int, layout: str) -> Any:
    """The table signature of the layout called `layout`: `specs.table_signature(stored_spec,
    sequence_length)` (nested), or `uint8[sequence_length, step_bytes]` (packed). Imports
    TensorFlow; see `Layout.item_signature`.

    Raises:
      ConfigError: If `layout` is not a layout name.
    """
    return resolve_layout(layout, stored_spec).item_signature(sequence_length)


def step_layout(signature: Any) -> PackedLayout:
    """The `PackedLayout` of a table's (nested) item signature: its steps without the leading
    time dimension."""
    return layout_of(steps_of(signature))


_LAYOUTS: dict[str, PackedLayout] = {}


def layout_of(stored_spec: Any) -> PackedLayout:
    """A (cached) `PackedLayout` of `stored_spec`."""
    key = repr(stored_spec)
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = _LAYOUTS[key] = PackedLayout(stored_spec)
    return layout


def unpack(array: Any, data_spec: Any, *, pad_end_of_episode: bool = False) -> Any:
    """Turns packed rows read from a packed table back into the step nest.

    For a plain `reverb.Client`: `client.sample(table)` (or a `reverb.TrajectoryDataset` built
    from the table signature, then `.numpy()`) yields `uint8[sequence_length, step_bytes]`
    per item; `unpack(item, data_spec)` returns the `Trajectory` of `[sequence_length, ...]`
    arrays (`Masked(Trajectory, mask)` with `pad_end_of_episode=True`). Leading dimensions
    (batch, time) are kept.

    Args:
      array: numpy `uint8[..., step_bytes]`.
      data_spec: The per-step data spec the buffer was created with.
      pad_end_of_episode: Whether the table is padded (its steps are `Masked`).

    Returns:
      The nest of numpy arrays.

    Raises:
      ValueError: If `array` is not `uint8` with `step_bytes` in its last dimension.
    """
    from replay_service.specs.windows import stored_spec

    return layout_of(stored_spec(data_spec, pad_end_of_episode)).unpack(array)


# Items of a packed writer wait in their unfinished chunk (up to `MAX_CHUNK_LENGTH` steps)
# until it fills or is flushed; the sender pushes them out at most `SEND_AFTER_S` after they
# were written, so that they become visible to samplers soon without the writer waiting for a
# round trip (a waiting flush per episode cost about a quarter of the insert rate, measured
# with ~22-step CartPole episodes; a flush at once at every episode end, not waiting, about
# 8% with 200-step episodes: it cut chunks short; the timer alone, within noise).
SEND_AFTER_S = 0.05
# The sender's flush waits this long for confirmations before it moves on (the items are on
# their way; the writer's own flush and close wait for them).
_SEND_WAIT_MS = 1
# How long a writer that was never closed waits for its items at interpreter exit (or when it
# is dropped) unless it was given its `Timeouts.write` (`SentWriter.bound_waits`): the
# default `Timeouts.write`.
EXIT_WAIT_S = 30.0


def _is_timeout(error: Exception) -> bool:
    """Whether a Reverb `Flush` error is its timeout (not a failed writer)."""
    return "Timeout exceeded" in str(error) or type(error).__name__ == "DeadlineExceededError"


def count_pending(cpp_writer: Any, limit: int = 1 << 20) -> int | None:
    """How many items of a Reverb C++ writer are unconfirmed: the smallest `n` for which
    `Flush(n)` returns at once (about 2 log2(n) calls of 1 ms); None if the writer fails
    otherwise (its stream broke) or more than `limit` are."""

    def settled(n: int) -> bool | None:
        try:
            cpp_writer.Flush(n, 1)
            return True
        except Exception as e:  # Reverb raises RuntimeError
            return False if _is_timeout(e) else None

    high = 1
    while True:
        done = settled(high)
        if done is None:
            return None
        if done:
            break
        if high >= limit:
            return None
        high *= 2
    low = 0 if high == 1 else high // 2 + 1
    while low < high:
        middle = (low + high) // 2
        done = settled(middle)
        if done is None:
            return None
        if done:
            high = middle
        else:
            low = middle + 1
    return low


def warn_unconfirmed(count: int | None, writers: int, waited_s: float) -> None:
    """Prints (stderr) that `count` items of `writers` unclosed packed writers were not
    confirmed by the server within `waited_s` seconds, so they may be lost."""
    items = "an unknown number of items" if count is None else f"{count} item(s)"
    print(
        f"replay_service: WARNING: {items} written by {writers} packed writer(s) that were "
        f"never closed were not confirmed by the server within {waited_s:g} s and may be "
        "lost; close observers and writers (or flush them) before the process exits",
        file=sys.stderr,
        flush=True,
    )


class _Sender:
    """One daemon thread per process that flushes packed writers' unsent items every
    `SEND_AFTER_S` without making their writers wait. Writers (anything with
    `_send_unsent()`: every `SentWriter`) are held
    weakly; a sender error is left to the writer's own flush. At interpreter exit (`stop`,
    registered with `atexit`) the thread ends before the interpreter finalizes: a daemon
    thread that asked for the GIL back from inside Reverb's flush after that aborted the
    process ("terminate called without an active exception")."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._writers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def register(self, writer: Any) -> None:
        """Sends `writer`'s unsent items from now on (starts the thread on first use)."""
        with self._lock:
            self._writers.add(writer)
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(
                    target=self._run, name="replay_service-packed-sender", daemon=True
                )
                self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ends the thread and waits for it up to `timeout_s`, then (at exit) sends every
        unclosed writer's items and waits for them (`confirm_all`)."""
        with self._lock:
            self._stopped = True
            thread = self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        self.confirm_all()

    def confirm_all(self) -> None:
        """Waits until every item of every writer not closed is confirmed, each writer at
        most its write timeout (all at once: the wait is the longest of them), and prints
        a warning with the number of items that were not (`warn_unconfirmed`)."""
        with self._lock:
            writers = [w for w in self._writers if not w._closed]
        start = time.monotonic()
        unconfirmed: int | None = 0
        failed = 0
        longest = 0.0
        for writer in writers:
            wait_s = writer.exit_wait_s()
            longest = max(longest, wait_s)
            pending = writer.confirm(start + wait_s)
            if pending != 0:
                failed += 1
                unconfirmed = (
                    None if pending is None or unconfirmed is None else (unconfirmed + pending)
                )
        if failed:
            warn_unconfirmed(unconfirmed, failed, longest)

    def after_fork(self) -> None:
        """In a forked child: no thread runs; the next registration starts one."""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._writers = weakref.WeakSet()
        self._thread = None
        self._stopped = False

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait(SEND_AFTER_S)
            self._wake.clear()
            with self._lock:
                writers = list(self._writers)
            for writer in writers:
                if self._stopped:
                    break
                writer._send_unsent()
            del writers


_SENDER = _Sender()
atexit.register(_SENDER.stop)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_SENDER.after_fork)


class SentWriter:
    """A packed writer over a Reverb `TrajectoryWriter` whose unsent items the process's
    sender flushes soon after they were created, without the writer waiting
    (`PackedWindowWriter`, and the `PackingClient`'s writers). A subclass calls
    `_start_sending` with its Reverb writer and raises `_unsent` once an item exists (the
    sender clears it before it flushes, so an item created after a flush keeps it raised)."""

    _writer: Any
    _cpp: Any
    _unsent: bool
    _closed: bool
    _exit_wait_s: float | None = None

    def bound_waits(self, timeout_ms: int | None) -> None:
        """Makes `timeout_ms` (`Timeouts.write`) the bound of the wait for this writer's
        items at interpreter exit, or when it is dropped, unclosed (None: `EXIT_WAIT_S`)."""
        self._exit_wait_s = None if timeout_ms is None else timeout_ms / 1000

    def exit_wait_s(self) -> float:
        """How long this writer's items are waited for at exit (`bound_waits`)."""
        return EXIT_WAIT_S if self._exit_wait_s is None else self._exit_wait_s

    def confirm(self, deadline: float) -> int | None:
        """Sends every item created so far and waits until `deadline` (`time.monotonic()`)
        for their confirmations.

        Returns:
          0 if every item is confirmed (or the writer is closed), else how many are not
          (None: unknown, the writer failed).
        """
        if self._closed:
            return 0
        self._unsent = False
        wait_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            self._cpp.Flush(0, wait_ms)
            return 0
        except Exception as e:  # Reverb raises RuntimeError
            return count_pending(self._cpp) if _is_timeout(e) else None

    def __del__(self) -> None:
        # A writer dropped without `close()` (its collector ended without closing it): its
        # items in an unfinished chunk would never be sent. (At exit the sender has done this
        # for every writer, `_Sender.confirm_all`.)
        try:
            if self._closed or _SENDER._stopped:
                return
            wait_s = self.exit_wait_s()
            pending = self.confirm(time.monotonic() + wait_s)
            if pending != 0:
                warn_unconfirmed(pending, 1, wait_s)
        except Exception:  # a finalizer cannot raise (e.g. a half-built writer)
            pass

    def _start_sending(self, writer: Any) -> None:
        """Keeps `writer` (a Reverb Python `TrajectoryWriter`) and lets the sender flush it."""
        self._writer = writer
        self._cpp = writer._writer  # its C++ writer
        self._unsent = False
        self._closed = False
        _SENDER.register(self)

    def _send_unsent(self) -> None:
        """(The sender's thread) finalizes the chunks of every item created so far, so they
        go to the server, and waits for confirmations only `_SEND_WAIT_MS`. A timeout, or the
        writer's error, is left to the writer's own flush and close, which raise it."""
        if not self._unsent or self._closed:
            return
        self._unsent = False
        with contextlib.suppress(Exception):
            self._cpp.Flush(0, _SEND_WAIT_MS)

    def close(self) -> None:
        """Closes the Reverb writer."""
        self._closed = True
        self._writer.close()


def plain_client(client: Any) -> Any:
    """`client`, or the plain `reverb.Client` behind a `PackingClient` (whose writers pack
    nested steps themselves): the writers here append packed rows."""
    plain = getattr(client, "plain_client", None)
    return client if plain is None else plain


class PackedWindowWriter(SentWriter):
    """Writes packed steps and inserts the same windows as the StructuredWriter configs of
    `observers.window_configs` (the last `sequence_length` steps of the episode, every
    `stride_length` steps; padded tables at multiples of the stride), with the same API
    (`append`, `flush`, `end_episode`).

    A Reverb `TrajectoryWriter` with one column in chunks of `chunk_length(step_bytes)` steps;
    the windows are made here, one `CreateItem` per table and step at most.

    Args:
      client: The `reverb.Client`.
      windows: Per table `(name, sequence_length, stride_length, priority, padded)`.
      layout: The tables' `PackedLayout`.
    """

    def __init__(
        self,
        client: Any,
        windows: Sequence[tuple[str, int, int, float, bool]],
        layout: PackedLayout,
    ) -> None:
        from reverb import pybind

        self._encode = layout.encode_step
        self._windows = [
            (name, int(length), int(stride), float(priority), bool(padded), int(length) - 1)
            for name, length, stride, priority, padded in windows
        ]
        self._history = max(w[1] for w in self._windows)
        chunk = chunk_length(layout.step_bytes)
        keep = max(chunk, self._history)
        # The wrapper's Python bookkeeping is bypassed: one column, appended and referenced
        # through the C++ writer directly (`_cpp`).
        self._start_sending(plain_client(client).trajectory_writer(num_keep_alive_refs=keep))
        self._cpp.ConfigureChunker(
            0, pybind.ConstantChunkerOptions(max_chunk_length=chunk, num_keep_alive_refs=keep)
        )
        self._refs: list[Any] = []
        self._step = 0
        self._since = [0] * len(self._windows)

    def append(self, step: Any) -> None:
        """Appends one step (a nest shaped like the stored spec, or its flat leaves as a list)
        and inserts every window it completes.

        Raises:
          ValueError: If the step does not match the stored spec.
        """
        row = self._encode(step)
        refs = self._refs
        refs.append(self._cpp.Append([row])[0])
        if len(refs) > self._history:
            del refs[0]
        index = self._step
        self._step = index + 1
        since = self._since
        for k, (name, length, stride, priority, padded, first) in enumerate(self._windows):
            count = since[k] + 1
            if index >= first and (index % stride == first % stride if padded else count >= stride):
                self._cpp.CreateItem(name, priority, [refs[-length:]], [False])
                count = 0
            since[k] = count
        # Raised once the step's items exist: the sender clears it before it flushes, so an
        # item created after a flush keeps it raised for the next one.
        self._unsent = True

    def flush(self, block_until_num_items: int = 0, timeout_ms: int | None = None) -> None:
        """Waits until at most `block_until_num_items` items are unconfirmed."""
        self._writer.flush(block_until_num_items, timeout_ms=timeout_ms)

    def end_episode(self, clear_buffers: bool = True, timeout_ms: int | None = None) -> None:
        """Ends the episode: the next step starts a new one (no window spans both). Waits,
        as Reverb's `end_episode`, until every item written so far is confirmed.

        Raises:
          DeadlineExceededError: If that takes longer than `timeout_ms`.
        """
        self._writer.end_episode(clear_buffers, timeout_ms=timeout_ms)
        self.next_episode()

    def next_episode(self) -> None:
        """Ends the episode without waiting: the next step starts a new one (no window spans
        both), and the items written so far stay pending until a `flush`.

        The windows are made here, so Reverb need not know where episodes end: steps of
        consecutive episodes may share a chunk. Reverb's `end_episode` waits for every pending
        item to be confirmed, one round trip per episode and writer (most of an insert's time
        with episodes of ~20 steps and a writer per environment).
        """
        self._refs = []
        self._step = 0

"""Reverb writers of packed rows, and the process's sender that pushes their items out.

A packed table (`replay_service.specs.packed`) stores every step as one `uint8` row in one
column written in constant chunks. Its items wait in their unfinished chunk until it fills or
is flushed, so the process's sender thread flushes every packed writer's new items soon after
they were written (`SEND_AFTER_S`), without the writer waiting; at interpreter exit it waits
for the items of every writer never closed. `SentWriter` is what such a writer shares
(`PackedWindowWriter` here, `packing_client.PackingTrajectoryWriter`), and
`PackedWindowWriter` the collectors' writer of a packed table's windows.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from replay_service.backends.reverb.internals import abandon_writer
from replay_service.specs.packed import PackedLayout, chunk_length

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

    def flush(self, block_until_num_items: int = 0, timeout_ms: int | None = None) -> None:
        """Waits until at most `block_until_num_items` items are unconfirmed."""
        self._writer.flush(block_until_num_items, timeout_ms=timeout_ms)

    def close(self) -> None:
        """Closes the Reverb writer."""
        self._closed = True
        self._writer.close()

    def abandon(self) -> None:
        """Gives the writer up without waiting for its items (they are lost): it is marked
        closed, so nothing waits for them again (the flush at exit), and kept alive until the
        process exits, so that Reverb's destructor, which waits without a timeout, never runs
        (`internals.abandon_writer`)."""
        abandon_writer(self)


class PackedWindowWriter(SentWriter):
    """Writes packed steps and inserts the same windows as the StructuredWriter configs of
    `layout_writers.window_configs` (the last `sequence_length` steps of the episode, every
    `stride_length` steps; padded tables at multiples of the stride), with the same API
    (`append`, `flush`, `end_episode`).

    A Reverb `TrajectoryWriter` with one column in chunks of `chunk_length(step_bytes)` steps;
    the windows are made here, one `CreateItem` per table and step at most.

    Args:
      client: A plain `reverb.Client` (its writers append what they are given: the rows).
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
        self._start_sending(client.trajectory_writer(num_keep_alive_refs=keep))
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

    def end_episode(self, clear_buffers: bool = True, timeout_ms: int | None = None) -> None:
        """Ends the episode: the next step starts a new one (no window spans both). Waits,
        as Reverb's `end_episode`, until every item written so far is confirmed.

        Raises:
          DeadlineExceededError: If that takes longer than `timeout_ms`.
        """
        self._writer.end_episode(clear_buffers, timeout_ms=timeout_ms)
        self.next_episode()

    def next_episode(self) -> bool:
        """Ends the episode without waiting: the next step starts a new one (no window spans
        both), and the items written so far stay pending until a `flush`.

        Returns:
          True: the episode ended (see `collect.writing.WindowWriter.next_episode`).

        The windows are made here, so Reverb need not know where episodes end: steps of
        consecutive episodes may share a chunk. Reverb's `end_episode` waits for every pending
        item to be confirmed, one round trip per episode and writer (most of an insert's time
        with episodes of ~20 steps and a writer per environment).
        """
        self._refs = []
        self._step = 0
        return True

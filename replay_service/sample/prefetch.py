"""Batches prepared ahead in a background thread: `Prefetcher`, a bounded queue before `next()`

A `TorchBatchStream` with `prefetch > 0` samples, converts, pins and moves its batches in one
daemon thread, up to `prefetch` batches ahead; the consumer re-raises the thread's error, and
`close()` stops it without waiting longer than `JOIN_TIMEOUT_S`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

# How often a blocked producer or consumer looks at the stop flag.
POLL_S = 0.1
# How long close() waits for the background thread before leaving it to finish on its own.
JOIN_TIMEOUT_S = 5.0

_ITEM, _END, _ERROR = "item", "end", "error"


class Prefetcher:
    """Runs an iterator in a daemon thread, `depth` items ahead, through a bounded queue.

    Args:
      produce: Makes the iterator (called once, in the thread).
      depth: Items held ahead at most (the queue's size).
      name: The thread's name.
    """

    def __init__(self, produce: Callable[[], Iterator[Any]], depth: int, name: str) -> None:
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._final: tuple[str, Any] | None = None
        self._thread = threading.Thread(
            target=_fill, args=(produce, self._queue, self._stop), name=name, daemon=True
        )
        self._thread.start()

    def get(self) -> Any:
        """Returns the next item, waiting for it (the producer's own bounds apply: a sample
        call waits at most its sample timeout).

        Returns:
          The item.

        Raises:
          Exception: The error the producer raised, again at every later call.
          StopIteration: Once the producer ended.
        """
        entry = self._final
        while entry is None:
            try:
                entry = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    entry = (_END, None)
        kind, value = entry
        if kind == _ITEM:
            return value
        self._final = entry
        if kind == _ERROR:
            raise value
        raise StopIteration

    def close(self) -> None:
        """Asks the thread to stop, frees the queue and waits up to `JOIN_TIMEOUT_S`.

        A thread blocked inside a sample call (at most the sample timeout) finishes on its own.
        """
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(JOIN_TIMEOUT_S)


def _fill(
    produce: Callable[[], Iterator[Any]],
    out: queue.Queue[tuple[str, Any]],
    stop: threading.Event,
) -> None:
    try:
        for item in produce():
            if not _put(out, (_ITEM, item), stop):
                return
        _put(out, (_END, None), stop)
    except Exception as e:  # handed to the consumer, which re-raises it
        _put(out, (_ERROR, e), stop)


def _put(out: queue.Queue[tuple[str, Any]], entry: tuple[str, Any], stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            out.put(entry, timeout=POLL_S)
            return True
        except queue.Full:
            continue
    return False

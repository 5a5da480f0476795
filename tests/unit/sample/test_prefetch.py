"""`prefetch.Prefetcher`: an iterator run ahead in a daemon thread, its end and its errors
handed to the consumer, its thread stopped by `close()`."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator

import pytest

from replay_service.sample.prefetch import JOIN_TIMEOUT_S, Prefetcher

pytestmark = pytest.mark.local


def test_items_arrive_in_order_then_the_end():
    prefetcher = Prefetcher(lambda: iter(range(5)), 2, "test-prefetch")
    assert [prefetcher.get() for _ in range(5)] == list(range(5))
    for _ in range(2):  # the end is kept
        with pytest.raises(StopIteration):
            prefetcher.get()
    prefetcher.close()


def test_the_producers_error_is_raised_at_every_later_call():
    def produce() -> Iterator[int]:
        yield 1
        raise ValueError("broken source")

    prefetcher = Prefetcher(produce, 1, "test-prefetch")
    assert prefetcher.get() == 1
    for _ in range(2):
        with pytest.raises(ValueError, match="broken source"):
            prefetcher.get()
    prefetcher.close()


def test_close_stops_a_producer_blocked_on_a_full_queue():
    produced = itertools.count()
    prefetcher = Prefetcher(lambda: (next(produced) for _ in itertools.count()), 2, "test-stop")
    assert prefetcher.get() == 0
    thread = next(t for t in threading.enumerate() if t.name == "test-stop")
    assert thread.daemon
    started = time.monotonic()
    prefetcher.close()
    assert time.monotonic() - started < JOIN_TIMEOUT_S
    assert not thread.is_alive()

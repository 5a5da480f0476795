"""`collect.view.Writers`: a buffer's open collectors, flushed in order and closed all at once,
a failing close logged without keeping the others open."""

from __future__ import annotations

import logging

import pytest

from replay_service.collect.view import Writers
from replay_service.errors import WriteTimeoutError


class Collector:
    """A collector that records what was asked of it (the `flush`/`close` of a writer)."""

    def __init__(self, log: list[str], name: str, fail_close: bool = False) -> None:
        self.log, self.name, self.fail_close = log, name, fail_close

    def flush(self, timeout_ms: int | None = None) -> None:
        self.log.append(f"flush {self.name}")

    def close(self) -> None:
        self.log.append(f"close {self.name}")
        if self.fail_close:
            raise WriteTimeoutError(f"{self.name}: server gone")


def test_writers_flush_in_order_and_close_all_despite_a_failure(caplog):
    log: list[str] = []
    writers = Writers()
    first = writers.add(Collector(log, "a", fail_close=True))
    assert first.name == "a"  # `add` returns what it was given
    writers.add(Collector(log, "b"))
    writers.flush()
    assert [c.name for c in writers] == ["a", "b"]
    with caplog.at_level(logging.WARNING, logger="replay_service.collect.view"):
        writers.close_all()
    assert log == ["flush a", "flush b", "close a", "close b"]
    assert "observer close failed: a: server gone" in caplog.text
    assert list(writers) == []  # forgotten: a second close_all closes nothing
    writers.close_all()
    assert log[-1] == "close b"


def test_writers_forget_everything_when_a_close_is_interrupted():
    class Interrupting(Collector):
        def close(self) -> None:
            raise KeyboardInterrupt

    writers = Writers()
    writers.add(Interrupting([], "a"))
    with pytest.raises(KeyboardInterrupt):
        writers.close_all()
    assert list(writers) == []

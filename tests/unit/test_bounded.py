"""`bounded.call_with_timeout`: a blocking call run with a timeout of its own."""

from __future__ import annotations

import threading

import pytest

from replay_service.bounded import call_with_timeout


def test_the_result_comes_back_from_the_callers_view():
    assert call_with_timeout(lambda: 42, 1.0, "answer") == 42
    assert call_with_timeout(lambda: None, None, "nothing") is None


def test_the_calls_own_error_is_raised_in_the_caller():
    def fail():
        raise KeyError("missing")

    with pytest.raises(KeyError, match="missing"):
        call_with_timeout(fail, 1.0, "lookup")


def test_a_call_past_its_timeout_is_named_and_left_running_in_a_daemon_thread():
    release = threading.Event()
    started = threading.Event()

    def block():
        started.set()
        release.wait(5)
        return "late"

    with pytest.raises(TimeoutError, match=r"^server_info did not finish within 0\.05 s$"):
        call_with_timeout(block, 0.05, "server_info")
    assert started.is_set()
    worker = next(t for t in threading.enumerate() if t.name == "replay_service:server_info")
    assert worker.daemon and worker.is_alive()
    release.set()
    worker.join(1)
    assert not worker.is_alive()

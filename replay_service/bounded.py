"""Bounded waits: a blocking call that has no timeout of its own, run with one."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")


def call_with_timeout(fn: Callable[[], _T], timeout: float | None, what: str) -> _T:
    """Runs a blocking call that has no timeout of its own, waiting at most `timeout` seconds.

    On timeout the call keeps running in a daemon thread; its result is discarded.

    Raises:
      TimeoutError: If `fn` does not return in time.
      Exception: Whatever `fn` raised.
    """
    result: list[_T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # re-raised in the caller's thread
            error.append(e)

    thread = threading.Thread(target=target, name=f"replay_service:{what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not finish within {timeout} s")
    if error:
        raise error[0]
    return result[0]

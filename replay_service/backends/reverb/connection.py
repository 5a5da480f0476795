"""Reaching Reverb servers: ports, connections and bounded calls."""

from __future__ import annotations

import errno
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import reverb

from replay_service.errors import (
    ConfigError,
    PortInUseError,
    ServerError,
    ServerUnavailableError,
)

_T = TypeVar("_T")


def check_port_free(port: int) -> None:
    """Raises `PortInUseError` if something already listens on `port`.

    gRPC binds with SO_REUSEPORT, so a second Reverb server on a busy port starts without error
    and shares the port; this check binds without that option first to catch it.

    Raises:
      ConfigError: If `port` is not in 1..65535.
      PortInUseError: If the port is taken.
    """
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ConfigError(f"port must be an integer in 1..65535, got {port!r}")
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
                return
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise PortInUseError(
                        f"port {port} is already in use; choose another port or omit it to "
                        "pick a free one"
                    ) from None
                if e.errno != errno.EAFNOSUPPORT:
                    raise ServerError(f"cannot bind port {port}: {e}") from e


def pick_free_port() -> int:
    """Returns a port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def server_info(client: reverb.Client, timeout: float | None) -> dict[str, Any]:
    """`client.server_info()` bounded by `timeout` seconds (Reverb takes whole seconds).

    Raises:
      ServerUnavailableError: If the server does not answer in time.
    """
    try:
        return client.server_info(timeout=max(1, round(timeout)) if timeout else None)
    except Exception as e:  # Reverb raises RuntimeError or DeadlineExceededError.
        raise ServerUnavailableError(
            f"no Reverb server answered at {client.server_address!r} within {timeout} s ({e}); "
            "is the server running and the port reachable?"
        ) from e


def connect(address: str, timeout: float | None) -> reverb.Client:
    """Returns a client after the server at `address` has answered.

    Args:
      address: "host:port" of a running Reverb server.
      timeout: Seconds to wait for its first answer.

    Raises:
      ConfigError: If `address` is not "host:port".
      ServerUnavailableError: If no server answers within `timeout`.
    """
    host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not host or not port.isdigit():
        raise ConfigError(f"server_address must look like 'host:port', got {address!r}")
    import reverb

    client = reverb.Client(address)
    server_info(client, timeout)
    return client


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

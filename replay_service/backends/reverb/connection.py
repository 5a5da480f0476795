"""Reaching Reverb servers: ports and connections."""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import reverb

from replay_service.errors import (
    ConfigError,
    PortInUseError,
    ServerError,
    ServerUnavailableError,
)


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


# Ports `pick_free_port` has handed out in this process, never handed out again.
_HANDED_OUT: set[int] = set()
_HANDED_OUT_LOCK = threading.Lock()
# Tries at a port this process has not handed out before settling for a used one.
_PICK_TRIES = 64


def pick_free_port() -> int:
    """Returns a port that was free a moment ago and that this process has not handed out before.

    gRPC shares one connection per address among all the clients of a process: a client of a
    new server on a port that an earlier, stopped server of this process used waits out the old
    connection's reconnect backoff before its first call is answered. Never handing a port out
    twice keeps a new server's first answer prompt.
    """
    with _HANDED_OUT_LOCK:
        for _ in range(_PICK_TRIES):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("", 0))
                port = int(sock.getsockname()[1])
            if port not in _HANDED_OUT:
                break
        _HANDED_OUT.add(port)
        return port


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
      timeout: Seconds to wait for its first answer (None: wait as long as it takes).

    Raises:
      ConfigError: If `address` is not "host:port".
      ServerUnavailableError: If no server answers within `timeout`.
    """
    host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not host or not port.isdigit():
        raise ConfigError(f"server_address must look like 'host:port', got {address!r}")
    import reverb

    return first_answer(lambda: reverb.Client(address), timeout)


# The shortest wait for one client's first answer before a new client asks again.
_FIRST_CALL_S = 2.0


def first_answer(new_client: Callable[[], reverb.Client], timeout: float | None) -> reverb.Client:
    """Returns the first client made by `new_client` whose server answers within `timeout` s.

    Rarely, on a loaded machine, the first call of a new client to a server that started a
    moment ago does not complete although the server answers other clients at once. The time is
    therefore split: a client that has not answered within a third of it (at least
    `_FIRST_CALL_S`) is replaced by a new one, until `timeout` has passed.

    Raises:
      ServerUnavailableError: If no client's server answers within `timeout`, naming the
        address and the whole timeout.
    """
    if timeout is None:
        client = new_client()
        server_info(client, None)
        return client
    deadline = time.monotonic() + timeout
    share = max(_FIRST_CALL_S, timeout / 3)
    while True:
        client = new_client()
        asked = time.monotonic()
        try:
            server_info(client, max(1.0, min(share, deadline - asked)))
            return client
        except ServerUnavailableError as e:
            # A call that failed at once (e.g. a refused connection) is not repeated at once.
            time.sleep(
                max(
                    0.0,
                    min(
                        _FIRST_CALL_S / 4 - (time.monotonic() - asked), deadline - time.monotonic()
                    ),
                )
            )
            if deadline - time.monotonic() < 0.5:
                raise ServerUnavailableError(
                    f"no Reverb server answered at {client.server_address!r} within {timeout} s "
                    f"({e.__cause__ or e}); is the server running and the port reachable?"
                ) from (e.__cause__ or e)

"""Stopping confirmations: shutting down a server's connections at the socket level, via /proc.

Reverb offers no way to refuse inserts on a running server, and `Server.stop()` also stops
answering the process's own client. `close_foreign_connections` shuts down (at the socket level)
every connection to the server's port except this process's own client, and the listening socket:
writers then get an error for anything not yet confirmed, and a final checkpoint taken after it
holds every confirmed item.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterable

from replay_service.backends.reverb.platform.version import require_supported_reverb
from replay_service.errors import ServerError


def close_foreign_connections(port: int, own_clients: Iterable[int] = ()) -> int:
    """Stops a Reverb server in this process from receiving or confirming anything more.

    Shuts down (both directions) the listening socket of `port` and every connection accepted
    on it, except those whose peer is one of this process's own client sockets (local ports
    `own_clients`, e.g. the client that takes the final checkpoint). Reverb keeps its tables and
    answers the remaining client; remote writers see their streams fail, so an item is either
    confirmed before this call or never confirmed.

    Args:
      port: The server's port.
      own_clients: Local ports of this process's client connections to keep.

    Returns:
      The number of sockets shut down.

    Raises:
      ServerError: If this platform does not expose its sockets under /proc (Linux only), or
        the installed dm-reverb is not one this was verified on.
    """
    require_supported_reverb()
    keep = set(own_clients)
    closed = 0
    for fd, local_port, remote_port, listening in _tcp_sockets():
        if local_port != port or (not listening and remote_port in keep):
            continue
        with contextlib.suppress(OSError):
            duplicate = socket.socket(fileno=os.dup(fd))
            try:
                duplicate.shutdown(socket.SHUT_RDWR)
                closed += 1
            finally:
                duplicate.close()  # closes the duplicate only; the server's descriptor stays
    return closed


def own_client_ports(port: int) -> list[int]:
    """Local ports of this process's client connections to `port`."""
    return [
        local for _, local, remote, listening in _tcp_sockets() if remote == port and not listening
    ]


def _tcp_sockets() -> list[tuple[int, int, int, bool]]:
    """This process's TCP sockets: (fd, local port, remote port, is listening)."""
    inodes: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError as e:
        raise ServerError(f"cannot list this process's sockets (/proc/self/fd): {e}") from e
    for name in names:
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{name}")
            if link.startswith("socket:["):
                inodes[int(link[8:-1])] = int(name)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table, encoding="ascii") as f:
            next(f, None)
            for line in f:
                fields = line.split()
                inode = int(fields[9])
                if inode in inodes:
                    local = int(fields[1].rsplit(":", 1)[1], 16)
                    remote = int(fields[2].rsplit(":", 1)[1], 16)
                    found.append((inodes[inode], local, remote, fields[3] == "0A"))
    return found

"""Shutting down a running Reverb server's connections at the socket level: every connection to
its port except the process's own kept clients, and its listening socket."""

from __future__ import annotations

import numpy as np
import pytest
import reverb

from replay_service.backends.reverb.connection import pick_free_port, server_info
from replay_service.backends.reverb.platform.sockets import (
    close_foreign_connections,
    own_client_ports,
)
from replay_service.errors import ServerUnavailableError


@pytest.mark.heavy
def test_only_the_kept_clients_connection_survives_and_nothing_new_connects() -> None:
    server = reverb.Server([reverb.Table.queue("q", 10)], port=pick_free_port())
    try:
        port = server.port
        assert own_client_ports(port) == []
        kept = reverb.Client(f"localhost:{port}")
        server_info(kept, 5.0)
        own = own_client_ports(port)
        assert len(own) >= 1
        # gRPC shares one connection per address within a process: another address, another one.
        other = reverb.Client(f"127.0.0.1:{port}")
        other.insert([np.int32(1)], {"q": 1.0})
        assert set(own_client_ports(port)) > set(own)

        closed = close_foreign_connections(port, own)

        assert closed >= 2  # the listening socket and the other client's connection at least
        assert server_info(kept, 5.0)["q"].current_size == 1  # bounded: fails if cut off
        kept.insert([np.int32(2)], {"q": 1.0})
        assert server_info(kept, 5.0)["q"].current_size == 2
        with pytest.raises(ServerUnavailableError):
            server_info(other, 1.0)
        with pytest.raises(ServerUnavailableError):
            server_info(reverb.Client(f"[::1]:{port}"), 1.0)
    finally:
        server.stop()


def test_a_port_nothing_listens_on_closes_nothing() -> None:
    assert close_foreign_connections(pick_free_port()) == 0

"""Reaching Reverb servers: a busy port is refused before a server shares it, addresses are
checked, and a server that does not answer is named with the address and the timeout."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import reverb

from replay_service.backends.reverb.connection import (
    check_port_free,
    connect,
    pick_free_port,
    server_info,
)
from replay_service.errors import ConfigError, PortInUseError, ServerUnavailableError


@pytest.fixture(scope="module")
def server() -> Iterator[reverb.Server]:
    server = reverb.Server([reverb.Table.queue("q", 10)], port=pick_free_port())
    yield server
    server.stop()


def test_a_free_port_passes_and_a_listening_one_is_refused() -> None:
    port = pick_free_port()
    check_port_free(port)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        with pytest.raises(PortInUseError, match=f"port {port} is already in use"):
            check_port_free(port)
    check_port_free(port)  # free again once closed


def test_the_port_of_a_running_reverb_server_is_in_use(server: reverb.Server) -> None:
    with pytest.raises(PortInUseError, match=str(server.port)):
        check_port_free(server.port)


@pytest.mark.parametrize("port", [0, 65536, -1, True, "8000", 80.0])
def test_a_port_outside_1_to_65535_is_a_config_error_naming_it(port: object) -> None:
    with pytest.raises(ConfigError, match=rf"port must be an integer in 1\.\.65535, got {port!r}"):
        check_port_free(port)  # type: ignore[arg-type]


def test_connect_returns_a_client_of_the_answering_server(server: reverb.Server) -> None:
    client = connect(f"localhost:{server.port}", 5.0)
    assert client.server_address == f"localhost:{server.port}"
    assert set(server_info(client, 5.0)) == {"q"}


@pytest.mark.parametrize("address", ["localhost", "localhost:", ":80", "host:port", None])
def test_an_address_that_is_not_host_and_port_is_refused_before_connecting(address) -> None:
    with pytest.raises(ConfigError, match=rf"must look like .host:port., got {address!r}"):
        connect(address, 1.0)


@pytest.mark.heavy
def test_no_server_at_the_address_is_unavailable_naming_address_and_timeout() -> None:
    address = f"localhost:{pick_free_port()}"
    with pytest.raises(ServerUnavailableError, match=rf"at '{address}' within 0\.5 s"):
        server_info(reverb.Client(address), 0.5)

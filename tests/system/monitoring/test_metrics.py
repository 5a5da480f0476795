"""Prometheus `/metrics`: a real HTTP scrape, the exposition text parsed and checked."""

from __future__ import annotations

import socket
import time
import urllib.request

import pytest

pytest.importorskip("prometheus_client", reason="needs the 'metrics' extra (prometheus-client)")
from prometheus_client.parser import text_string_to_metric_families

from conftest import FAST_TIMEOUTS, collect
from replay_service import PortInUseError, ReplayBufferManager
from replay_service.backends.reverb.connection import pick_free_port
from replay_service.monitoring.metrics import start_metrics_server

TABLE = "uniform_table"


def scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Sample name -> labels -> value, from one GET of /metrics."""
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200
        text = response.read().decode()
    values: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return values


def test_metrics_endpoint_of_an_embedded_manager(make_manager, env, policy):
    manager = make_manager()
    _, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 40)
    list(manager.py_client.sample(TABLE, num_samples=7, emit_timesteps=False))
    path = manager.checkpoint()
    size = manager.num_frames()
    port = pick_free_port()
    server = start_metrics_server(manager.stats, port)
    try:
        assert server.address == ("127.0.0.1", port)  # loopback unless told otherwise
        values = scrape(port)
        label = (("table", TABLE),)
        assert values["replay_up"][()] == 1.0
        assert values["replay_table_size"][label] == size
        assert values["replay_table_capacity"][label] == 1000
        assert values["replay_table_inserts_total"][label] == size
        assert values["replay_table_samples_total"][label] == 7
        assert values["replay_table_inserts_per_second"][label] > 0
        assert values["replay_last_checkpoint_items"][()] == size
        assert values["replay_last_checkpoint_bytes"][()] == manager.stats().checkpoint.bytes > 0
        assert values["replay_last_checkpoint_duration_seconds"][()] > 0
        assert path.endswith("ckpt-00000001")

        with pytest.raises(PortInUseError, match=f"metrics port {port}"):
            start_metrics_server(manager.stats, port)

        manager.close()  # a scrape now reports the failure instead of erroring
        values = scrape(port)
        assert values["replay_up"][()] == 0.0
        assert "replay_table_size" not in values
    finally:
        server.close()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass


def test_replay_server_metrics_port(start_server, env, policy, data_spec):
    port = pick_free_port()
    server, address = start_server("--checkpoint_interval_s=0", f"--metrics_port={port}")
    collector = ReplayBufferManager(
        data_spec, 100_000, server_address=address, timeouts=FAST_TIMEOUTS
    )
    try:
        _, observer = collector.load_replay_buffer()
        collect(env, policy, observer, 30)
        size = collector.num_frames()
        list(collector.py_client.sample(TABLE, num_samples=5, emit_timesteps=False))
        time.sleep(0.3)
        values = scrape(port)
    finally:
        collector.close()
    label = (("table", TABLE),)
    assert values["replay_table_size"][label] == size
    assert values["replay_table_capacity"][label] == 100_000
    assert values["replay_table_inserts_total"][label] == size
    assert values["replay_table_samples_total"][label] == 5
    assert values["replay_table_fill_ratio"][label] == pytest.approx(size / 100_000)
    code, output = server.finish()
    assert code == 0, output[-2000:]
    assert f"metrics on http://127.0.0.1:{port}/metrics" in output


def test_replay_server_refuses_a_metrics_port_in_use(start_server):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server, _ = start_server(f"--metrics_port={port}", wait=False)
        code, output = server.finish(sig=None, timeout=60)
    assert code == 2
    assert f"metrics port {port} on 127.0.0.1 is already in use" in output

"""`BoundedClient` on a real Reverb server: where the caller gives no timeout, inserts, writer
flushes, samples, `server_info` and checkpoints fail within the manager's `Timeouts` naming
the server and the bound; a caller's own timeout stays Reverb's; bad priorities and keys are
refused before anything is sent; the client pickles to a new connection with its bounds."""

from __future__ import annotations

import pickle
import re
import socket
from collections.abc import Iterator

import numpy as np
import pytest
import reverb

from replay_service.backends.reverb.bounded_client import BoundedClient
from replay_service.config.options import Timeouts
from replay_service.errors import (
    CheckpointError,
    ConfigError,
    SampleTimeoutError,
    ServerUnavailableError,
    SpecMismatchError,
    WriteTimeoutError,
)

WRITE_S = 0.3
TIMEOUTS = Timeouts(connect=5.0, write=WRITE_S, sample=0.3, checkpoint=60.0)
# Queues of one item: the second insert into each blocks until an item is sampled.
FULL = ["full_insert", "full_writer", "full_legacy", "full_caller"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[reverb.Server]:
    checkpointer = reverb.checkpointers.DefaultCheckpointer(str(tmp_path_factory.mktemp("ckpt")))
    tables = [
        reverb.Table(
            "uniform",
            reverb.selectors.Uniform(),
            reverb.selectors.Fifo(),
            100,
            reverb.rate_limiters.MinSize(1),
        ),
        *(reverb.Table.queue(name, 1) for name in FULL),
    ]
    server = reverb.Server(tables, port=None, checkpointer=checkpointer)
    yield server
    server.stop()


@pytest.fixture()
def client(server: reverb.Server) -> BoundedClient:
    client = BoundedClient(reverb.Client(f"localhost:{server.port}"), TIMEOUTS)
    client.reset("uniform")
    return client


def fill(client: BoundedClient, table: str) -> None:
    """Inserts the one item a full queue holds."""
    client.insert(np.float32(1.0), {table: 1.0})
    assert client.server_info()[table].current_size == 1


def test_inserts_sample_and_priority_updates_reach_the_table(client: BoundedClient) -> None:
    client.insert([np.float32(3.0), np.int64(7)], {"uniform": 2.0})
    sample = next(iter(client.sample("uniform", num_samples=1)))[0]
    assert [np.asarray(d).item() for d in sample.data] == [3.0, 7]
    assert sample.info.priority == 2.0
    client.mutate_priorities("uniform", updates={int(sample.info.key): 5.0})
    assert next(iter(client.sample("uniform", num_samples=1)))[0].info.priority == 5.0
    client.mutate_priorities("uniform", deletes=[int(sample.info.key)])
    assert client.server_info()["uniform"].current_size == 0


@pytest.mark.parametrize(
    ("priorities", "error", "match"),
    [
        ({"uniform": -1.0}, ConfigError, r"priorities must be finite real numbers >= 0, got .*-1"),
        ({"uniform": float("nan")}, ConfigError, r"got .*nan"),
        ({}, ValueError, "priorities must contain at least one item"),
    ],
)
def test_bad_priorities_are_refused_before_anything_is_inserted(
    client: BoundedClient, priorities, error, match
) -> None:
    with pytest.raises(error, match=match):
        client.insert(np.float32(1.0), priorities)
    assert client.server_info()["uniform"].current_size == 0


def test_bad_priority_updates_are_refused_before_any_is_sent(client: BoundedClient) -> None:
    client.insert(np.float32(1.0), {"uniform": 1.0})
    key = int(next(iter(client.sample("uniform", num_samples=1)))[0].info.key)
    with pytest.raises(SpecMismatchError, match=r"item keys must be integers in \[0, 2\*\*64\)"):
        client.mutate_priorities("uniform", updates={key: 3.0, -1: 1.0})
    with pytest.raises(ConfigError, match="inf"):
        client.mutate_priorities("uniform", updates={key: float("inf")})
    assert next(iter(client.sample("uniform", num_samples=1)))[0].info.priority == 1.0


def test_an_insert_the_table_does_not_take_times_out_naming_the_server(
    client: BoundedClient,
) -> None:
    fill(client, "full_insert")
    with pytest.raises(
        WriteTimeoutError,
        match=rf"within {WRITE_S} s \(Timeouts.write\); the "
        rf"server at 'localhost:\d+'",
    ):
        client.insert(np.float32(2.0), {"full_insert": 1.0})


def test_a_writer_flush_the_table_does_not_take_times_out_and_abandons_the_writer(
    client: BoundedClient,
) -> None:
    fill(client, "full_writer")
    writer = client.trajectory_writer(1)
    writer.append({"x": np.float32(2.0)})
    writer.create_item("full_writer", 1.0, {"x": writer.history["x"][-1:]})
    with pytest.raises(
        WriteTimeoutError,
        match=r"TrajectoryWriter.flush\(\): written items were "
        r"not confirmed within 300 ms \(Timeouts.write\); the server at 'localhost",
    ):
        writer.flush()
    writer.close()  # abandoned: returns at once
    with pytest.raises(ValueError, match=r"num_keep_alive_refs \(0\) must be a positive integer"):
        client.trajectory_writer(0)


def test_a_legacy_writer_flush_times_out_and_the_writer_is_closed(client: BoundedClient) -> None:
    fill(client, "full_legacy")
    writer = client.writer(1)
    writer.append(np.float32(2.0))
    writer.create_item("full_legacy", 1, 1.0)
    with pytest.raises(WriteTimeoutError, match=r"Writer.flush\(\) did not complete within 0\.3 s"):
        writer.flush()
    assert writer._closed  # abandoned: its finalizer closes nothing more


def test_a_callers_own_timeout_stays_reverbs(client: BoundedClient) -> None:
    fill(client, "full_caller")
    writer = client.trajectory_writer(1)
    writer.append({"x": np.float32(2.0)})
    writer.create_item("full_caller", 1.0, {"x": writer.history["x"][-1:]})
    with pytest.raises(reverb.errors.DeadlineExceededError):
        writer.flush(timeout_ms=100)


def test_sampling_an_empty_table_times_out_naming_the_table_and_server(
    client: BoundedClient,
) -> None:
    with pytest.raises(
        SampleTimeoutError,
        match=r"table 'uniform': no item could be sampled "
        r"within 0\.3 s \(Timeouts.sample\); the server at 'localhost:\d+'",
    ):
        next(iter(client.sample("uniform", num_samples=1)))


def test_a_finite_sample_ends(client: BoundedClient) -> None:
    client.insert(np.float32(1.0), {"uniform": 1.0})
    assert len(list(client.sample("uniform", num_samples=3))) == 3


@pytest.mark.heavy
def test_server_info_of_a_server_that_is_not_there_is_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    timeouts = Timeouts(connect=0.2, write=1.0, sample=1.0, checkpoint=1.0)
    absent = BoundedClient(reverb.Client(f"localhost:{port}"), timeouts)
    with pytest.raises(ServerUnavailableError, match=rf"localhost:{port}"):
        absent.server_info()


def test_checkpoints_are_bounded_by_the_checkpoint_timeout(server: reverb.Server) -> None:
    address = f"localhost:{server.port}"
    client = BoundedClient(reverb.Client(address), TIMEOUTS)
    assert client.checkpoint()
    hurried = BoundedClient(reverb.Client(address), Timeouts(checkpoint=1e-6))
    # A checkpoint takes milliseconds; one may still finish within the microsecond where the
    # test's thread is held off the core by a loaded machine, so a few tries are allowed.
    errors = []
    for _ in range(5):
        try:
            hurried.checkpoint()
        except CheckpointError as e:
            errors.append(str(e))
            break
    assert errors, "five checkpoints each finished within 1e-06 s"
    assert re.search(
        rf"'{address}' did not finish a checkpoint within 1e-06 s \(Timeouts.checkpoint\)",
        errors[0],
    )


def test_a_pickled_client_reconnects_with_its_bounds(client: BoundedClient) -> None:
    copy = pickle.loads(pickle.dumps(client))
    assert isinstance(copy, BoundedClient) and copy.timeouts == TIMEOUTS
    assert repr(copy) == repr(client) == f"BoundedClient, server_address={client.server_address}"
    copy.insert(np.float32(4.0), {"uniform": 1.0})
    assert client.server_info()["uniform"].current_size == 1
    plain = client.plain_client
    assert type(plain) is reverb.Client and plain.server_address == client.server_address
    assert plain.server_info()["uniform"].current_size == 1

"""`packed_writers`: a packed writer's items reach the server without a flush, episodes end
without waiting, and unconfirmed items are counted and reported; on a real Reverb server."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import reverb
import tree

from replay_service.backends.reverb.packed_writers import (
    SEND_AFTER_S,
    PackedWindowWriter,
    count_pending,
    warn_unconfirmed,
)
from replay_service.backends.reverb.tables import make_table
from replay_service.config.options import TableConfig
from replay_service.specs.arrays import ArraySpec, trajectory_spec
from replay_service.specs.layout_registry import resolve_layout

SPEC = trajectory_spec(
    ArraySpec((2,), np.float32, "observation"), ArraySpec((), np.int64, "action")
)
LAYOUT = resolve_layout("packed", SPEC)


@pytest.fixture(scope="module")
def server() -> Iterator[reverb.Server]:
    table = TableConfig(name="rows", capacity=100, sequence_length=2, layout="packed")
    server = reverb.Server([make_table(table, SPEC)], port=None)
    yield server
    server.stop()


@pytest.fixture()
def client(server: reverb.Server) -> reverb.Client:
    client = reverb.Client(f"localhost:{server.port}")
    client.reset("rows")
    return client


def _step(value: int) -> Any:
    return tree.map_structure(lambda s: np.full(s.shape, value, s.dtype), SPEC)


def _size(client: reverb.Client) -> int:
    return client.server_info()["rows"].current_size


class _Flushes:
    """Stands for a writer's C++ `Flush(n, timeout_ms)` with `pending` unconfirmed items: it
    returns once at most `n` are pending, else raises Reverb's timeout (or `fails`)."""

    def __init__(self, pending: int, fails: bool = False) -> None:
        self.pending = pending
        self.fails = fails
        self.calls = 0

    def Flush(self, n: int, timeout_ms: int) -> None:  # noqa: N802 (Reverb's name)
        self.calls += 1
        if self.fails:
            raise RuntimeError("Writer stream closed")
        if n < self.pending:
            raise RuntimeError("DeadlineExceeded: Timeout exceeded before items confirmed")


@pytest.mark.parametrize("pending", [0, 1, 2, 3, 37, 64, 1000])
def test_pending_items_are_counted_in_a_logarithmic_number_of_flushes(pending: int) -> None:
    flushes = _Flushes(pending)
    assert count_pending(flushes) == pending
    assert flushes.calls <= 2 * max(1, pending).bit_length() + 2


def test_a_failed_writer_or_too_many_items_count_as_unknown() -> None:
    assert count_pending(_Flushes(5, fails=True)) is None
    assert count_pending(_Flushes(100), limit=64) is None


def test_the_warning_names_the_items_the_writers_and_the_wait(
    capsys: pytest.CaptureFixture[str],
) -> None:
    warn_unconfirmed(7, 2, 1.5)
    err = capsys.readouterr().err
    assert "7 item(s) written by 2 packed writer(s)" in err
    assert "within 1.5 s" in err
    warn_unconfirmed(None, 1, 30.0)
    assert "an unknown number of items" in capsys.readouterr().err


def test_items_reach_the_server_without_a_flush(client: reverb.Client) -> None:
    writer = PackedWindowWriter(client, [("rows", 2, 1, 1.0, False)], LAYOUT)
    for value in range(4):
        writer.append(_step(value))
    deadline = time.monotonic() + 20 * SEND_AFTER_S + 5
    while _size(client) < 3 and time.monotonic() < deadline:
        time.sleep(SEND_AFTER_S)
    assert _size(client) == 3
    assert writer.confirm(time.monotonic() + 5) == 0
    assert count_pending(writer._cpp) == 0
    writer.close()
    assert writer.confirm(time.monotonic()) == 0  # closed: nothing to wait for


def test_a_new_episode_starts_its_windows_afresh_without_waiting(client: reverb.Client) -> None:
    writer = PackedWindowWriter(client, [("rows", 2, 1, 1.0, False)], LAYOUT)
    writer.append(_step(0))
    assert writer.next_episode() is True
    writer.append(_step(1))  # no window spans the two episodes
    writer.append(_step(2))
    writer.end_episode(timeout_ms=5000)
    writer.append(_step(3))  # alone in its episode: no window
    writer.flush(timeout_ms=5000)
    assert _size(client) == 1
    (sample,) = client.sample("rows", num_samples=1, emit_timesteps=False)
    rows = np.asarray(sample.data[0])[None]
    assert LAYOUT.decode_columns([rows])[0][0].tolist() == [1, 2]
    writer.close()


def test_a_step_of_another_spec_is_refused(client: reverb.Client) -> None:
    writer = PackedWindowWriter(client, [("rows", 2, 1, 1.0, False)], LAYOUT)
    with pytest.raises(ValueError):
        writer.append({"observation": np.zeros([2], np.float32)})
    writer.close()

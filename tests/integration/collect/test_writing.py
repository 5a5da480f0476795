"""`collect.writing`: every client a manager hands out is a `WritingClient` whose writers the
collectors use, on both backends and both layouts; a client that hands out no writers is
refused by name."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import reverb

from replay_service.backends.reverb.layout_writers import StructuredWindowWriter
from replay_service.backends.reverb.packed_writers import PackedWindowWriter
from replay_service.collect.observer import TrajectoryObserver
from replay_service.collect.transitions import TransitionWriter
from replay_service.collect.writing import WindowWriter, WritingClient
from replay_service.errors import ConfigError

CASES = [("reverb", "nested"), ("reverb", "packed"), ("local", "nested")]


@pytest.mark.parametrize(("backend", "layout"), CASES, ids=["-".join(c) for c in CASES])
def test_collectors_write_through_the_clients_window_writers(
    make_manager: Any, backend: str, layout: str
) -> None:
    manager = make_manager(backend=backend, layout=layout)
    _, observer = manager.create_replay_buffer()
    assert isinstance(manager.py_client, WritingClient)
    assert observer.py_client is manager.py_client
    writer = manager.transition_writer()
    writer.add(np.zeros(4), 1, 1.0, np.ones(4), False)
    writer.add(np.ones(4), 0, 1.0, np.full(4, 2.0), True)
    opened = writer._envs.writers[0]
    assert isinstance(opened, WindowWriter)
    if backend == "reverb":
        expected = PackedWindowWriter if layout == "packed" else StructuredWindowWriter
        assert type(opened) is expected
    writer.close()
    assert manager.num_frames() == 2


def test_a_client_without_writers_is_refused(make_manager: Any, data_spec: Any) -> None:
    manager = make_manager(layout="nested")
    manager.create_replay_buffer()
    plain = reverb.Client(manager.server_address)
    for make in (TrajectoryObserver, TransitionWriter):
        with pytest.raises(ConfigError, match=r"hands out their writers .* got Client"):
            make(plain, manager.table_name, 2, data_spec)


def test_a_writer_whose_wait_fails_is_abandoned(make_manager: Any) -> None:
    """A packed writer that could not confirm its items at close is marked closed, so nothing
    (the flush at exit) waits for them again."""
    manager = make_manager(layout="packed")
    manager.create_replay_buffer()
    writer = manager.transition_writer()
    writer.add(np.zeros(4), 1, 1.0, np.ones(4), False)
    opened = writer._envs.writers[0]

    def fail(*args: Any, **kwargs: Any) -> None:
        raise reverb.errors.DeadlineExceededError("Timeout exceeded")

    opened.end_episode = fail  # type: ignore[method-assign]
    with pytest.raises(Exception, match="were not confirmed"):
        writer.close()
    assert opened._closed

"""`BufferLifecycle`: what each call may do before a buffer is opened, while it is open and
after the manager is closed, on a real (local) backend."""

from __future__ import annotations

import pytest

from conftest import FAST_TIMEOUTS
from replay_service import BufferStateError, ManagerClosedError
from replay_service.backends.configure import configure
from replay_service.backends.lifecycle import BufferLifecycle


def local_backend(data_spec, checkpoint_dir):
    implementation, options = configure(
        data_spec,
        100,
        str(checkpoint_dir),
        2,
        table_name="table",
        sampling=None,
        server_address=None,
        port=None,
        timeouts=FAST_TIMEOUTS,
        keep_checkpoints=3,
        stride_length=1,
        extra_tables=(),
        pad_end_of_episode=False,
        checkpoint_interval_s=None,
        backend="local",
        storage="memory",
        layout="nested",
        seed=0,
        device=None,
    )
    return implementation.from_options(options)


def test_lifecycle_checks_each_state(data_spec, tmp_path):
    backend = local_backend(data_spec, tmp_path / "ckpt")
    state = BufferLifecycle(backend)
    for call in (state.client, state.users_client, state.replay_buffer):
        with pytest.raises(BufferStateError, match=r"no buffer yet: call create_replay_buffer"):
            call()
    state.require_none()  # nothing open yet

    client = backend.create(False)
    replay_buffer = state.open(client, lambda: None)
    assert state.client() is client and state.replay_buffer() is replay_buffer
    assert state.users_client() is state.users_client()  # made once
    with pytest.raises(BufferStateError, match=r"already has a buffer"):
        state.require_none()

    state.closed = True
    state.close()
    for call in (state.client, state.replay_buffer, state.require_none):
        with pytest.raises(ManagerClosedError, match=r"is closed; create a new one"):
            call()
    assert backend.checkpoint_dir is not None  # the directory is released: a new backend opens it
    again = local_backend(data_spec, tmp_path / "ckpt")
    again.create(True)
    again.close()

"""The fast observer stores exactly what TF-Agents' ReverbAddTrajectoryObserver stores."""

from __future__ import annotations

import numpy as np
import pytest
from tf_agents.drivers import py_driver
from tf_agents.replay_buffers import reverb_utils

from conftest import all_items


def _contents(manager) -> list[bytes]:
    items = all_items(manager.py_client, manager.table_name, manager.num_frames())
    return sorted(b"".join(np.ascontiguousarray(x).tobytes() for x in d) for d in items.values())


@pytest.mark.parametrize(("sequence_length", "stride_length"), [(2, 1), (3, 2)])
def test_same_items_as_tf_agents_observer(
    make_manager, tmp_path, env, policy, sequence_length, stride_length
):
    steps = []
    py_driver.PyDriver(env, policy, [steps.append], max_steps=150).run(env.reset())

    ours = make_manager(
        checkpoint_dir=str(tmp_path / "ours"),
        sequence_length=sequence_length,
        stride_length=stride_length,
    )
    _, observer = ours.create_replay_buffer()
    theirs = make_manager(checkpoint_dir=str(tmp_path / "theirs"), sequence_length=sequence_length)
    theirs.create_replay_buffer()
    reference = reverb_utils.ReverbAddTrajectoryObserver(
        theirs.py_client, theirs.table_name, sequence_length, stride_length=stride_length
    )
    for step in steps:
        observer(step)
        reference(step)
    observer.flush()
    reference.flush()
    reference.close()

    assert ours.num_frames() == theirs.num_frames() > 0
    assert _contents(ours) == _contents(theirs)

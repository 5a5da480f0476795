"""`collect.view`, through the manager on the local backend: the collectors it hands out write
to every table of the buffer with its settings, join the buffer's writers (flushed by
`checkpoint()`, closed by `close()`), and are refused before the buffer exists or after it
closed."""

from __future__ import annotations

import numpy as np
import pytest

from replay_service import (
    BufferStateError,
    ConfigError,
    ManagerClosedError,
    SpecMismatchError,
    TableConfig,
)
from replay_service.collect.episode_padding import boundary_zeros
from replay_service.collect.observer import TrajectoryObserver
from replay_service.collect.transitions import TransitionWriter

RECENT = "recent"


def state(index: int) -> np.ndarray:
    return np.array([index, 0, 0, 0], np.float32)


def add_episode(writer: TransitionWriter, length: int) -> None:
    for i in range(length):
        writer.add(state(i), i % 2, 1.0, state(i + 1), i == length - 1)


def test_collectors_are_refused_before_the_buffer_exists_and_after_close(make_from_spaces):
    manager = make_from_spaces("local")
    with pytest.raises(BufferStateError, match="create_replay_buffer"):
        manager.transition_writer()
    with pytest.raises(BufferStateError, match="create_replay_buffer"):
        manager.observer()
    manager.create_replay_buffer()
    manager.close()
    with pytest.raises(ManagerClosedError):
        manager.transition_writer()
    with pytest.raises(ManagerClosedError):
        manager.observer()


def test_a_transition_writer_feeds_every_table_with_its_sequence_length(make_from_spaces):
    manager = make_from_spaces(
        "local",
        sequence_length=3,
        extra_tables=[TableConfig(name=RECENT, capacity=4, sequence_length=3)],
    )
    manager.create_replay_buffer()
    writer = manager.transition_writer()
    assert isinstance(writer, TransitionWriter)
    add_episode(writer, 6)  # 7 steps with the boundary: 5 windows of 3
    writer.flush()
    assert manager.num_frames() == 5
    assert manager.num_frames(table=RECENT) == 4  # its own capacity


def test_the_writers_priority_and_continuity_check_are_passed_on(make_from_spaces):
    manager = make_from_spaces("local")
    manager.create_replay_buffer()
    with pytest.raises(ConfigError, match="priority") as raised:
        manager.transition_writer(priority=-1.0)
    assert "-1.0" in str(raised.value)
    lenient = manager.transition_writer(check_continuity=False)
    lenient.add(state(0), 0, 1.0, state(1), False)
    lenient.add(state(5), 0, 1.0, state(6), False)  # not state(1): taken all the same
    strict = manager.transition_writer()
    strict.add(state(0), 0, 1.0, state(1), False)
    with pytest.raises(SpecMismatchError, match="not the next_state"):
        strict.add(state(5), 0, 1.0, state(6), False)


def test_observer_padding_flags_are_checked_naming_them(make_from_spaces):
    manager = make_from_spaces("local")
    manager.create_replay_buffer()
    assert isinstance(manager.observer(), TrajectoryObserver)
    with pytest.raises(ConfigError, match="pad_end_of_episodes must be True or False, got 'yes'"):
        manager.observer(pad_end_of_episodes="yes")
    with pytest.raises(ConfigError, match="tile_end_of_episodes=True needs pad_end_of_episodes"):
        manager.observer(tile_end_of_episodes=True)


def test_checkpoint_flushes_and_close_closes_every_collector_made(make_from_spaces, tmp_path):
    manager = make_from_spaces("local", name="ckpt")
    manager.create_replay_buffer()
    writers = [manager.transition_writer() for _ in range(2)]
    for writer in writers:
        add_episode(writer, 3)  # 3 windows of 2 each
    observer = manager.observer()
    manager.checkpoint()
    manager.close()
    for writer in writers:
        with pytest.raises(ManagerClosedError, match="writer is closed"):
            writer.add(state(0), 0, 1.0, state(1), False)
    with pytest.raises(ManagerClosedError, match="observer is closed"):
        observer(boundary_zeros(manager.data_spec))
    reloaded = make_from_spaces("local", name="ckpt")
    reloaded.load_replay_buffer()
    assert reloaded.num_frames() == 6

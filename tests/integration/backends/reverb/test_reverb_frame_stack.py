"""Frames stored once on Reverb (`frame_stack`): real Atari stacks of gymnasium's own wrappers
written through the manager's transition writer into an embedded Reverb server, each step
storing one frame (`specs.framed`), read back exactly by every read.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atari_frames import (
    breakout_manager,
    check_items,
    fill,
    interleave,
    items,
    laid_out,
    pairs,
    reads,
    recordings,
    scripted,
    stored,
    strided,
    write,
)
from replay_service import ConfigError, ReplayBufferManager, SpecMismatchError, Timeouts

pytest.importorskip("gymnasium")
pytest.importorskip("ale_py")
from gymnasium import spaces

FAST = Timeouts(connect=5.0, write=10.0, sample=5.0, checkpoint=60.0)


@pytest.fixture(scope="module")
def episodes() -> dict[str, list[tuple[Any, ...]]]:
    """Recorded Breakout transitions per padding (`atari_frames.recordings`)."""
    return recordings()


@pytest.fixture()
def make(make_from_spaces) -> Callable[..., ReplayBufferManager]:
    """Embedded Reverb frame-stacked managers of Breakout's spaces
    (`atari_frames.breakout_manager`)."""
    return functools.partial(breakout_manager, make_from_spaces, "reverb", timeouts=FAST)


def stacks(batch_states: Any, batch_next: Any) -> set[tuple[bytes, bytes]]:
    return {
        (np.asarray(s).tobytes(), np.asarray(n).tobytes())
        for s, n in zip(batch_states, batch_next, strict=True)
    }


@pytest.mark.heavy
@pytest.mark.parametrize(("padding", "axis"), [("reset", 0), ("zero", 0), ("zero", -1)])
def test_every_read_returns_the_envs_stacks(make, episodes, padding: str, axis: int) -> None:
    transitions = laid_out(episodes[padding], axis)
    manager = make(axis=axis)
    truth = fill(manager, transitions)
    seen: set[tuple[bytes, bytes]] = set()
    for count, batch in enumerate(manager.torch_batches(64, transitions=True)):
        got = stacks(batch.states.numpy(), batch.next_states.numpy())
        assert got <= truth  # 100%: every state and next state the env's
        seen |= got
        if count == 20:
            break
    # A terminal transition keeps its true next stack (the episode's final observation).
    terminal = {(s.tobytes(), n.tobytes()) for s, _, _, n, d, _ in transitions if d}
    assert terminal <= seen
    windows = next(iter(manager.torch_batches(32))).observation.numpy()
    assert windows.shape == (32, 2, *transitions[0][0].shape)
    assert stacks(windows[:, 0], windows[:, 1]) <= truth
    trajectory = next(iter(manager.get_dataset(batch_size=16)))[0]
    observation = trajectory.observation.numpy()
    assert observation.shape == (16, 2, *transitions[0][0].shape)
    assert stacks(observation[:, 0], observation[:, 1]) <= truth


@pytest.mark.heavy
def test_a_step_stores_one_frame_in_the_signature(make, episodes) -> None:
    manager = make()
    manager.create_replay_buffer()
    info = manager.py_client.server_info(5)[manager.table_name]
    # K - 1 + 2 rows of one 84x84 frame, the other fields and the mark.
    assert info.signature.shape.as_list()[0] == 5
    assert 84 * 84 < info.signature.shape.as_list()[1] < 84 * 84 + 64


@pytest.mark.heavy
def test_consecutive_frames_share_chunks(make, episodes) -> None:
    # Reverb compresses each chunk alone and a sampled item pays per chunk: steps of one frame
    # (~7 KB) are chunked CHUNK_STEPS together, not one per chunk.
    import tensorflow as tf

    transitions = episodes["reset"]
    manager = make()
    manager.create_replay_buffer()
    write(manager, transitions)
    (chunks,) = Path(manager.checkpoint()).rglob("chunks.tfrecord")
    sizes = [len(r.numpy()) for r in tf.data.TFRecordDataset(str(chunks), "ZLIB")]
    assert len(sizes) <= len(transitions) // 4
    # What the server holds per step: consecutive Breakout frames compress together.
    assert sum(sizes) / len(transitions) < 600


def test_stacks_that_are_no_shift_are_refused(make, episodes) -> None:
    transitions = episodes["reset"][:6]
    manager = make()
    manager.create_replay_buffer()
    writer = manager.transition_writer(check_continuity=False)
    for transition in transitions[:3]:
        writer.add(*transition)
    writer.flush()
    before = manager.num_frames()
    state, action, reward, next_state, done, cut = transitions[3]
    wrong = state.copy()
    wrong[1] ^= 1  # frame 1 is not frame 2 of the previous stack
    with pytest.raises(SpecMismatchError, match=r"step 3 of the episode: frame 1"):
        writer.add(wrong, action, reward, next_state, done, cut)
    writer.flush()
    assert manager.num_frames() == before
    writer.close()
    check_items(manager, transitions[:2])

    fresh = make("fresh")
    fresh.create_replay_buffer()
    unpadded = transitions[4][0]  # four different frames: no episode starts with it
    with (
        fresh.transition_writer() as other,
        pytest.raises(SpecMismatchError, match=r"step 0 starts an episode.*not a padded"),
    ):
        other.add(unpadded, 0, 0.0, transitions[4][3], False, False)
    assert fresh.num_frames() == 0


@pytest.mark.heavy
def test_checkpoints_keep_the_frame_stack(make, episodes) -> None:
    transitions = episodes["zero"]
    manager = make("source")
    manager.create_replay_buffer()
    write(manager, transitions)
    manager.checkpoint()
    before = items(manager)
    manager.close()

    loaded = make("source")
    loaded.load_replay_buffer()
    for got, want in zip(items(loaded), before, strict=True):
        np.testing.assert_array_equal(got, want)
    check_items(loaded, transitions)
    loaded.close()

    for options in ({"frame_stack": None}, {"frame_stack": 2, "capacity": 1000}):
        other = make("source", **options)
        with pytest.raises(SpecMismatchError, match=r"frame_stack: requested"):
            other.load_replay_buffer()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"layout": "nested"}, r"frame_stack=4 on Reverb stores one frame per step"),
        ({"pad_end_of_episode": True}, r"pad_end_of_episode"),
        ({"frame_stack": 3}, r"frame_stack=3: the observation's shape \[4, 84, 84\]"),
    ],
)
def test_what_the_reverb_frame_stack_cannot_do_is_refused(make, options, message) -> None:
    with pytest.raises(ConfigError, match=message):
        make(**options)


def test_a_remote_server_refuses_the_frame_stack() -> None:
    with pytest.raises(ConfigError, match=r"frame_stack=4 .*server_address='localhost:1'"):
        ReplayBufferManager.from_spaces(
            spaces.Box(0, 255, (4, 84, 84), np.uint8),
            spaces.Discrete(4),
            capacity=100,
            server_address="localhost:1",
            backend="reverb",
            frame_stack=4,
        )


@pytest.mark.heavy
def test_epochs_exports_and_imports_give_the_envs_stacks(make, episodes, tmp_path) -> None:
    transitions = episodes["reset"]
    truth = pairs(transitions)
    manager = make("source")
    manager.create_replay_buffer()
    write(manager, transitions)
    epoch: set[tuple[bytes, bytes]] = set()
    for batch in manager.epoch_batches(64, transitions=True):
        got = stacks(batch.states.numpy(), batch.next_states.numpy())
        assert got <= truth
        epoch |= got
    assert epoch == truth  # one pass over every item
    replay_buffer, _ = manager.get_replay_buffer_and_observer()
    trajectory, _ = next(iter(replay_buffer.as_dataset(sample_batch_size=8, num_steps=2)))
    observation = trajectory.observation.numpy()
    assert stacks(observation[:, 0], observation[:, 1]) <= truth
    with pytest.raises(ConfigError, match=r"num_steps=1: a frame-stacked table"):
        replay_buffer.as_dataset(sample_batch_size=8, num_steps=1)
    with pytest.raises(ConfigError, match=r"trajectory_writer\(\) of a frame-stacked"):
        manager.py_client.trajectory_writer(num_keep_alive_refs=2)

    manager.export(tmp_path / "export")
    imported = make("imported")
    imported.import_buffer(tmp_path / "export")
    check_items(imported, transitions)
    local = ReplayBufferManager.from_spaces(
        spaces.Box(0, 255, (4, 84, 84), np.uint8),
        spaces.Discrete(4),
        capacity=1000,
        checkpoint_dir=str(tmp_path / "local"),
        backend="local",
        frame_stack=4,
    )
    try:
        local.import_buffer(tmp_path / "export")
        observations = local._backend.read_items(local.table_config).data[1]
        assert {(o[0].tobytes(), o[1].tobytes()) for o in observations} == truth
    finally:
        local.close()


# Episodes of 1 step and of lengths that are no multiple of the chunks' `CHUNK_STEPS` rows.
LENGTHS = [1, 3, 5, 9, 2, 12, 1, 16, 7, 8, 1, 4]


@pytest.mark.heavy
@pytest.mark.parametrize(("padding", "stride"), [("reset", 3), ("zero", 3), ("reset", 1)])
def test_episodes_of_any_length_give_gymnasiums_stacks_at_every_stride(
    make_from_spaces, padding: str, stride: int
) -> None:
    """The writer counts its stride from each episode's start, as the local backend and
    TF-Agents do: the items are the windows `strided` names, and every stack of every read is
    gymnasium's `FrameStackObservation`'s."""
    transitions = scripted(LENGTHS, padding)
    want = strided(transitions, 2, stride)
    truth = set(want)
    managers = {
        backend: make_from_spaces(
            backend,
            backend,
            spaces.Box(0, 255, (4, 8, 8), np.uint8),
            spaces.Discrete(4),
            capacity=1000,
            frame_stack=4,
            stride_length=stride,
            timeouts=FAST,
        )
        for backend in ("reverb", "local")
    }
    for manager in managers.values():
        manager.create_replay_buffer()
        write(manager, transitions)
        observations = items(manager)[1]
        assert sorted((o[0].tobytes(), o[1].tobytes()) for o in observations) == sorted(want)
    manager = managers["reverb"]
    seen: set[tuple[bytes, bytes]] = set()
    for batch in itertools.islice(manager.torch_batches(16, transitions=True), 10):
        got = stacks(batch.states.numpy(), batch.next_states.numpy())
        assert got <= truth
        seen |= got
    epoch: set[tuple[bytes, bytes]] = set()
    for batch in manager.epoch_batches(8, transitions=True):
        epoch |= stacks(batch.states.numpy(), batch.next_states.numpy())
    assert epoch == truth
    mixed = manager.mixed_torch_batches(16, {manager.table_name: 1.0}, transitions=True)
    batch = next(iter(mixed))
    assert stacks(batch.states.numpy(), batch.next_states.numpy()) <= truth
    windows = next(iter(manager.torch_batches(16))).observation.numpy()
    assert stacks(windows[:, 0], windows[:, 1]) <= truth
    trajectory = next(iter(manager.get_dataset(batch_size=16)))[0]
    observation = trajectory.observation.numpy()
    assert stacks(observation[:, 0], observation[:, 1]) <= truth
    replay_buffer, _ = manager.get_replay_buffer_and_observer()
    trajectory, _ = next(iter(replay_buffer.as_dataset(sample_batch_size=16, num_steps=2)))
    observation = trajectory.observation.numpy()
    assert stacks(observation[:, 0], observation[:, 1]) <= truth


@pytest.mark.heavy
def test_an_import_of_a_reverb_export_stores_each_step_once(make_from_spaces, tmp_path) -> None:
    """Two writers interleave episodes of any length on Reverb: its export imported into a
    local table holds the frames and bytes the local writers' table holds for the same steps,
    and reads back the same stacks."""
    make = functools.partial(
        make_from_spaces,
        observation=spaces.Box(0, 255, (4, 8, 8), np.uint8),
        action=spaces.Discrete(4),
        capacity=1000,
        frame_stack=4,
        timeouts=FAST,
    )
    reverb, written = make("reverb", "reverb"), make("local", "written")
    truth = interleave(reverb, LENGTHS)
    assert interleave(written, LENGTHS) == truth
    reverb.export(tmp_path / "export")
    imported = make("local", "imported")
    imported.import_buffer(tmp_path / "export")
    assert stored(imported) == stored(written)
    got, epoch = reads(imported)
    assert epoch == truth
    want = items(reverb)
    assert sorted(o.tobytes() for o in got[1]) == sorted(o.tobytes() for o in want[1])


@pytest.mark.heavy
def test_a_stack_array_the_caller_refills_in_place_is_checked_and_stored_as_given(
    make, episodes
) -> None:
    # A vectorised environment fills the same stack array for every step.
    transitions = episodes["reset"][:8]
    manager = make()
    manager.create_replay_buffer()
    state = np.empty_like(transitions[0][0])
    next_state = np.empty_like(transitions[0][3])
    with manager.transition_writer() as writer:
        for transition in transitions:
            state[...], next_state[...] = transition[0], transition[3]
            writer.add(state, *transition[1:3], next_state, *transition[4:])
    check_items(manager, transitions)


def test_a_terminal_add_refused_for_its_final_stack_writes_nothing_and_can_be_retried(
    make, episodes
) -> None:
    transitions = episodes["reset"]
    end = next(i for i, t in enumerate(transitions) if t[4] or t[5]) + 1
    episode = transitions[:end]
    manager = make()
    manager.create_replay_buffer()
    with manager.transition_writer() as writer:
        for transition in episode[:-1]:
            writer.add(*transition)
        state, action, reward, next_state, done, truncated = episode[-1]
        unshifted = next_state.copy()
        unshifted[0] = 255 - unshifted[0]  # its oldest frame is not the state's second
        with pytest.raises(SpecMismatchError, match="frame 0"):
            writer.add(state, action, reward, unshifted, done, truncated)
        writer.add(state, action, reward, next_state, done, truncated)  # the corrected retry
    check_items(manager, episode)

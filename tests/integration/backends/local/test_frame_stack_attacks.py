"""Frame-stacked buffers (`frame_stack`) under unusual but valid data: each test writes
through a user's door and reads back the stacks exactly as they were given."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from replay_service import ReplayBufferManager, SpecMismatchError, Timeouts

spaces = pytest.importorskip("gymnasium").spaces

pytestmark = pytest.mark.local

FAST = Timeouts(connect=5.0, write=10.0, sample=2.0, checkpoint=60.0)
K = 4


@pytest.fixture()
def make(tmp_path) -> Iterator[Callable[..., ReplayBufferManager]]:
    """Local managers of `(K, 3, 3)` stacks; closed at teardown."""
    made: list[ReplayBufferManager] = []

    def factory(dtype: Any = np.uint8, **options: Any) -> ReplayBufferManager:
        options.setdefault("capacity", 50)
        manager = ReplayBufferManager.from_spaces(
            spaces.Box(0, 255, (K, 3, 3), dtype),
            spaces.Discrete(4),
            checkpoint_dir=str(tmp_path / f"ckpt{len(made)}"),
            backend="local",
            timeouts=FAST,
            seed=0,
            frame_stack=K,
            **options,
        )
        manager.create_replay_buffer()
        made.append(manager)
        return manager

    yield factory
    for manager in made:
        manager.close()


def episode(frames: list[np.ndarray]) -> list[tuple[Any, ...]]:
    """Transitions of one episode of `frames`, stacked as `FrameStackObservation` does
    (padding_type="reset"); the last one terminates."""
    stacks = [
        np.stack([frames[max(0, i - j)] for j in range(K - 1, -1, -1)]) for i in range(len(frames))
    ]
    last = len(stacks) - 2
    return [(stacks[i], 0, 1.0, stacks[i + 1], i == last, False) for i in range(len(stacks) - 1)]


def stored(manager: ReplayBufferManager) -> list[np.ndarray]:
    return list(manager._backend.read_items(manager.table_config).data[1])


def test_float_frames_holding_nan_are_stored_and_read_back_bit_for_bit(make) -> None:
    rng = np.random.default_rng(0)
    frames = [rng.random((3, 3)).astype(np.float32) for _ in range(6)]
    for frame in frames:
        frame[0, 0] = np.nan  # e.g. a masked pixel
    transitions = episode(frames)
    manager = make(np.float32)
    writer = manager.transition_writer()
    for transition in transitions:
        writer.add(*transition)
    items = stored(manager)
    assert len(items) == len(transitions)
    for (state, *_, next_state, _, _), item in zip(transitions, items, strict=True):
        assert item[0].tobytes() == state.tobytes()
        assert item[1].tobytes() == next_state.tobytes()


def test_float_frames_of_negative_zeros_are_read_back_bit_for_bit(make) -> None:
    rng = np.random.default_rng(1)
    frames = [rng.random((3, 3)).astype(np.float32) for _ in range(3)]
    frames += [np.full((3, 3), -0.0, np.float32) for _ in range(K)]  # e.g. a negated black screen
    frames += [rng.random((3, 3)).astype(np.float32) for _ in range(3)]
    transitions = episode(frames)
    manager = make(np.float32)
    writer = manager.transition_writer()
    for transition in transitions:
        writer.add(*transition)
    items = stored(manager)
    assert len(items) == len(transitions)
    for (state, *_, next_state, _, _), item in zip(transitions, items, strict=True):
        assert item[0].tobytes() == state.tobytes()
        assert item[1].tobytes() == next_state.tobytes()


@pytest.mark.parametrize("compression", [None, "lz4"])
def test_a_stack_array_the_caller_refills_in_place_is_stored_as_given(make, compression) -> None:
    # A vectorised environment fills the same stack array for every step: each step's stack
    # is checked against, and stored as, the previous step's values at its `add`.
    frames = [np.full((3, 3), 1 + i, np.uint8) for i in range(6)]
    manager = make(compression=compression)
    writer = manager.transition_writer()
    state, next_state = np.zeros((K, 3, 3), np.uint8), np.zeros((K, 3, 3), np.uint8)
    for transition in episode(frames):
        state[...], next_state[...] = transition[0], transition[3]
        writer.add(state, *transition[1:3], next_state, *transition[4:])
    writer.flush()
    expected = np.stack([np.stack(t[0::3]) for t in episode(frames)])
    np.testing.assert_array_equal(np.stack(stored(manager)), expected)


def test_a_terminal_add_refused_for_its_next_state_stack_can_be_retried(make) -> None:
    frames = [np.full((3, 3), 1 + i, np.uint8) for i in range(6)]
    transitions = episode(frames)
    manager = make()
    writer = manager.transition_writer()
    for transition in transitions[:-1]:
        writer.add(*transition)
    state, action, reward, next_state, done, truncated = transitions[-1]
    assert done
    unshifted = next_state.copy()
    unshifted[0] = 200  # its oldest frame is not the state's second
    with pytest.raises(SpecMismatchError, match="frame"):
        writer.add(state, action, reward, unshifted, done, truncated)
    writer.add(state, action, reward, next_state, done, truncated)  # the caller's corrected retry
    expected = np.stack([np.stack(t[0::3]) for t in transitions])
    np.testing.assert_array_equal(np.stack(stored(manager)), expected)


def test_add_multi_refused_for_one_envs_final_stack_writes_no_env(make) -> None:
    first = episode([np.full((3, 3), 1 + i, np.uint8) for i in range(6)])
    second = episode([np.full((3, 3), 100 + i, np.uint8) for i in range(6)])
    manager = make()
    writer = manager.transition_writer()

    def add(at: int, final: Any = None) -> None:
        pair = (first[at], second[at])
        done = np.array([t[4] for t in pair])
        writer.add_multi(
            np.stack([t[0] for t in pair]),
            np.array([t[1] for t in pair]),
            np.array([t[2] for t in pair], np.float32),
            np.stack([t[3] for t in pair]),
            done,
            np.zeros(2, bool),
            final_states=final,
        )

    for at in range(len(first) - 1):
        add(at)
    before = [np.asarray(field).copy() for field in items_of(manager)]
    last = len(first) - 1
    unshifted = second[last][3].copy()
    unshifted[0] = 250  # env 1's final stack does not follow its state
    with pytest.raises(SpecMismatchError, match="frame"):
        add(last, np.stack([first[last][3], unshifted]))
    after = items_of(manager)
    assert [len(field) for field in after] == [len(field) for field in before]


def items_of(manager: ReplayBufferManager) -> list[Any]:
    return manager._backend.read_items(manager.table_config).data


def test_a_ring_on_a_device_pads_float_stacks_holding_nan_and_negatives_with_zeros(make) -> None:
    # SB3's zero padding of episode starts: the padded frames read back as +0.0 even where
    # the ring's frame read in their place holds NaN or a negative value.
    rng = np.random.default_rng(2)
    frames = [-rng.random((3, 3)).astype(np.float32) for _ in range(6)]
    for frame in frames:
        frame[0, 0] = np.nan
    zero = np.zeros((3, 3), np.float32)
    stacks = [
        np.stack([frames[i - j] if i >= j else zero for j in range(K - 1, -1, -1)])
        for i in range(len(frames))
    ]
    transitions = [
        (stacks[i], 0, 1.0, stacks[i + 1], i == len(stacks) - 2, False)
        for i in range(len(stacks) - 1)
    ]
    truth = {(s.tobytes(), n.tobytes()) for s, _, _, n, _, _ in transitions}
    manager = make(np.float32, device="cpu")  # the device code path, on the host
    with manager.transition_writer() as writer:
        for _ in range(2):  # the second episode's padding reads the first one's frames
            for transition in transitions:
                writer.add(*transition)
    seen: set[tuple[bytes, bytes]] = set()
    with manager.torch_batches(8, transitions=True, device="cpu") as stream:
        for _, batch in zip(range(30), stream, strict=False):
            seen.update(
                (s.numpy().tobytes(), n.numpy().tobytes())
                for s, n in zip(batch.states, batch.next_states, strict=True)
            )
    assert seen == truth


@pytest.mark.parametrize("sequence_length", [4, 5])
def test_two_writers_whose_steps_first_interleave_in_a_next_step_keep_their_windows(
    make, sequence_length
) -> None:
    # Each writer's first item writes its window whole, one after the other in the ring; the
    # first writer's next step is the first whose predecessor is not the ring's last step.
    first = episode([np.full((3, 3), 1 + i, np.uint8) for i in range(10)])
    second = episode([np.full((3, 3), 100 + i, np.uint8) for i in range(10)])
    manager = make(sequence_length=sequence_length)
    writers = [manager.transition_writer(), manager.transition_writer()]
    for pair in zip(first, second, strict=True):
        for writer, transition in zip(writers, pair, strict=True):
            writer.add(*transition)
    for writer in writers:
        writer.close()

    def windows(transitions: list[tuple[Any, ...]]) -> set[bytes]:
        steps = [t[0] for t in transitions] + [transitions[-1][3]]
        return {
            np.stack(steps[i - sequence_length + 1 : i + 1]).tobytes()
            for i in range(sequence_length - 1, len(steps))
        }

    truth = windows(first) | windows(second)
    got = [np.asarray(item).tobytes() for item in stored(manager)]
    assert len(got) == len(truth)
    assert set(got) == truth

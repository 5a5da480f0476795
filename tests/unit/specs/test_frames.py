"""`specs.frames.FrameStack`: splitting stacks into frames and back, on both axes,
and the checks of what collectors write."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replay_service.errors import ConfigError, SpecMismatchError
from replay_service.specs.frames import FrameStack, check_frame_stack

pytestmark = pytest.mark.local


def stacks_of(frames: np.ndarray, axis: int) -> np.ndarray:
    """`[K, H, W]` frames -> a stack along axis 0 `(K, H, W)` or -1 `(H, W, K)`."""
    return frames.copy() if axis == 0 else np.moveaxis(frames, 0, -1).copy()


@pytest.mark.parametrize("axis", [0, -1])
def test_frames_and_assemble_are_inverse(axis: int) -> None:
    frames = np.arange(4 * 3 * 5, dtype=np.uint8).reshape(4, 3, 5)
    stack = stacks_of(frames, axis)
    fs = FrameStack(4, axis, 0, stack.shape)
    split = fs.frames(stack[None])[0]
    assert split.shape == (4, *fs.frame)
    np.testing.assert_array_equal(split.reshape(4, 3, 5), frames)
    np.testing.assert_array_equal(fs.part(stack, 3, 4).reshape(3, 5), frames[3])
    rebuilt = fs.assemble(torch.from_numpy(np.stack([split, split])))
    np.testing.assert_array_equal(rebuilt.numpy(), np.stack([stack, stack]))


def test_channels_of_several_frames_stay_together() -> None:
    """SB3's `VecFrameStack` of RGB frames: `(H, W, K*3)`, each frame 3 channels."""
    stack = np.arange(2 * 2 * 12, dtype=np.uint8).reshape(2, 2, 12)
    fs = FrameStack(4, -1, 0, stack.shape)
    assert fs.frame == (2, 2, 3)
    np.testing.assert_array_equal(fs.newest(stack[None])[0], stack[..., 9:])
    np.testing.assert_array_equal(
        fs.assemble(torch.from_numpy(fs.frames(stack[None]))).numpy()[0], stack
    )


@pytest.mark.parametrize("axis", [0, -1])
def test_paddings_and_shifts_are_checked(axis: int) -> None:
    frame = np.full((3, 5), 7, np.uint8)
    zero = np.zeros_like(frame)
    fs = FrameStack(4, axis, 0, stacks_of(np.stack([frame] * 4), axis).shape)
    reset = stacks_of(np.stack([frame] * 4), axis)
    zeros = stacks_of(np.stack([zero, zero, zero, frame]), axis)
    assert fs.padding(reset) == "reset"
    assert fs.padding(zeros) == "zero"
    fs.check_step(reset, None, 0, "w")
    fs.check_step(zeros, None, 0, "w")
    fs.check_step(np.zeros_like(reset), reset, 5, "w")  # an unknown final observation
    shifted = stacks_of(np.stack([zero, zero, frame, frame + 1]), axis)
    fs.check_step(shifted, zeros, 1, "w")
    with pytest.raises(SpecMismatchError, match=r"w: step 0 starts an episode"):
        fs.check_step(shifted, None, 0, "w")
    wrong = stacks_of(np.stack([zero, frame, frame, frame + 1]), axis)
    with pytest.raises(SpecMismatchError, match=r"w: step 1 of the episode: frame 1 of"):
        fs.check_step(wrong, zeros, 1, "w")
    windows = np.stack([np.stack([zeros, shifted]), np.stack([zeros, wrong])])
    with pytest.raises(SpecMismatchError, match=r"item 1, step 1: frame 1"):
        fs.check_windows(windows, "t")
    fs.check_windows(windows[:1], "t")


class Spec:
    """A `Trajectory`-like spec whose observation is one array spec."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.observation = np.zeros(shape, np.uint8)


@pytest.mark.parametrize(
    ("k", "axis", "shape", "message"),
    [
        (1, 0, (4, 8, 8), r"frame_stack must be an integer >= 2 or None, got 1"),
        (True, 0, (4, 8, 8), r"frame_stack must be an integer >= 2 or None, got True"),
        (2.0, 0, (4, 8, 8), r"got 2.0"),
        (4, 2, (4, 8, 8), r"frame_axis must be 0 or -1, got 2"),
        (3, 0, (4, 8, 8), r"shape \[4, 8, 8\] has no axis frame_axis=0 whose length"),
        (4, -1, (4, 8, 6), r"frame_axis=-1"),
    ],
)
def test_bad_frame_stacks_name_the_value(k, axis, shape, message) -> None:
    with pytest.raises(ConfigError, match=message):
        check_frame_stack(Spec(shape), k, axis)
    check_frame_stack(Spec(shape), None, 0)

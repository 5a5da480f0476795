"""`specs.framed.FramedLayout`: how its rows are read back (the Reverb frame-stack tests in
tests/integration/backends/reverb/test_reverb_frame_stack.py read real Atari stacks)."""

from __future__ import annotations

import numpy as np
import pytest

from replay_service.specs.arrays import ArraySpec
from replay_service.specs.framed import CONTINUES, RESET, ZERO, FramedLayout

pytestmark = pytest.mark.local


def layout() -> FramedLayout:
    spec = {
        "action": ArraySpec((), np.int64, "action"),
        "observation": ArraySpec((4, 3, 2), np.uint8, "observation"),
    }
    return FramedLayout(spec, 4, 0)


def test_torch_batches_rebuild_the_stacks_in_numpy() -> None:
    # Whatever the frame's size: TF ops in the pipeline cost more than the sampling itself.
    framed = layout()
    reader = object()

    def rows_reader(of: object) -> object:
        assert of is framed
        return reader

    assert framed.batch_reader(0, lambda flat: flat, rows_reader) == (reader, False)
    # A row does not decode alone: packers that read single steps' rows must not be used.
    assert not framed.steps_apart


def test_a_batch_of_rows_gives_every_stack() -> None:
    framed = layout()
    # Two items of 3 + 2 rows; frame i is filled with i; the second item's second step
    # starts an episode padded with zeros, the first item's first step one that repeats.
    frames = np.arange(10, dtype=np.uint8).reshape(2, 5, 1, 1, 1) * np.ones(
        (1, 1, 1, 3, 2), np.uint8
    )
    marks = np.array(
        [[CONTINUES, CONTINUES, CONTINUES, RESET, CONTINUES], [CONTINUES] * 4 + [ZERO]]
    )
    actions = np.arange(10, dtype=np.int64).reshape(2, 5)
    rows = np.stack(
        [
            framed.rows.pack_items(
                [actions[i : i + 1], frames[i : i + 1], marks[i : i + 1].astype(np.uint8)]
            )[0]
            for i in range(2)
        ]
    )
    action, observation = framed.unpack_leaves(rows)
    np.testing.assert_array_equal(action, actions[:, 3:])
    first = [stack[:, 0, 0] for stack in observation[0]]
    assert [s.tolist() for s in first] == [[3, 3, 3, 3], [3, 3, 3, 4]]
    second = [stack[:, 0, 0] for stack in observation[1]]
    assert [s.tolist() for s in second] == [[5, 6, 7, 8], [0, 0, 0, 9]]


@pytest.mark.parametrize("steps", [4, 5, 8, 9])
def test_looked_up_sources_are_those_computed_from_the_marks(steps: int) -> None:
    # Items of up to 8 steps find their frames' sources in a table of every mark sequence;
    # marks other than the three written read as RESET, as the computation reads them.
    from replay_service.specs.framed import _NumpyOps

    framed = layout()
    rng = np.random.default_rng(steps)
    every = (np.arange(3 ** min(steps, 6))[:, None] // 3 ** np.arange(steps)[None, :]) % 3
    marks = np.concatenate([every, rng.integers(0, 7, (500, steps))]).astype(np.uint8)
    index, zero = framed.sources(marks)
    want_index, want_zero = framed._sources(marks, _NumpyOps)
    np.testing.assert_array_equal(index, want_index)
    np.testing.assert_array_equal(zero, want_zero)
    assert index.shape == (len(marks), steps - 3, 4)


def test_float_frames_are_gathered_bit_for_bit() -> None:
    # Frames of 4-byte floats move as bytes: NaN and -0.0 come back as written, zero
    # padding as +0.0.
    spec = {
        "action": ArraySpec((), np.int64, "action"),
        "observation": ArraySpec((4, 3, 2), np.float32, "observation"),
    }
    framed = FramedLayout(spec, 4, 0)
    frames = np.arange(5, dtype=np.float32).reshape(1, 5, 1, 1, 1) * np.ones((1, 1, 1, 3, 2))
    frames = frames.astype(np.float32)
    frames[0, 3, 0, 0, 0] = np.nan
    frames[0, 4, 0, 0, 1] = -0.0
    marks = np.array([[CONTINUES, CONTINUES, CONTINUES, ZERO, CONTINUES]], np.uint8)
    rows = framed.rows.pack_items([np.arange(5, dtype=np.int64)[None], frames, marks])[0]
    action, observation = framed.unpack_leaves(rows[None])
    np.testing.assert_array_equal(action, [[3, 4]])
    assert observation.dtype == np.float32 and observation.shape == (1, 2, 4, 3, 2)
    want = np.zeros((2, 4, 3, 2), np.float32)
    want[0, 3], want[1, 2], want[1, 3] = frames[0, 3], frames[0, 3], frames[0, 4]
    np.testing.assert_array_equal(observation[0].view(np.uint32), want.view(np.uint32))

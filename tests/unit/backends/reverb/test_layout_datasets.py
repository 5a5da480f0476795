"""`layout_datasets`: a nested table's datasets and TF-Agents preprocessing are left as they
are; a packed table's sequences are unpacked before the caller's function sees them."""

from __future__ import annotations

import numpy as np
import tensorflow as tf
import tree

from replay_service.backends.reverb.layout_datasets import sequence_preprocess, unpack_samples
from replay_service.specs.arrays import ArraySpec, trajectory_spec
from replay_service.specs.layout_registry import resolve_layout

CARTPOLE = trajectory_spec(
    ArraySpec((4,), np.float32, "observation"), ArraySpec((), np.int64, "action")
)


def test_nested_reading_leaves_datasets_as_they_are() -> None:
    layout = resolve_layout("nested", CARTPOLE)
    dataset = object()
    assert unpack_samples(layout, dataset) is dataset
    assert sequence_preprocess(layout, None) is None
    assert sequence_preprocess(layout, len) is len


def test_packed_sequences_are_unpacked_before_the_callers_function() -> None:
    layout = resolve_layout("packed", CARTPOLE)
    step = tree.map_structure(lambda s: np.ones(s.shape, s.dtype), CARTPOLE)
    rows = tf.constant(np.stack([layout.encode_step(step)] * 3))
    seen = []

    def fn(data: object) -> str:
        seen.append(data)
        return "done"

    assert sequence_preprocess(layout, fn)(rows) == "done"
    np.testing.assert_array_equal(seen[0].observation.numpy(), np.ones([3, 4], np.float32))
    unpacked = sequence_preprocess(layout, None)(rows)
    assert unpacked.action.shape == (3,)

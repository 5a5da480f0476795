"""`specs.windows`: the stored spec of padded tables, padding steps and how many are needed.

`tests/integration/collect/test_sequences.py` checks `padding_needed` against a reference.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from replay_service.specs.arrays import ArraySpec, trajectory_spec
from replay_service.specs.windows import (
    MASK_DTYPE,
    Masked,
    padding_needed,
    padding_step,
    stored_spec,
)

SPEC = trajectory_spec(
    ArraySpec((3,), np.float32, "observation"), ArraySpec((), np.int64, "action")
)


def test_padding_needed_in_the_documented_shapes():
    assert padding_needed(0, 4, 1) == 0
    assert padding_needed(-3, 4, 1) == 0
    assert padding_needed(1, 4, 4) == 3  # a short episode: one padded item
    assert padding_needed(8, 4, 4) == 0  # whole items
    assert padding_needed(9, 4, 4) == 3
    assert padding_needed(100, 80, 40) == 20  # R2D2: windows at 0 and 40, the last to 120
    assert padding_needed(6, 2, 5) == 1  # the window at 5 reaches step 5


def test_stored_spec_is_the_data_spec_unless_the_table_pads():
    assert stored_spec(SPEC, False) is SPEC
    padded = stored_spec(SPEC, True)
    assert isinstance(padded, Masked)
    assert padded.step == SPEC and padded.mask == ArraySpec((), MASK_DTYPE, "mask")


def test_stored_spec_of_tf_specs_has_a_tf_mask():
    spec = {"x": tf.TensorSpec([2], tf.float32, "x")}
    padded = stored_spec(spec, True)
    assert padded.mask == tf.TensorSpec([], tf.bool, "mask")
    assert padded.step == spec


def test_padding_step_is_zeros_of_every_field_and_a_false_mask():
    padding = padding_step(SPEC)
    assert isinstance(padding, Masked) and padding.mask == np.False_
    assert padding.step.observation.dtype == np.float32 and padding.step.observation.shape == (3,)
    assert not padding.step.observation.any()
    assert padding.step.action.dtype == np.int64 and padding.step.action.shape == ()
    tf_padding = padding_step({"x": tf.TensorSpec([2, 2], tf.uint8)})
    assert tf_padding.step["x"].dtype == np.uint8 and tf_padding.step["x"].shape == (2, 2)

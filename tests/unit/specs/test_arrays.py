"""`specs.arrays`: numpy conversion, `ArraySpec` bounds and the specs of spaces and extras.

`tests/unit/test_portable.py` checks the rest without TensorFlow (shapes and dtypes refused,
the `Trajectory` fields, every kind of space).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import torch
from gymnasium import spaces

from replay_service.errors import ConfigError, SpecMismatchError
from replay_service.specs.arrays import (
    RESERVED_EXTRA_NAMES,
    TRAJECTORY_FIELDS,
    ArraySpec,
    Trajectory,
    extras_spec,
    is_tf_tensor,
    is_torch_tensor,
    space_spec,
    to_numpy,
    trajectory_spec,
)


def test_to_numpy_converts_numpy_torch_and_python_values():
    array = np.arange(3, dtype=np.float32)
    assert to_numpy(array) is array
    tensor = torch.arange(3, dtype=torch.float32, requires_grad=True) * 2
    converted = to_numpy(tensor)
    assert type(converted) is np.ndarray
    np.testing.assert_array_equal(converted, [0.0, 2.0, 4.0])
    assert is_torch_tensor(tensor) and not is_torch_tensor(array)
    assert not is_tf_tensor(tensor) and not is_tf_tensor(array)
    np.testing.assert_array_equal(to_numpy([[1, 2], [3, 4]]), np.array([[1, 2], [3, 4]]))


def test_to_numpy_converts_tf_tensors_and_variables():
    tensor = tf.constant([1, 2], tf.int64)
    variable = tf.Variable([0.5], dtype=tf.float32)
    assert is_tf_tensor(tensor) and is_tf_tensor(variable) and not is_torch_tensor(tensor)
    converted = to_numpy(tensor)
    assert type(converted) is np.ndarray and converted.dtype == np.int64
    np.testing.assert_array_equal(converted, [1, 2])
    np.testing.assert_array_equal(to_numpy(variable), np.array([0.5], np.float32))


def test_array_spec_takes_a_tf_dtype_and_a_scalar_shape():
    spec = ArraySpec(3, tf.float16, "x")
    assert spec.shape == (3,) and spec.dtype == np.dtype(np.float16)
    assert spec.zeros().dtype == np.float16
    with pytest.raises(SpecMismatchError, match=r"ArraySpec 'x': shape .*got True"):
        ArraySpec(True, np.float32, "x")


def test_array_spec_bounds_broadcast_and_are_kept_in_its_dtype():
    spec = ArraySpec((2, 3), np.int32, "a", minimum=0, maximum=[1, 2, 3])
    assert spec.minimum.dtype == np.int32 and spec.maximum.dtype == np.int32
    np.testing.assert_array_equal(spec.maximum, [1, 2, 3])
    with pytest.raises(SpecMismatchError, match=r"ArraySpec 'a': maximum \[1, 2\] does not fit"):
        ArraySpec((2, 3), np.int32, "a", maximum=[1, 2])
    with pytest.raises(SpecMismatchError, match="minimum 'low' does not fit shape"):
        ArraySpec((2,), np.float32, "a", minimum="low")


def test_array_spec_equality_compares_bounds_but_hashing_ignores_them():
    plain = ArraySpec((2,), np.float32, "a")
    bounded = ArraySpec((2,), np.float32, "a", minimum=0.0)
    assert plain != bounded and bounded != plain
    assert hash(plain) == hash(bounded)
    assert plain != ArraySpec((2,), np.float32, "b")
    assert plain != ArraySpec((2,), np.float64, "a")
    assert plain.__eq__((2,)) is NotImplemented


def test_trajectory_spec_has_tf_agents_scalars_and_the_given_nests():
    observation = ArraySpec((4,), np.float32, "observation")
    action = {"move": ArraySpec((2,), np.float32, "move")}
    spec = trajectory_spec(observation, action)
    assert isinstance(spec, Trajectory) and Trajectory._fields == TRAJECTORY_FIELDS
    assert spec.observation is observation and spec.action is action and spec.policy_info == ()
    assert spec.step_type == ArraySpec((), np.int32, "step_type")
    assert spec.next_step_type == ArraySpec((), np.int32, "next_step_type")
    assert spec.reward == ArraySpec((), np.float32, "reward")
    assert spec.discount == ArraySpec((), np.float32, "discount")


def test_float64_box_actions_are_stored_as_float32_and_observations_kept():
    box = spaces.Box(0.0, 1.0, (2, 3), np.float64)
    assert space_spec(box, "observation", is_action=False) == ArraySpec(
        (2, 3), np.float64, "observation"
    )
    assert space_spec(box, "action", is_action=True) == ArraySpec((6,), np.float32, "action")
    ints = spaces.Box(0, 5, (2, 2), np.int16)
    assert space_spec(ints, "action", is_action=True) == ArraySpec((4,), np.int16, "action")


def test_an_empty_tuple_space_is_refused_naming_its_role():
    with pytest.raises(ConfigError, match=r"the action space 'action' is empty: Tuple\(\)"):
        space_spec(spaces.Tuple(()), "action", is_action=True)


def test_extras_spec_keeps_the_order_and_names_each_leaf_by_its_key():
    extras = extras_spec(
        {
            "hidden": ((64,), np.float32),
            "log_prob": ArraySpec((), "float64", "ignored"),
            "logits": tf.TensorSpec([3], tf.float32),
            "option": spaces.Discrete(4),
        }
    )
    assert list(extras) == ["hidden", "log_prob", "logits", "option"]
    assert extras == {
        "hidden": ArraySpec((64,), np.float32, "hidden"),
        "log_prob": ArraySpec((), np.float64, "log_prob"),
        "logits": ArraySpec((3,), np.float32, "logits"),
        "option": ArraySpec((1,), np.int64, "option"),
    }


@pytest.mark.parametrize("extras", [None, {}])
def test_no_extras_is_tf_agents_empty_policy_info(extras):
    assert extras_spec(extras) == ()


def test_extras_with_an_unknown_tensor_shape_are_refused_naming_them():
    with pytest.raises(ConfigError, match=r"extra 'h': the shape must be fully known, got "):
        extras_spec({"h": tf.TensorSpec([None, 3], tf.float32)})
    with pytest.raises(ConfigError, match="extra 'h': the shape must be fully known"):
        extras_spec({"h": tf.TensorSpec(None, tf.float32)})


@pytest.mark.parametrize("name", sorted(RESERVED_EXTRA_NAMES))
def test_every_reserved_name_is_refused_as_an_extra(name):
    with pytest.raises(ConfigError, match=f"extra name {name!r} clashes"):
        extras_spec({name: ((), np.float32)})


def test_hidden_is_no_reserved_name_but_a_non_identifier_is_refused():
    assert "hidden" not in RESERVED_EXTRA_NAMES
    with pytest.raises(ConfigError, match="extra name 1 must be a Python identifier"):
        extras_spec({1: ((), np.float32)})
    with pytest.raises(ConfigError, match="extras must be a dict .*got tuple"):
        extras_spec((("h", ((), np.float32)),))  # type: ignore[arg-type]


def test_bytes_equal_compares_in_place_and_through_tobytes_alike() -> None:
    from replay_service.specs.arrays import bytes_equal

    array = np.arange(12, dtype=np.uint8).reshape(3, 4)
    assert bytes_equal(array, array.tobytes())
    assert not bytes_equal(array, array.tobytes()[:-1])  # a prefix is not equal
    assert not bytes_equal(array, array.tobytes() + b"\0")
    strided = array[:, ::2]  # not contiguous: through tobytes
    assert bytes_equal(strided, strided.tobytes())
    assert not bytes_equal(strided, array.tobytes()[: strided.nbytes])
    assert bytes_equal(np.float32(1.5), np.float32(1.5).tobytes())

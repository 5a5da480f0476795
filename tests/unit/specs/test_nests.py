"""`specs.nests`: table signatures, spec descriptions and their comparison, specs rebuilt.

`tests/unit/test_portable.py` checks that TF and `ArraySpec` specs of every space describe
alike; here each function's own rules and errors.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tensorflow as tf
import tree
from tf_agents.specs import tensor_spec
from tf_agents.trajectories import trajectory

from replay_service.errors import SpecMismatchError
from replay_service.specs import arrays as array_specs
from replay_service.specs.arrays import ArraySpec
from replay_service.specs.nests import (
    check_collect_spec,
    describe_spec,
    diff_descriptions,
    diff_value,
    flatten_with_paths,
    normalize_spec,
    numpy_dtype,
    spec_from_description,
    table_signature,
    to_array_spec,
    variable_container_spec,
)

ARRAY_SPEC = array_specs.trajectory_spec(
    {"pos": ArraySpec((2,), np.float32, "pos"), "id": ArraySpec((1,), np.int64, "id")},
    ArraySpec((), np.int64, "action"),
)


def field(path: str, dtype: str, shape: list[int]) -> dict:
    return {"path": path, "dtype": dtype, "shape": shape}


def test_flatten_with_paths_joins_keys_and_indices_in_tf_nest_order():
    nest = {"b": (1, {"c": 2}), "a": 3}
    assert flatten_with_paths(nest) == [("a", 3), ("b/0", 1), ("b/1/c", 2)]
    assert flatten_with_paths(5) == [("", 5)]


def test_normalize_spec_drops_bounds_and_keeps_names_and_kind():
    bounded = tensor_spec.BoundedTensorSpec([2], tf.int32, 0, 3, name="b")
    assert normalize_spec({"b": bounded}) == {"b": tf.TensorSpec([2], tf.int32, "b")}
    mixed = normalize_spec({"a": ArraySpec((1,), np.float32, "a"), "b": bounded})
    assert mixed == {
        "a": tf.TensorSpec([1], tf.float32, "a"),
        "b": tf.TensorSpec([2], tf.int32, "b"),
    }
    assert normalize_spec(ArraySpec((), np.int8, "x", 0, 1)) == ArraySpec((), np.int8, "x")


@pytest.mark.parametrize("empty", [(), {}, {"a": ()}], ids=["tuple", "dict", "nested"])
def test_normalize_spec_refuses_a_nest_without_leaves(empty):
    with pytest.raises(SpecMismatchError, match=re.escape(f"data_spec has no tensors: {empty!r}")):
        normalize_spec(empty)


def test_normalize_spec_names_the_root_when_it_is_no_spec():
    with pytest.raises(SpecMismatchError, match="field '<root>' is not a TensorSpec or ArraySpec"):
        normalize_spec(np.zeros(2))


def test_table_signature_adds_the_time_dimension_to_every_field():
    signature = table_signature(ARRAY_SPEC, 3)
    assert signature.observation["pos"] == tf.TensorSpec([3, 2], tf.float32, "pos")
    assert signature.action == tf.TensorSpec([3], tf.int64, "action")
    assert signature.reward == tf.TensorSpec([3], tf.float32, "reward")


def test_to_array_spec_refuses_an_unknown_dimension_naming_it():
    with pytest.raises(SpecMismatchError, match=r"has an unknown dimension: \[None, 4\]"):
        to_array_spec({"x": tf.TensorSpec([None, 4], tf.float32)})
    tf_trajectory = spec_from_description(describe_spec(ARRAY_SPEC), spec_type="tf")
    converted = to_array_spec(tf_trajectory)
    assert isinstance(converted, array_specs.Trajectory) and converted == ARRAY_SPEC


def test_check_collect_spec_makes_a_tf_trajectory_when_any_leaf_is_tf():
    mixed = ARRAY_SPEC._replace(reward=tf.TensorSpec([], tf.float32, "reward"))
    checked = check_collect_spec(mixed, "test")
    assert isinstance(checked, trajectory.Trajectory)
    assert all(isinstance(leaf, tf.TensorSpec) for leaf in tf.nest.flatten(checked))
    assert describe_spec(checked) == describe_spec(ARRAY_SPEC)
    with pytest.raises(SpecMismatchError) as raised:
        check_collect_spec((ArraySpec((1,), np.float32),), "ReplayBufferManager")
    assert str(raised.value).startswith("ReplayBufferManager needs a TF-Agents Trajectory")
    assert raised.value.args[0].endswith("got a tuple with fields ['0']")


def test_variable_container_spec_describes_each_variable_and_names_a_bad_one():
    variables = {"policy": [tf.Variable(np.zeros((3, 2), np.float32))], "step": np.int64(4)}
    assert variable_container_spec(variables) == {
        "policy": [tf.TensorSpec([3, 2], tf.float32)],
        "step": tf.TensorSpec([], tf.int64),
    }
    with pytest.raises(
        SpecMismatchError, match=r"variable 'policy/1' has no shape and dtype: float"
    ):
        variable_container_spec({"policy": [np.zeros(2), 0.5]})
    with pytest.raises(SpecMismatchError, match="variables hold no tensors: {}"):
        variable_container_spec({})


def test_describe_spec_gives_paths_dtypes_and_shapes_in_nest_order():
    assert describe_spec(ARRAY_SPEC) == [
        field("step_type", "int32", []),
        field("observation/id", "int64", [1]),
        field("observation/pos", "float32", [2]),
        field("action", "int64", []),
        field("next_step_type", "int32", []),
        field("reward", "float32", []),
        field("discount", "float32", []),
    ]
    assert describe_spec({"x": tf.TensorSpec([None], tf.uint8)}) == [field("x", "uint8", [None])]


def test_diff_descriptions_names_missing_unexpected_and_changed_fields_sorted():
    expected = [field("a", "float32", [2]), field("b", "int64", []), field("c", "int32", [])]
    actual = [field("a", "float64", [2]), field("c", "int32", [1]), field("d", "uint8", [3])]
    assert diff_descriptions(expected, actual) == [
        "field 'a': expected float32[2], found float64[2]",
        "field 'b' is missing (expected int64[])",
        "field 'c': expected int32[], found int32[1]",
        "field 'd' is unexpected (uint8[3])",
    ]
    assert diff_descriptions(expected, list(reversed(expected))) == []


def test_diff_value_of_tf_specs_takes_any_size_of_an_unknown_dimension():
    spec = {"x": tf.TensorSpec([None, 2], tf.float32)}
    assert diff_value({"x": np.zeros((5, 2), np.float32)}, spec) == []
    assert diff_value({"x": np.zeros((5, 3), np.float32)}, spec) == [
        "field 'x': expected float32[None, 2], got float32[5, 3]"
    ]
    assert diff_value([np.zeros((5, 2))], spec) == [
        "structure differs from the data spec: the step is a list, the data spec a dict"
    ]


@pytest.mark.parametrize("kind", ["array", "tf"])
def test_diff_value_names_a_dict_whose_keys_differ_from_the_spec(kind):
    spec = spec_from_description(describe_spec(ARRAY_SPEC), spec_type=kind)
    step = tree.map_structure(lambda s: np.zeros(s.shape, numpy_dtype(s)), to_array_spec(spec))
    assert diff_value(step, spec) == []
    renamed = step._replace(
        observation={"pos": step.observation["pos"], "ID": np.zeros(1, np.int64)}
    )
    assert diff_value(renamed, spec) == [
        "structure differs from the data spec: field 'observation' has keys ['ID', 'pos'], "
        "the data spec ['id', 'pos']"
    ]
    assert diff_value({"y": np.zeros(2, np.float32)}, {"x": ArraySpec((2,), np.float32)}) == [
        "structure differs from the data spec: the step has keys ['y'], the data spec ['x']"
    ]


def test_spec_from_description_nests_paths_and_fills_the_trajectory_defaults():
    fields = [field("observation/goal/id", "int64", [1]), field("action", "float32", [2])]
    spec = spec_from_description(fields, spec_type="array")
    assert isinstance(spec, array_specs.Trajectory)
    assert spec.observation == {"goal": {"id": ArraySpec((1,), np.int64, "id")}}
    assert spec.policy_info == ()
    assert spec.step_type == ArraySpec((), np.int32, "step_type")
    assert spec.discount == ArraySpec((), np.float32, "discount")
    as_dict = spec_from_description(fields, "dict", spec_type="tf")
    assert as_dict == {
        "observation": {"goal": {"id": tf.TensorSpec([1], tf.int64, "id")}},
        "action": tf.TensorSpec([2], tf.float32, "action"),
    }
    tf_spec = spec_from_description(fields, spec_type="tf")
    assert isinstance(tf_spec, trajectory.Trajectory)
    assert describe_spec(tf_spec) == describe_spec(spec)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ([field("x", "no_such_dtype", [1])], r"data spec field 'x' is invalid \("),
        ([{"path": "x", "dtype": "float32"}], r"field 'x' is invalid .*'shape'"),
        ([field("x", "float32", ["a"])], "field 'x' is invalid"),
        ([field("", "float32", [1])], "needs a path and shape >= 0"),
        ([field("x", "float32", [2, -1])], r"'shape': \[2, -1\]\} needs a path and shape >= 0"),
    ],
)
def test_spec_from_description_refuses_a_bad_field_naming_it(fields, match):
    with pytest.raises(SpecMismatchError, match=match):
        spec_from_description(fields, "dict", spec_type="array")


def test_spec_from_description_refuses_a_bad_structure_or_trajectory():
    fields = [field("observation", "float32", [2]), field("action", "int64", [])]
    with pytest.raises(
        SpecMismatchError, match="structure must be 'trajectory' or 'dict', got 'list'"
    ):
        spec_from_description(fields, "list", spec_type="array")
    with pytest.raises(SpecMismatchError, match=r"needs 'observation' and 'action'.*'state'"):
        spec_from_description([*fields, field("state", "float32", [1])], spec_type="array")
    with pytest.raises(SpecMismatchError, match=r"got fields \['action', 'discount'"):
        spec_from_description(fields[1:], spec_type="array")


def test_numpy_dtype_of_array_tf_and_tf_agents_specs():
    assert numpy_dtype(ArraySpec((), np.uint16)) == np.dtype(np.uint16)
    assert numpy_dtype(tf.TensorSpec([], tf.bool)) == np.dtype(bool)
    assert numpy_dtype(tensor_spec.BoundedTensorSpec([], tf.int64, 0, 1)) == np.dtype(np.int64)


def test_diff_value_lets_empty_policy_info_of_either_kind_pass():
    spec = ARRAY_SPEC._replace(policy_info=())
    step = tree.map_structure(lambda s: s.zeros(), spec)
    assert diff_value(step._replace(policy_info={}), spec) == []

"""`collect.transition_steps`: the fast conversion of values that already fit the spec, the full
validation of anything else, and the checks of flags, extras, final observations and episode
continuity, on a TF-Agents `Trajectory` spec of numpy `ArraySpec`s."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tf_agents.specs import array_spec
from tf_agents.trajectories import trajectory

from replay_service.collect.transition_steps import (
    FIRST,
    LAST,
    MID,
    Batch,
    FlatSteps,
    Leaf,
    Part,
    check_continues,
    fast_flag,
    fast_flags,
    final_observations,
    gather_extras,
    rows_equal,
    same_bytes,
)
from replay_service.errors import SpecMismatchError


def spec(policy_info=(), observation=None, action=None):
    """A per-step Trajectory spec: float32[3] observations, one int64 action, float32 reward."""
    return trajectory.Trajectory(
        step_type=array_spec.ArraySpec((), np.int32),
        observation=observation or array_spec.ArraySpec((3,), np.float32),
        action=action or array_spec.ArraySpec((), np.int64),
        policy_info=policy_info,
        next_step_type=array_spec.ArraySpec((), np.int32),
        reward=array_spec.ArraySpec((), np.float32),
        discount=array_spec.ArraySpec((), np.float32),
    )


def build(data_spec=None, *, batched, hidden=None, label="hidden", **overrides):
    """`Batch.build` of one good call (2 envs when batched), with `overrides` replacing values."""
    rows = 2 if batched else None

    def value(single, dtype):
        array = np.asarray(single, dtype)
        return np.stack([array] * rows) if batched else array

    values = {
        "state": value([0, 1, 2], np.float32),
        "action": value(1, np.int64),
        "reward": value(0.5, np.float32),
        "next_state": value([1, 2, 3], np.float32),
    }
    flags = {"done": value(False, bool), "truncated": value(False, bool)}
    for name, given in overrides.items():
        (values if name in values or name == "final_states" else flags)[name] = given
    return Batch.build(
        data_spec or spec(), values, flags, hidden, hidden_label=label, batched=batched
    )


# ---------------------------------------------------------------------------- fast conversion


def test_leaf_convert_takes_exact_values_and_casts_within_a_kind():
    leaf = Leaf(array_spec.ArraySpec((3,), np.float32))
    exact = np.zeros(3, np.float32)
    assert leaf.convert(exact)[0] is exact
    cast = leaf.convert(np.arange(3, dtype=np.float64))[0]
    assert cast.dtype == np.float32 and cast.tolist() == [0.0, 1.0, 2.0]
    assert leaf.convert(torch.ones(3))[0].dtype == np.float32
    assert leaf.convert(np.zeros(4, np.float32)) is None  # another shape
    assert leaf.convert(np.zeros(3, np.complex64)) is None  # not within the kind
    batch = leaf.convert(np.zeros((5, 3), np.float64), size=5)[0]
    assert batch.shape == (5, 3) and batch.dtype == np.float32
    assert leaf.convert(np.zeros((4, 3), np.float32), size=5) is None


def test_leaf_convert_of_scalars():
    scalar = Leaf(array_spec.ArraySpec((), np.float32))
    assert scalar.convert(np.float32(2.0)) == [np.float32(2.0)]
    converted = scalar.convert(2.5)[0]  # a Python float for a float leaf
    assert type(converted) is np.float32 and converted == 2.5
    assert Leaf(array_spec.ArraySpec((), np.int64)).convert(np.float64(1.0)) is None
    one = Leaf(array_spec.ArraySpec((1,), np.int64))  # a Discrete action stored as [1]
    assert one.convert(np.int64(3))[0].tolist() == [3]


def test_part_converts_a_nest_leaf_by_leaf_or_not_at_all():
    part = Part(
        {"a": array_spec.ArraySpec((2,), np.float32), "b": array_spec.ArraySpec((), np.int32)}
    )
    good = part.convert({"a": np.ones(2, np.float64), "b": np.int32(4)})
    assert [x.dtype for x in good] == [np.float32, np.int32]
    assert part.convert({"a": np.ones(2)}) is None  # another structure
    assert part.convert({"a": np.ones(3), "b": np.int32(4)}) is None  # a leaf of another shape
    assert [z.shape for z in part.zeros()] == [(2,), ()]


def test_all_finite_checks_only_floating_leaves_batched_or_not():
    part = Part(array_spec.ArraySpec((), np.float32))
    assert part.all_finite([np.float32(1.0)], batched=False)
    assert not part.all_finite([np.float32("inf")], batched=False)
    assert not part.all_finite([np.array([1.0, np.nan], np.float32)], batched=True)
    ints = Part(array_spec.ArraySpec((2,), np.int64))
    assert ints.all_finite([np.array([1, 2])], batched=False)


def test_flags_of_the_fast_path_are_booleans_only():
    assert fast_flag(True) is True and fast_flag(np.bool_(False)) is False
    assert fast_flag(1) is None and fast_flag(np.array(True)) is None
    flags = np.array([True, False])
    assert fast_flags(flags, 2) is flags
    assert fast_flags(np.array([1, 0]), 2) is None
    assert fast_flags(np.array([True]), 2) is None
    assert fast_flags(torch.tensor([True, False]), 2).tolist() == [True, False]


def test_same_bytes_and_rows_equal_treat_nan_as_equal_row_by_row():
    a = [np.array([[1.0, np.nan], [2.0, 3.0]], np.float32)]
    assert same_bytes(a, [a[0].tobytes()])
    assert not same_bytes(a * 2, [a[0].tobytes(), b"x"])
    b = [np.array([[1.0, np.nan], [2.0, 4.0]], np.float32)]
    assert rows_equal(a, b).tolist() == [True, False]
    ints = [np.array([1, 2]), np.array([[0, 0], [1, 1]])]
    assert rows_equal(ints, [np.array([1, 5]), np.array([[0, 0], [1, 1]])]).tolist() == [
        True,
        False,
    ]


def test_flat_steps_hold_the_constant_step_values_in_the_specs_dtypes():
    plan = FlatSteps(spec())
    assert (plan.first, plan.mid, plan.last) == (FIRST, MID, LAST)
    assert type(plan.first) is np.int32 and type(plan.terminal) is np.float32
    assert (plan.terminal, plan.continuing) == (0.0, 1.0)
    assert [x.shape for x in plan.unknown_final] == [(3,)]
    # The boundary step after its observation: zero action, next_step_type FIRST, reward 0,
    # discount 1.
    assert [np.asarray(x).item() for x in plan.boundary_tail] == [0, FIRST, 0.0, 1.0]


# --------------------------------------------------------------------------- full validation


def test_batch_build_casts_and_adds_a_batch_dimension_to_one_transition():
    batch = build(batched=False, done=1, truncated=np.array([0]))
    assert batch.size == 1
    assert batch.states[0].shape == (1, 3) and batch.states[0].dtype == np.float32
    assert batch.terminated.tolist() == [True] and batch.ended.tolist() == [True]
    assert build(batched=False, reward=np.array([2.0])).rewards[0].tolist() == [2.0]


def test_batch_build_of_several_envs():
    batch = build(batched=True, done=np.array([0, 1]), truncated=np.array([[True], [False]]))
    assert batch.size == 2
    assert batch.terminated.tolist() == [False, True]
    assert batch.ended.tolist() == [True, True]
    assert batch.final_states is None


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"done": np.array([0.5, 0])}, r"'done' must be booleans \(or 0/1\), got \[0.5, 0.0\]"),
        ({"done": np.array(["a", "b"])}, "'done' must be booleans"),
        ({"truncated": np.zeros((2, 2), bool)}, r"'truncated': expected shape \[2\], got \[2, 2\]"),
        ({"action": np.zeros(2, np.float64)}, "'action': expected dtype int64, got float64"),
        (
            {"state": np.zeros((0, 3)), "action": np.zeros(0, np.int64)},
            "batch sizes differ",
        ),
    ],
)
def test_batch_build_names_the_wrong_argument(overrides, match):
    with pytest.raises(SpecMismatchError, match=match):
        build(batched=True, **overrides)


def test_an_empty_batch_is_refused():
    empty = {name: np.zeros((0, 3), np.float32) for name in ("state", "next_state")}
    empty |= {"action": np.zeros(0, np.int64), "reward": np.zeros(0, np.float32)}
    empty |= {"done": np.zeros(0, bool), "truncated": np.zeros(0, bool)}
    with pytest.raises(SpecMismatchError, match="empty batch of 0 rows"):
        build(batched=True, **empty)


def test_nested_fields_are_named_by_path():
    nested = spec(
        observation={
            "pos": array_spec.ArraySpec((2,), np.float32),
            "vel": array_spec.ArraySpec((2,), np.float32),
        }
    )
    good = {"pos": np.zeros(2), "vel": np.zeros(2)}
    with pytest.raises(SpecMismatchError, match=r"'state/vel': expected float32\[2\]"):
        build(
            nested, batched=False, state={"pos": np.zeros(2), "vel": np.zeros(3)}, next_state=good
        )
    with pytest.raises(SpecMismatchError, match="'next_state': structure differs"):
        build(nested, batched=False, state=good, next_state={"pos": np.zeros(2)})


def test_policy_info_is_required_when_the_spec_has_one_and_refused_when_not():
    with_info = spec(policy_info={"log_prob": array_spec.ArraySpec((), np.float32)})
    with pytest.raises(SpecMismatchError, match=r"'hidden' is required: .*\['log_prob'\]"):
        build(with_info, batched=False)
    batch = build(with_info, batched=False, hidden={"log_prob": np.float64(-1.0)})
    assert batch.hiddens[0].dtype == np.float32 and batch.hiddens[0].tolist() == [-1.0]
    with pytest.raises(SpecMismatchError, match="'hiddens' was given, but .* policy_info is empty"):
        build(batched=True, hidden=np.zeros(2), label="hiddens")


# ---------------------------------------------------------------- extras, finals, continuity


def test_gather_extras_names_what_is_unknown_missing_or_given_twice():
    names = ("hidden", "log_prob")
    assert gather_extras(names, np.ones(2), {"log_prob": 1.0}, "hidden") == {
        "hidden": pytest.approx(np.ones(2)),
        "log_prob": 1.0,
    }
    with pytest.raises(SpecMismatchError, match=r"unknown extra\(s\) \['value'\]"):
        gather_extras(names, None, {"hidden": 1, "log_prob": 1, "value": 1}, "hidden")
    with pytest.raises(
        SpecMismatchError, match=r"extra\(s\) \['log_prob'\] required.*log_prob=\.\.\."
    ):
        gather_extras(names, None, {"hidden": 1}, "hidden")
    with pytest.raises(SpecMismatchError, match=r"either whole as hiddens= .*not both"):
        gather_extras(names, np.ones(2), {"log_prob": 1.0}, "hiddens")
    with pytest.raises(SpecMismatchError, match=r"\['speed'\]: the data spec declares no extras"):
        gather_extras((), None, {"speed": 1.0}, "hidden")


def test_final_observations_are_the_given_ones_or_zeros_after_terminations_only():
    terminated = build(batched=True, done=np.array([True, False]))
    finals = final_observations(terminated)
    assert finals[0].shape == (2, 3) and not finals[0].any()
    given = np.full((2, 3), 9.0, np.float32)
    with_finals = build(batched=True, final_states=given, truncated=np.array([False, True]))
    assert final_observations(with_finals)[0] is with_finals.final_states[0]
    truncated = build(batched=True, truncated=np.array([False, True]))
    with pytest.raises(SpecMismatchError, match=r"envs \[1\] were truncated.*final_states="):
        final_observations(truncated)


def test_check_continues_names_the_envs_whose_state_breaks_their_episode():
    states = [np.array([[0, 1], [2, 3], [4, 5]], np.float32)]
    expected = [np.array([[0, 1], [9, 9], [9, 9]], np.float32).tobytes()]
    check_continues(states, expected, [True, False, False], True, "states")  # only env 0 goes on
    with pytest.raises(SpecMismatchError, match=r"'states' of envs \[1, 2\] is not the next_state"):
        check_continues(states, expected, [True, True, True], True, "states")
    with pytest.raises(SpecMismatchError, match=r"^'state' is not the next_state"):
        check_continues(states[:1], expected, [False, True, False], False, "state")
    check_continues(states, [], [False, False, False], True, "states")  # nothing expected yet

"""`sample.batches`: how many batches a stream of independent draws fetches at once, and the
packers that turn flat data into item nests and `TransitionBatch`es, on every path a source
takes (whole windows, packed rows, single steps) - no server, no TensorFlow."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import tree

from replay_service.errors import ConfigError
from replay_service.sample.batches import (
    DRAW_BYTES,
    DRAW_ITEMS,
    STEP_COPY_BYTES,
    TransitionBatch,
    draws_per_call,
    item_packer,
    nest_packer,
    split_batches,
    step_of,
    to_transitions,
    transition_batch,
    transition_packer,
)
from replay_service.specs.arrays import ArraySpec, StepType, Trajectory
from replay_service.specs.packed import layout_of

FIRST, MID, LAST = StepType.FIRST, StepType.MID, StepType.LAST


def spec(policy_info=None, reward=None):
    return Trajectory(
        step_type=ArraySpec((), np.int32),
        observation={"a": ArraySpec((3,), np.float32), "b": ArraySpec((2,), np.int64)},
        action=ArraySpec((), np.int64),
        policy_info={"h": ArraySpec((2,), np.float32)} if policy_info is None else policy_info,
        next_step_type=ArraySpec((), np.int32),
        reward=reward or ArraySpec((), np.float32),
        discount=ArraySpec((), np.float32),
    )


def windows(structure, batch=4, steps=2):
    """Numpy columns `[batch, steps, ...]` in `tree.flatten` order: distinct values per leaf; the
    first steps end their episodes as MID / terminated / truncated / MID."""
    columns = []
    for index, leaf in enumerate(tree.flatten(structure)):
        shape = (batch, steps, *leaf.shape)
        columns.append((np.arange(np.prod(shape)).reshape(shape) + 100 * index).astype(leaf.dtype))
    named = tree.unflatten_as(structure, columns)
    named.next_step_type[:, 0] = [MID, LAST, LAST, MID][:batch]
    named.discount[:, 0] = [1.0, 0.0, 1.0, 0.0][:batch]
    return columns


def torch_of(columns):
    return [torch.from_numpy(c.copy()) for c in columns]


def assert_same(left, right):
    assert tree.flatten(left) is not None
    tree.assert_same_structure(left, right)
    for a, b in zip(tree.flatten(left), tree.flatten(right), strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_draws_per_call_is_bounded_by_items_and_bytes_and_is_at_least_one():
    assert draws_per_call(4, 100) == DRAW_ITEMS // 4
    assert draws_per_call(4, DRAW_BYTES // 8) == 2  # two batches fit the byte budget
    assert draws_per_call(4, DRAW_BYTES) == 1  # not even one does: still one
    assert draws_per_call(DRAW_ITEMS + 1, 1) == 1
    assert draws_per_call(4, 1, items=12) == 3
    assert draws_per_call(4, 0) == DRAW_ITEMS // 4  # zero-byte items divide nothing by zero


def test_split_batches_are_views_of_the_fetched_block():
    block = torch.arange(12).reshape(6, 2)
    assert split_batches([block], 6, 1) == [(block,)]
    parts = split_batches([block, block[:, 0]], 2, 3)
    assert [p.shape for p in parts[0]] == [(2, 2)] * 3 and len(parts[1]) == 3
    assert parts[0][1].data_ptr() == block[2:4].data_ptr()


def test_split_batches_of_a_strided_block_hold_its_values():
    block = torch.arange(24).reshape(12, 2)
    parts = split_batches([block[:, 1], block.t().contiguous().t()], 4, 3)
    assert [p.tolist() for p in parts[0]] == [[1, 3, 5, 7], [9, 11, 13, 15], [17, 19, 21, 23]]
    assert torch.equal(torch.cat(parts[1]), block)


def test_transition_batch_is_the_frozen_dataclass_its_constructor_builds():
    fields = {
        "states": torch.zeros(2, 3),
        "actions": torch.ones(2),
        "rewards": torch.ones(2),
        "next_states": torch.ones(2, 3),
        "dones": torch.tensor([True, False]),
        "truncated": torch.tensor([False, True]),
        "hiddens": None,
    }
    built, constructed = transition_batch(**fields), TransitionBatch(**fields)
    assert type(built) is TransitionBatch
    assert built == constructed and repr(built) == repr(constructed)
    assert hash(built) == hash(constructed)
    assert [f.name for f in dataclasses.fields(built)] == list(vars(built))
    assert all(getattr(built, name) is value for name, value in fields.items())
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.dones = fields["truncated"]  # type: ignore[misc]
    assert dataclasses.replace(built, hiddens=fields["states"]).hiddens is fields["states"]


def test_the_transition_packer_equals_to_transitions_of_the_item_nest():
    structure = spec()
    flat = torch_of(windows(structure))
    packer = transition_packer(structure)
    assert packer.prepare_rows is not None and packer.steps is not None  # the fast paths
    packed = packer(flat)
    expected = to_transitions(nest_packer(structure)(flat))
    assert isinstance(packed, TransitionBatch)
    for field in ("states", "actions", "rewards", "next_states", "dones", "truncated", "hiddens"):
        assert_same(getattr(packed, field), getattr(expected, field))
    assert packed.dones.tolist() == [False, True, False, False]
    assert packed.truncated.tolist() == [False, False, True, False]
    assert_same(packed.next_states["a"], flat[1][:, 1])  # flat[0] is step_type


@pytest.mark.parametrize(
    "observation, action",
    [
        (ArraySpec((4,), np.float32), ArraySpec((), np.int64)),  # CartPole's: single tensors
        (ArraySpec((4,), np.float32), (ArraySpec((), np.int64), ArraySpec((2,), np.float32))),
        ({"a": ArraySpec((3,), np.float32)}, ArraySpec((2,), np.float32)),
    ],
    ids=["tensors", "tuple-action", "dict-observation"],
)
def test_the_transition_packer_places_single_and_nested_fields(observation, action):
    structure = spec()._replace(observation=observation, action=action)
    flat = torch_of(windows(structure))
    packed = transition_packer(structure)(flat)
    expected = to_transitions(nest_packer(structure)(flat))
    for field in ("states", "actions", "rewards", "next_states", "dones", "truncated", "hiddens"):
        assert_same(getattr(packed, field), getattr(expected, field))
    assert_same(tree.flatten(packed.next_states)[0], flat[1][:, 1])  # flat[0] is step_type


def test_packed_rows_and_single_steps_give_what_whole_windows_give():
    structure = spec()
    columns = windows(structure)
    packer = transition_packer(structure)
    expected = packer.prepare(torch_of(columns))
    layout = layout_of(structure)
    rows = layout.pack_items(columns)
    assert_same(packer.prepare_rows(layout, rows), expected)
    read = [torch.from_numpy(columns[i][:, s].copy()) for i, s in packer.steps]
    assert_same(packer.prepare_steps(read), expected)


def test_an_empty_policy_info_gives_no_hiddens():
    structure = spec(policy_info=())
    packed = transition_packer(structure)(torch_of(windows(structure)))
    assert packed.hiddens is None
    assert to_transitions(nest_packer(structure)(torch_of(windows(structure)))).hiddens is None


def test_a_nested_reward_is_packed_through_the_item_nest():
    structure = spec(reward={"r1": ArraySpec((), np.float32), "r2": ArraySpec((), np.float32)})
    packer = transition_packer(structure)
    assert packer.prepare_rows is None and packer.steps is None
    packed = packer(torch_of(windows(structure)))
    assert set(packed.rewards) == {"r1", "r2"} and packed.rewards["r1"].shape == (4,)
    assert packed.dones.tolist() == [False, True, False, False]


@pytest.mark.parametrize("make", [transition_packer, lambda s: to_transitions])
def test_windows_of_other_lengths_are_refused_naming_the_length(make):
    structure = spec()
    flat = torch_of(windows(structure, steps=3))
    call = make(structure)
    with pytest.raises(ConfigError, match="transitions need windows of 2 steps, got 3"):
        call(flat) if call is not to_transitions else call(nest_packer(structure)(flat))


def test_the_packed_rows_path_refuses_other_lengths_too():
    structure = spec()
    columns = windows(structure, steps=1)
    layout = layout_of(structure)
    with pytest.raises(ConfigError, match="got 1"):
        transition_packer(structure).prepare_rows(layout, layout.pack_items(columns))


def test_item_packer_keeps_every_step():
    structure = spec()
    flat = torch_of(windows(structure, steps=3))
    item = item_packer(structure)(flat)
    assert isinstance(item, Trajectory) and item.observation["b"].shape == (4, 3, 2)
    assert item.observation["a"] is flat[1]


def test_nest_packer_falls_back_to_tree_for_other_nests():
    class Mapping(dict):
        """A dict subclass: not rebuilt by the packer's own calls."""

    structure = {"x": Mapping(a=1, b=2), "y": [3, (4,)]}
    packed = nest_packer(structure)([10, 20, 30, 40])
    assert packed == {"x": {"a": 10, "b": 20}, "y": [30, (40,)]}
    assert type(packed["x"]) is Mapping


def test_step_of_copies_small_steps_and_views_large_ones():
    small = torch.arange(24, dtype=torch.float32).reshape(4, 2, 3)
    step = step_of(small, 1)
    assert step.is_contiguous() and step.tolist() == small[:, 1].tolist()
    step[0, 0] = -1.0
    assert small[0, 1, 0] == 3.0  # a copy
    large_width = STEP_COPY_BYTES // 4 + 1
    large = torch.zeros(2, 2, large_width)
    view = step_of(large, 0)
    assert view.data_ptr() == large.data_ptr() and not view.is_contiguous()


@pytest.mark.parametrize(
    "tensor",
    [
        torch.ones(3, 2, 2, requires_grad=True),  # no numpy view: autograd
        torch.ones(3, 2, 2, dtype=torch.bfloat16),  # no numpy dtype
    ],
)
def test_step_of_tensors_numpy_cannot_view_is_still_a_contiguous_step(tensor):
    step = step_of(tensor, 1)
    assert step.is_contiguous() and step.shape == (3, 2) and step.dtype == tensor.dtype

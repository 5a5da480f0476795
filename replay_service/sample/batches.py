"""What a torch stream yields: transition batches, sample info, and the packers that build them.

A torch sample source (the Reverb table's `backends.reverb.torch_source.SampleSource`, the local
backend's `backends.local.sampling.LocalSampleSource`) reads a batch as flat tensors, in
`tree.flatten(signature)` order; a `Packer` turns them into the item nest (`item_packer`) or a
`TransitionBatch` (`transition_packer`; see its docstring for the exact mapping from TF-Agents
step types and discounts), and the sample info into `TorchSampleInfo`. A source of independent
draws fetches `draws_per_call` batches at once and hands them out one by one (`split_batches`).
No TensorFlow is imported.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import tree

from replay_service.errors import ConfigError
from replay_service.specs.arrays import StepType
from replay_service.specs.packed import PackedLayout

LAST = StepType.LAST
TRANSITION_SEQUENCE_LENGTH = 2
# A torch stream of a table of independent draws (`SamplingConfig.independent_draws`) fetches
# up to this many items, and this many bytes, at once (at least one batch), then hands them
# out batch by batch: the per-fetch work (TensorFlow's `GetNext`, the unpacking copies and
# transition flags, or a local table's lock and selection) is paid once for several small
# batches.
DRAW_ITEMS = 256
DRAW_BYTES = 1 << 20


def draws_per_call(batch_size: int, item_bytes: int, items: int = DRAW_ITEMS) -> int:
    """Batches of `batch_size` items of `item_bytes` a stream of independent draws fetches at
    once: as many as fit in `items` items (default `DRAW_ITEMS`) and `DRAW_BYTES` bytes, at
    least 1."""
    by_bytes = DRAW_BYTES // max(1, batch_size * item_bytes)
    return max(1, min(items // batch_size, by_bytes))


def split_batches(
    tensors: Sequence[torch.Tensor], batch_size: int, draws: int
) -> list[Sequence[torch.Tensor]]:
    """Per tensor, its `draws` consecutive batches of `batch_size` items (views)."""
    if draws == 1:
        return [(t,) for t in tensors]
    rows = batch_size * draws  # `unbind` of a `[draws, batch_size]` view: cheaper than `split`
    head = (draws, batch_size)
    # `reshape` and `shape` are torch's own calls (`unflatten` and `len` go through Python).
    return [
        t.reshape(head + t.shape[1:]).unbind(0) if t.shape[0] == rows else t.split(batch_size)
        for t in tensors
    ]


@dataclasses.dataclass(frozen=True)
class TransitionBatch:
    """One batch of transitions, read from 2-step TF-Agents `Trajectory` windows.

    A TF-Agents trajectory step `t` holds `step_type[t]`, `observation[t]`, `action[t]` and
    `policy_info[t]` together with what followed the action: `reward[t]`, `discount[t]` and
    `next_step_type[t]`. An episode ends after step `t` when `next_step_type[t]` is LAST; the
    step after it is the boundary step holding the episode's final observation. Environment
    termination gives `discount 0`; a time limit (truncation) keeps `discount 1`. For a window
    `[:, 0:2]` this gives, per item:

    - `states` = `observation[:, 0]`, `actions` = `action[:, 0]`, `rewards` = `reward[:, 0]`,
      `next_states` = `observation[:, 1]` (each a nest if the spec's field is one);
    - `dones` = `next_step_type[:, 0] == LAST and discount[:, 0] == 0`: the transition
      reached a terminal state; do not bootstrap from `next_states`;
    - `truncated` = `next_step_type[:, 0] == LAST and discount[:, 0] != 0`: the episode ended
      without termination (e.g. a time limit); `next_states` is its real final observation,
      bootstrap from it as from any other;
    - `hiddens` = `policy_info[:, 0]` (a nest), or None when the spec's `policy_info` is empty.

    `dones` and `truncated` are `torch.bool` of shape `[batch]`, never both True. The seeds'
    `dones = terminated | truncated` is `dones | truncated`. Windows written by replay_service
    never start at a boundary step, so every item is a real transition. A field whose step
    holds at most `STEP_COPY_BYTES` per item (vectors, scalars) is a contiguous copy of its
    step (a small network's forward and backward pass over strided views of the windows costs
    more than the copy: measured with the benchmark's training loop); larger ones (images) are
    views into the sampled windows; with frames stored once (`frame_stack=`) `states` and
    `next_states` are views of one gather and share their K-1 common frames, so an in-place
    change of one shows in the other (a cast or a scale copies). `rewards` keeps the spec's
    shape (`[batch]` for a scalar).

    Attributes:
      states: Observations before the action.
      actions: Actions taken.
      rewards: Rewards received for them.
      next_states: Observations after the action.
      dones: The transition terminated the episode.
      truncated: The transition ended the episode without terminating it.
      hiddens: Policy info (e.g. an actor's hidden state), or None.
    """

    states: Any
    actions: Any
    rewards: torch.Tensor
    next_states: Any
    dones: torch.Tensor
    truncated: torch.Tensor
    hiddens: Any | None


_new_object = object.__new__


def transition_batch(
    *,
    states: Any,
    actions: Any,
    rewards: torch.Tensor,
    next_states: Any,
    dones: torch.Tensor,
    truncated: torch.Tensor,
    hiddens: Any | None,
) -> TransitionBatch:
    """`TransitionBatch(...)` built once per batch of a stream: the same frozen object, its
    fields set at once (a frozen dataclass's `__init__` sets each through
    `object.__setattr__`, a few microseconds per batch of a loop whose batches take tens).

    Args:
      states, actions, rewards, next_states, dones, truncated, hiddens: The fields.

    Returns:
      The batch, equal to `TransitionBatch(...)` of the same fields.
    """
    batch = _new_object(TransitionBatch)
    batch.__dict__.update(
        states=states,
        actions=actions,
        rewards=rewards,
        next_states=next_states,
        dones=dones,
        truncated=truncated,
        hiddens=hiddens,
    )
    return batch


class TorchSampleInfo(NamedTuple):
    """Reverb's per-item sample info as tensors of shape `[batch]`.

    Attributes:
      key: Item keys (`torch.uint64`), e.g. for `py_client.mutate_priorities`.
      probability: Probability of selecting each item (`float64`).
      table_size: Items in the table when sampled (`int64`).
      priority: Priority of each item (`float64`).
      times_sampled: Times each item was sampled, this time included (`int32`).
    """

    key: torch.Tensor
    probability: torch.Tensor
    table_size: torch.Tensor
    priority: torch.Tensor
    times_sampled: torch.Tensor


def to_transitions(trajectory: Any) -> TransitionBatch:
    """Turns a batch of 2-step trajectory windows (torch tensors) into a `TransitionBatch`.

    Args:
      trajectory: A TF-Agents `Trajectory` of tensors shaped `[batch, 2, ...]`.

    Returns:
      The transitions; see `TransitionBatch` for the exact semantics.

    Raises:
      ConfigError: If the windows do not have exactly 2 steps.
    """
    _check_transition_steps(trajectory.step_type.shape[1])
    dones, truncated = _episode_flags(trajectory.next_step_type, trajectory.discount)
    policy_info = trajectory.policy_info
    return TransitionBatch(
        states=_step(trajectory.observation, 0),
        actions=_step(trajectory.action, 0),
        rewards=_step(trajectory.reward, 0),
        next_states=_step(trajectory.observation, 1),
        dones=dones,
        truncated=truncated,
        hiddens=_step(policy_info, 0) if tree.flatten(policy_info) else None,
    )


_TRANSITION_FIELDS = ("step_type", "observation", "action", "policy_info", "next_step_type")
_TRANSITION_SCALARS = ("step_type", "next_step_type", "reward", "discount")


@dataclasses.dataclass(frozen=True)
class Packer:
    """Turns a batch's flat data tensors (in `tree.flatten(signature)` order) into what a
    stream yields: `build(prepare(flat))`, also `packer(flat)`.

    `prepare` does the per-batch work on whole tensors and returns flat tensors whose first
    dimension is still the batch, so a source that draws several batches at once prepares
    them together and builds each from slices (`build([t[a:b] for t in prepared])`).

    Attributes:
      prepare: Flat data tensors -> flat tensors `[batch, ...]`.
      build: Those (or slices of them along the batch) -> the yielded object.
      prepare_rows: Optionally, `prepare` of a batch of a packed table given as its rows
        (`PackedLayout`, numpy `uint8[batch, sequence_length, step_bytes]`), copying only the
        bytes it keeps instead of unpacking every field first; None: unpack, then `prepare`.
      steps: Optionally, the `(flat field, step)` pairs of windows of
        `TRANSITION_SEQUENCE_LENGTH` steps that `prepare_steps` needs: a source that reads
        single steps (a local table) reads only those, one tensor `[batch, ...]` per pair,
        instead of every field's window. Windows of other lengths go through `prepare`.
      prepare_steps: `prepare` of those tensors (set with `steps`).
    """

    prepare: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]
    build: Callable[[Sequence[torch.Tensor]], Any]
    prepare_rows: Callable[[PackedLayout, np.ndarray], list[torch.Tensor]] | None = None
    steps: tuple[tuple[int, int], ...] | None = None
    prepare_steps: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]] | None = None

    def __call__(self, flat: Sequence[torch.Tensor]) -> Any:
        return self.build(self.prepare(flat))


def item_packer(structure: Any) -> Packer:
    """A `Packer` of the item nest of `structure` (`nest_packer`)."""
    return Packer(list, nest_packer(structure))


def stream_packer(structure: Any, transitions: bool) -> Packer:
    """The `Packer` of a stream's batches of `structure`: `transition_packer` with
    `transitions`, else `item_packer`."""
    return transition_packer(structure) if transitions else item_packer(structure)


def transition_packer(structure: Any) -> Packer:
    """A `Packer` of `TransitionBatch`: `packer(flat)` equals
    `to_transitions(nest_packer(structure)(flat))`, with the positions of the fields in the
    flat list found once.

    Args:
      structure: The item nest: a TF-Agents `Trajectory` (any namedtuple with its fields).
        Other nests (e.g. the `Masked` items of padded tables), and trajectories whose
        reward, discount or step types are nests, are packed and passed to `to_transitions`
        (which takes a nested reward; the others fail there as they are not trajectories).
    """
    nested = nest_packer(structure)
    fields = getattr(type(structure), "_fields", ())
    positions = tree.unflatten_as(structure, list(range(len(tree.flatten(structure)))))
    if not (
        isinstance(structure, tuple)
        and set(_TRANSITION_FIELDS) | {"reward", "discount"} <= set(fields)
        and all(not tree.is_nested(getattr(positions, f)) for f in _TRANSITION_SCALARS)
    ):
        return Packer(list, lambda flat: to_transitions(nested(flat)))
    step_type, next_step_type, reward, discount = (
        getattr(positions, f) for f in _TRANSITION_SCALARS
    )
    observations = tree.flatten(positions.observation)
    actions = tree.flatten(positions.action)
    hiddens = tree.flatten(positions.policy_info)
    # The prepared list: states, actions, reward (first steps), next states (second steps),
    # dones, truncated, hiddens (first steps).
    first_steps = [*observations, *actions, reward]
    n_obs = len(observations)
    pack_hiddens = nest_packer(structure.policy_info)
    at_reward = n_obs + len(actions)
    at_next = at_reward + 1
    at_dones = at_next + n_obs
    at_hiddens = at_dones + 2

    def prepare(flat: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        _check_transition_steps(flat[step_type].shape[1])
        dones, truncated = _episode_flags(flat[next_step_type], flat[discount])
        return [
            *(step_of(flat[i], 0) for i in first_steps),
            *(step_of(flat[i], 1) for i in observations),
            dones,
            truncated,
            *(step_of(flat[i], 0) for i in hiddens),
        ]

    def prepare_rows(layout: PackedLayout, rows: np.ndarray) -> list[torch.Tensor]:
        _check_transition_steps(rows.shape[1])
        first, second = rows[:, 0], rows[:, 1]
        ends = layout.leaf(first, next_step_type) == LAST
        terminated = ends & (layout.leaf(first, discount) == 0)
        return [
            *(torch.from_numpy(layout.leaf(first, i)) for i in first_steps),
            *(torch.from_numpy(layout.leaf(second, i)) for i in observations),
            torch.from_numpy(terminated),
            torch.from_numpy(ends ^ terminated),
            *(torch.from_numpy(layout.leaf(first, i)) for i in hiddens),
        ]

    # The steps kept (as `prepare` keeps them), then the two that give the flags.
    kept = (*((i, 0) for i in first_steps), *((i, 1) for i in observations))
    steps = (*kept, (next_step_type, 0), (discount, 0), *((i, 0) for i in hiddens))

    def prepare_steps(read: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        dones, truncated = _step_flags(read[len(kept)], read[len(kept) + 1])
        return [*read[: len(kept)], dones, truncated, *read[len(kept) + 2 :]]

    make = transition_batch
    states_at = _part(structure.observation, 0, n_obs)
    actions_at = _part(structure.action, n_obs, at_reward)
    next_states_at = _part(structure.observation, at_next, at_dones)

    def build(prepared: Sequence[torch.Tensor]) -> TransitionBatch:
        return make(
            states=states_at(prepared),
            actions=actions_at(prepared),
            rewards=prepared[at_reward],
            next_states=next_states_at(prepared),
            dones=prepared[at_dones],
            truncated=prepared[at_dones + 1],
            hiddens=pack_hiddens(prepared[at_hiddens:]) if hiddens else None,
        )

    return Packer(prepare, build, prepare_rows, steps, prepare_steps)


def _part(structure: Any, start: int, end: int) -> Callable[[Sequence[Any]], Any]:
    """`lambda prepared: nest_packer(structure)(prepared[start:end])`: for a single tensor
    (`structure` no nest) the tensor at `start`, without the slice and the call."""
    if not tree.is_nested(structure):
        return operator.itemgetter(start)
    pack = nest_packer(structure)
    return lambda prepared: pack(prepared[start:end])


def _check_transition_steps(steps: int) -> None:
    if steps != TRANSITION_SEQUENCE_LENGTH:
        raise ConfigError(
            f"transitions need windows of {TRANSITION_SEQUENCE_LENGTH} steps, got {steps}; "
            "sample nested trajectories instead (transitions=False)"
        )


def nest_packer(structure: Any) -> Callable[[Sequence[Any]], Any]:
    """Returns `pack(flat)`, equal to `tree.unflatten_as(structure, flat)`, built once.

    Tuples, lists, namedtuples and dicts (keys in sorted order, as `tree` flattens them) are
    rebuilt by calls made ahead for this structure; `tree.unflatten_as` walks and checks the
    whole structure on every call (about 10 us for a `Trajectory`, per batch). Other nests
    (attrs classes, mappings that are not dicts...) fall back to `tree.unflatten_as`.

    Args:
      structure: The nest (its leaves are ignored).
    """
    count = len(tree.flatten(structure))
    position = 0

    def build(node: Any) -> Callable[[Sequence[Any]], Any] | None:
        nonlocal position
        if not tree.is_nested(node):
            index = position
            position += 1
            return operator.itemgetter(index)
        kind = type(node)
        if kind in (tuple, list) or (isinstance(node, tuple) and hasattr(kind, "_fields")):
            parts = [build(child) for child in node]
            if any(part is None for part in parts):
                return None
            if kind is tuple:
                return lambda flat: tuple([part(flat) for part in parts])
            if kind is list:
                return lambda flat: [part(flat) for part in parts]
            return lambda flat: kind(*[part(flat) for part in parts])
        if kind is dict:
            keys = sorted(node)
            parts = [build(node[key]) for key in keys]
            if any(part is None for part in parts):
                return None
            return lambda flat: {key: part(flat) for key, part in zip(keys, parts, strict=True)}
        return None

    pack = build(structure)
    if pack is None or position != count:
        return lambda flat: tree.unflatten_as(structure, list(flat))
    return pack


def _episode_flags(
    next_step_type: torch.Tensor, discount: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(dones, truncated)` of the first step of each window (`_step_flags`)."""
    return _step_flags(next_step_type[:, 0], discount[:, 0])


def _step_flags(
    next_step_type: torch.Tensor, discount: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(dones, truncated)` of a batch of steps `[batch]`: a transition that ends its episode
    (next step LAST) terminated if its discount is 0, else it was truncated.

    On the CPU the flags are computed in numpy (a few microseconds for a batch against about
    25 for the same torch calls, once per batch of a training loop), elsewhere in torch.
    """
    if next_step_type.device.type == "cpu" and discount.device.type == "cpu":
        ends = next_step_type.numpy() == LAST
        terminated = ends & (discount.numpy() == 0)
        return torch.from_numpy(terminated), torch.from_numpy(ends ^ terminated)
    ends = next_step_type == LAST
    continuing = discount != 0
    return ends & ~continuing, ends & continuing


def _step(value: Any, index: int) -> Any:
    """Step `index` of every tensor of `value` (a tensor or a nest): `step_of` each."""
    if isinstance(value, torch.Tensor):
        return step_of(value, index)
    return tree.map_structure(lambda x: step_of(x, index), value)


# Steps of at most this many bytes per item are copied out of their windows; larger ones
# (images) stay views, which a learner's first operation (a cast, a scale) copies anyway.
STEP_COPY_BYTES = 4096


def step_of(tensor: torch.Tensor, index: int) -> torch.Tensor:
    """`tensor[:, index]`: a contiguous copy if one item's step holds at most
    `STEP_COPY_BYTES` (on the CPU through numpy: about 2 us for a small batch, against 3 for
    torch's own calls; pinned memory stays pinned), else a view."""
    if math.prod(tensor.shape[2:]) * tensor.element_size() > STEP_COPY_BYTES:
        return tensor.select(1, index)
    # Only a process that initialized CUDA can hold pinned memory; asking an unpinned tensor
    # initializes CUDA, which fails in a DataLoader worker forked from a process that had.
    pinned = tensor.device.type == "cpu" and torch.cuda.is_initialized() and tensor.is_pinned()
    if tensor.device.type == "cpu" and not pinned:
        try:
            return torch.from_numpy(tensor.numpy()[:, index].copy())
        except (TypeError, RuntimeError):  # no numpy view: autograd, bfloat16, conjugate...
            pass
    step = tensor.select(1, index).contiguous()
    return step.pin_memory() if pinned else step

"""How transitions become TF-Agents trajectory steps: the values of one call checked and cast.

`TransitionWriter` (`collect.transitions`) writes each transition as one trajectory step in
`tree.flatten` order of the data spec. Here is what it converts with: the spec flattened once
(`FlatSteps`: each field's leaves, `Part`/`Leaf`, and the constant step values), the fast
conversion of values that already have the spec's shapes and dtypes (`Part.convert`), and the
full validation that converts anything else or names the argument and field that is wrong
(`Batch.build`), with the checks of extras, final observations and episode continuity.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tree

from replay_service.errors import SpecMismatchError
from replay_service.specs.arrays import bytes_equal, to_numpy
from replay_service.specs.nests import flatten_with_paths

# TF-Agents' `StepType` values.
FIRST = 0
MID = 1
LAST = 2
TERMINAL_DISCOUNT = 0.0
CONTINUING_DISCOUNT = 1.0


class Leaf:
    """One flattened spec leaf: its numpy dtype and per-step shape."""

    __slots__ = ("dtype", "finite_scalar", "inexact", "scalar_type", "shape")

    def __init__(self, spec: Any) -> None:
        self.dtype = np.dtype(_np_dtype(spec))
        self.shape: tuple[int, ...] = tuple(int(d) for d in spec.shape)
        scalar = self.shape == ()
        self.scalar_type = self.dtype.type if scalar else None
        self.inexact = np.issubdtype(self.dtype, np.inexact)
        self.finite_scalar = scalar and self.dtype.kind == "f"

    def convert(self, value: Any, size: int | None = None) -> list[Any] | None:
        """`value` as this leaf's dtype, or None if it is not exactly what the leaf takes.

        Args:
          value: One value (numpy, torch or Python).
          size: Leading batch dimension the value must have; None for none.

        Returns:
          A one-element list: an array (or numpy scalar) of shape `[size, *shape]` (`shape`
          without `size`); or None when the value has another shape, or a dtype that is not cast
          within its kind.
        """
        kind = type(value)
        if kind is np.ndarray:
            array = value
        elif kind is self.scalar_type and size is None:
            return [value]
        elif kind is float and self.finite_scalar and size is None:
            return [self.scalar_type(value)]
        elif kind is int or kind is float or kind is bool:
            array = np.asarray(value)  # what `to_numpy` gives, without looking for tensors
        else:
            array = to_numpy(value)
        if size is None:
            if array.shape != self.shape:
                if array.shape != () or self.shape != (1,):
                    return None
                array = array.reshape(1)  # a scalar for a one-element leaf (Discrete actions)
        elif array.shape[:1] != (size,) or array.shape[1:] != self.shape:
            return None
        dtype = array.dtype
        if dtype is not self.dtype and dtype != self.dtype:
            if not _same_kind(dtype, self.dtype):
                return None
            array = array.astype(self.dtype)
        return [array]


class Part:
    """The leaves of one spec field (observation, action, reward or policy info)."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.nested = tree.is_nested(spec)
        self.leaves = [Leaf(leaf) for leaf in tree.flatten(spec)]
        self._single = None if self.nested else self.leaves[0]
        # Flattens and converts a value of this field: one array per leaf, or None if the value
        # needs the full validation (see `Leaf.convert`).
        self.convert: Callable[..., list[Any] | None] = (
            self._convert_nest if self._single is None else self._single.convert
        )

    def _convert_nest(self, value: Any, size: int | None = None) -> list[Any] | None:
        """`convert` for a nested field."""
        try:
            tree.assert_same_structure(self.spec, value, check_types=False)
        except (ValueError, TypeError):
            return None
        out: list[Any] = []
        for leaf, item in zip(self.leaves, tree.flatten(value), strict=True):
            array = leaf.convert(item, size)
            if array is None:
                return None
            out += array
        return out

    def convert_optional(self, value: Any, size: int | None = None) -> list[Any] | None:
        """`convert` of a field that may be left out (None), as policy info is.

        Args:
          value: The field's value; None when not given.
          size: Leading batch dimension the value must have; None for none.

        Returns:
          One array per leaf; `[]` for None when the field has no leaves; None when the value
          needs the full validation (a value left out of a field with leaves, or given for one
          without).
        """
        if not self.leaves:
            return [] if value is None else None
        return None if value is None else self.convert(value, size)

    def all_finite(self, arrays: list[Any], batched: bool) -> bool:
        """Whether no value of these (converted) leaves is NaN or infinite.

        Args:
          arrays: What `convert` returned.
          batched: Whether they have a batch dimension.

        Returns:
          True if every value is finite (or not a floating point one).
        """
        single = self._single
        if single is not None and single.finite_scalar and not batched:
            return math.isfinite(arrays[0])
        for leaf, array in zip(self.leaves, arrays, strict=True):
            if not leaf.inexact:
                continue
            if leaf.finite_scalar and not batched:
                if not math.isfinite(array):
                    return False
            elif not np.isfinite(array).all():
                return False
        return True

    def zeros(self) -> list[np.ndarray]:
        """One zero value per leaf (no batch dimension)."""
        return [np.zeros(leaf.shape, leaf.dtype) for leaf in self.leaves]


class FlatSteps:
    """A Trajectory spec flattened once: its fields' leaves and the constant step values.

    A step is written as a flat list in `tree.flatten(spec)` order (Trajectory field order),
    which is what the StructuredWriter's pattern indexes: no nest is packed per step.

    Args:
      spec: The normalized per-step Trajectory spec.
    """

    def __init__(self, spec: Any) -> None:
        self.observation = Part(spec.observation)
        self.action = Part(spec.action)
        self.reward = Part(spec.reward)
        self.hidden = Part(spec.policy_info)
        step_type = np.dtype(_np_dtype(spec.step_type)).type
        next_step_type = np.dtype(_np_dtype(spec.next_step_type)).type
        discount = np.dtype(_np_dtype(spec.discount)).type
        self.first, self.mid, self.last = step_type(FIRST), step_type(MID), step_type(LAST)
        self.next_mid, self.next_last = next_step_type(MID), next_step_type(LAST)
        self.terminal = discount(TERMINAL_DISCOUNT)
        self.continuing = discount(CONTINUING_DISCOUNT)
        # The final observation of a terminated episode that add_multi was not given.
        self.unknown_final = self.observation.zeros()
        # The boundary step after the observation: zero action and policy info, next_step_type
        # FIRST, zero reward and discount 1.
        self.boundary_tail = [
            *self.action.zeros(),
            *self.hidden.zeros(),
            next_step_type(FIRST),
            *self.reward.zeros(),
            self.continuing,
        ]


def fast_flag(value: Any) -> bool | None:
    """A Python or numpy bool as `bool`; None for anything else."""
    if value is True or value is False:
        return value
    if type(value) is np.bool_:
        return bool(value)
    return None


def fast_flags(value: Any, size: int) -> np.ndarray | None:
    """A `[size]` boolean array as is; None for anything else."""
    array = value if type(value) is np.ndarray else to_numpy(value)
    if array.dtype != bool or array.shape != (size,):
        return None
    return array


def same_bytes(arrays: list[Any], expected: list[bytes]) -> bool:
    """Whether every array's bytes are the expected ones (then the values are equal too)."""
    if len(arrays) == 1:
        return bytes_equal(arrays[0], expected[0])
    return all(bytes_equal(a, e) for a, e in zip(arrays, expected, strict=True))


_SAME_KIND: dict[tuple[np.dtype, np.dtype], bool] = {}


def _same_kind(given: np.dtype, want: np.dtype) -> bool:
    """Whether `given` is cast to `want` (as the full validation does), memoized."""
    key = (given, want)
    allowed = _SAME_KIND.get(key)
    if allowed is None:
        allowed = _SAME_KIND[key] = bool(np.can_cast(given, want, casting="same_kind"))
    return allowed


class Batch:
    """One call's validated values as flat lists of `[size, ...]` arrays in spec order."""

    def __init__(self, **fields: Any) -> None:
        self.size: int = fields["size"]
        self.states: list[np.ndarray] = fields["states"]
        self.actions: list[np.ndarray] = fields["actions"]
        self.hiddens: list[np.ndarray] = fields["hiddens"]
        self.rewards: list[np.ndarray] = fields["rewards"]
        self.next_states: list[np.ndarray] = fields["next_states"]
        self.final_states: list[np.ndarray] | None = fields["final_states"]
        self.terminated: np.ndarray = fields["terminated"]
        self.ended: np.ndarray = fields["ended"]

    @classmethod
    def build(
        cls,
        spec: Any,
        values: dict[str, Any],
        flags: dict[str, Any],
        hidden: Any,
        *,
        hidden_label: str,
        batched: bool,
    ) -> Batch:
        """Validates and casts one call's arguments (see `TransitionWriter.add`/`add_multi`).

        Raises:
          SpecMismatchError: Naming the argument (and field) that is wrong.
        """
        names = list(values)
        state, action, reward, next_state = names[:4]
        specs_of = {
            state: spec.observation,
            action: spec.action,
            reward: spec.reward,
            next_state: spec.observation,
        }
        if "final_states" in values:
            specs_of["final_states"] = spec.observation
        leaves = {name: _leaves(name, values[name], specs_of[name]) for name in specs_of}
        leaves[hidden_label] = _hidden_leaves(hidden_label, hidden, spec.policy_info)
        flag_arrays = {name: to_numpy(value) for name, value in flags.items()}
        size = _batch_size(leaves, flag_arrays) if batched else 1
        cast = {
            name: [
                _cast(label, array, leaf_spec, size, batched) for label, array, leaf_spec in items
            ]
            for name, items in leaves.items()
        }
        rewards = cast[reward]
        for label, leaf in zip((label for label, _, _ in leaves[reward]), rewards, strict=True):
            _check_finite(label, leaf, batched)
        done_name, truncated_name = list(flags)
        terminated = _flags(done_name, flag_arrays[done_name], size, batched)
        truncated = _flags(truncated_name, flag_arrays[truncated_name], size, batched)
        return cls(
            size=size,
            states=cast[state],
            actions=cast[action],
            hiddens=cast[hidden_label],
            rewards=rewards,
            next_states=cast[next_state],
            final_states=cast.get("final_states"),
            terminated=terminated,
            ended=terminated | truncated,
        )


def _leaves(name: str, value: Any, spec: Any) -> list[tuple[str, np.ndarray, Any]]:
    """Pairs each leaf of `value` with its spec; a non-nested spec takes `value` whole."""
    if not tree.is_nested(spec):
        return [(name, to_numpy(value), spec)]
    try:
        tree.assert_same_structure(spec, value, check_types=False)
    except (ValueError, TypeError) as e:
        raise SpecMismatchError(f"{name!r}: structure differs from the data spec: {e}") from e
    return [
        (f"{name}/{path}", to_numpy(leaf), leaf_spec)
        for (path, leaf_spec), leaf in zip(
            flatten_with_paths(spec), tree.flatten(value), strict=True
        )
    ]


def _hidden_leaves(label: str, value: Any, spec: Any) -> list[tuple[str, np.ndarray, Any]]:
    if not tree.flatten(spec):
        if value is not None and tree.flatten(value):
            raise SpecMismatchError(
                f"{label!r} was given, but the data spec's policy_info is empty"
            )
        return []
    if value is None:
        raise SpecMismatchError(
            f"{label!r} is required: the data spec's policy_info is "
            f"{[p for p, _ in flatten_with_paths(spec)]}"
        )
    return _leaves(label, value, spec)


def _batch_size(leaves: dict[str, list[tuple[str, np.ndarray, Any]]], flags: dict[str, Any]) -> int:
    sizes: dict[str, int | None] = {
        label: (array.shape[0] if array.ndim else None)
        for items in leaves.values()
        for label, array, _ in items
    }
    sizes.update({name: (a.shape[0] if a.ndim else None) for name, a in flags.items()})
    unbatched = sorted(label for label, size in sizes.items() if size is None)
    if unbatched:
        raise SpecMismatchError(
            f"add_multi needs a leading batch dimension (one row per env), {unbatched} have none"
        )
    if len(set(sizes.values())) != 1:
        shown = ", ".join(f"{label} {size}" for label, size in sizes.items())
        raise SpecMismatchError(f"batch sizes differ: {shown}")
    size = int(next(iter(sizes.values())))
    if size == 0:
        raise SpecMismatchError(
            "add_multi needs at least one env (one row per env), got an empty batch of 0 rows"
        )
    return size


def _cast(label: str, array: np.ndarray, spec: Any, size: int, batched: bool) -> np.ndarray:
    """Checks shape and dtype of one leaf and returns it as `[size, *spec.shape]`."""
    step_shape = tuple(int(d) for d in spec.shape)
    given = array.shape[1:] if batched else array.shape
    if given != step_shape and step_shape == () and given == (1,):
        given = ()
        array = array.reshape([size] if batched else [])
    elif given != step_shape and step_shape == (1,) and given == ():
        # A scalar for a one-element field: gymnasium's Discrete actions for SB3-style specs.
        given = (1,)
        array = array.reshape([size, 1] if batched else [1])
    want = np.dtype(_np_dtype(spec))
    if given != step_shape:
        expected = [size, *step_shape] if batched else list(step_shape)
        raise SpecMismatchError(
            f"{label!r}: expected {want.name}{expected}, got {array.dtype.name}{list(array.shape)}"
        )
    if array.dtype != want:
        if not np.can_cast(array.dtype, want, casting="same_kind"):
            raise SpecMismatchError(
                f"{label!r}: expected dtype {want.name}, got {array.dtype.name} (only casts "
                "within a kind, such as float64 to float32, are made)"
            )
        array = array.astype(want)
    return array if batched else array[np.newaxis]


def _flags(label: str, array: np.ndarray, size: int, batched: bool) -> np.ndarray:
    expected = (size,) if batched else ()
    if array.shape == (*expected, 1):
        array = array.reshape(expected)
    if array.shape != expected:
        raise SpecMismatchError(
            f"{label!r}: expected shape {list(expected)}, got {list(array.shape)}"
        )
    if array.dtype != bool:
        if not np.issubdtype(array.dtype, np.number) or not np.isin(array, (0, 1)).all():
            raise SpecMismatchError(f"{label!r} must be booleans (or 0/1), got {array.tolist()!r}")
        array = array.astype(bool)
    return array.reshape(size)


def _check_finite(label: str, rewards: np.ndarray, batched: bool) -> None:
    if not np.issubdtype(rewards.dtype, np.inexact):
        return
    bad = ~np.isfinite(rewards)
    if bad.any():
        index = np.argwhere(bad)[0]
        where = f" (env {int(index[0])})" if batched else ""
        raise SpecMismatchError(
            f"{label!r} must be finite, got {rewards[tuple(index)].item()!r}{where}"
        )


def rows_equal(left: Sequence[np.ndarray], right: Sequence[np.ndarray]) -> np.ndarray:
    """Per row: whether every leaf is equal (NaN equal to NaN)."""
    equal = np.ones([left[0].shape[0]], bool) if left else np.ones([0], bool)
    for a, b in zip(left, right, strict=True):
        same = a == b
        if np.issubdtype(a.dtype, np.inexact):
            same |= np.isnan(a) & np.isnan(b)
        equal &= same.reshape(same.shape[0], -1).all(axis=1) if same.size else True
    return equal


def _np_dtype(spec: Any) -> Any:
    dtype = spec.dtype
    return getattr(dtype, "as_numpy_dtype", dtype)  # a tf.DType, or a numpy dtype


def gather_extras(
    names: tuple[str, ...], whole: Any, extras: dict[str, Any], whole_name: str
) -> dict[str, Any]:
    """The `policy_info` dict of one call from its extras given as keywords.

    Args:
      whole: The `hidden`/`hiddens` argument: the "hidden" extra's value (`add` only), or
        None.
      extras: The other keyword arguments.
      whole_name: "hidden" (`add`) or "hiddens" (`add_multi`).

    Returns:
      A dict with every declared extra.

    Raises:
      SpecMismatchError: If the spec declares no extras, one is unknown, missing, or given
        both whole and as a keyword.
    """
    given = dict(extras)
    if whole is not None:
        if whole_name != "hidden" or "hidden" not in names or isinstance(whole, dict):
            raise SpecMismatchError(
                f"give the policy info either whole as {whole_name}= or as one keyword per "
                f"extra ({list(names)}), not both: got {whole_name}= and {sorted(given)}"
            )
        given["hidden"] = whole
    if not names:
        raise SpecMismatchError(
            f"unexpected keyword argument(s) {sorted(given)}: the data spec declares no "
            "extras (its policy_info is not a dict; declare them with "
            "ReplayBufferManager.from_spaces(..., extras={name: (shape, dtype)}))"
        )
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise SpecMismatchError(
            f"unknown extra(s) {unknown}: the data spec declares the extras {list(names)}"
        )
    missing = [name for name in names if name not in given]
    if missing:
        raise SpecMismatchError(
            f"extra(s) {missing} required: the data spec declares the extras {list(names)}; "
            f"pass each as a keyword, e.g. {', '.join(f'{n}=...' for n in names)}"
        )
    return {name: given[name] for name in names}


def final_observations(batch: Batch) -> list[np.ndarray]:
    """The final observations of the episodes `batch` ends (`add_multi`): `final_states`, or
    zeros where every episode that ended terminated.

    Raises:
      SpecMismatchError: If an episode was truncated and `final_states` not given.
    """
    if batch.final_states is not None:
        return batch.final_states
    cut_short = batch.ended & ~batch.terminated
    if cut_short.any():
        raise SpecMismatchError(
            f"envs {np.flatnonzero(cut_short).tolist()} were truncated, and their final "
            "observations are needed (their value targets bootstrap from them): pass "
            "final_states= (gym's info['terminal_observation'], gymnasium's "
            "info['final_obs'])"
        )
    return [np.zeros_like(leaf) for leaf in batch.next_states]


def check_continues(
    states: list[np.ndarray],
    expected: list[bytes],
    has_expected: list[bool],
    batched: bool | None,
    label: str,
) -> None:
    """Checks that each env's state is the next state of its previous transition.

    Args:
      states: One `[num_envs, ...]` array per observation leaf.
      expected: The previous call's next states, one `bytes` per leaf (all envs' rows).
      has_expected: Per env: whether its episode goes on (it has an expected state).
      batched: Whether the writer takes `add_multi` calls (the error names the envs).
      label: The argument's name, for the error.

    Raises:
      SpecMismatchError: If a state does not continue its env's episode.
    """
    if not any(has_expected):
        return
    known = [
        np.frombuffer(raw, state.dtype).reshape(state.shape)
        for state, raw in zip(states, expected, strict=True)
    ]
    broken = np.array(has_expected) & ~rows_equal(states, known)
    if broken.any():
        where = f" of envs {np.flatnonzero(broken).tolist()}" if batched else ""
        raise SpecMismatchError(
            f"{label!r}{where} is not the next_state of the previous transition, so it "
            "would not continue its episode; end the episode with done/truncated, call "
            "reset() after resetting an environment by hand, or create the writer with "
            "check_continuity=False"
        )

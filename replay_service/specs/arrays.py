"""Data specs without TensorFlow: `ArraySpec`, the `Trajectory` nest and specs for gym spaces.

The in-process backend runs where TensorFlow, TF-Agents and Reverb are not installed, so it
describes its data with these classes instead of `tf.TensorSpec` and TF-Agents' `Trajectory`.
They follow TF-Agents' conventions exactly: `Trajectory` has the same seven fields in the same
order, `StepType` the same values, and `spec_for_spaces` builds the same shapes, dtypes and
names as `replay_service.specs.nests.data_spec_for_spaces` does with TF specs, so
`specs.describe_spec` of either is equal and a checkpoint or export written by one backend names
the same fields as one written by the other.

Nothing here imports TensorFlow, TF-Agents or Reverb.
"""

from __future__ import annotations

import dataclasses
import numbers
import sys
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from replay_service.errors import ConfigError, SpecMismatchError


def is_torch_tensor(value: Any) -> bool:
    """Whether `value` is a `torch.Tensor` (torch is not imported: without it loaded, no value
    can be one)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def is_tf_tensor(value: Any) -> bool:
    """Whether `value` is a TensorFlow tensor or variable (TensorFlow is not imported)."""
    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(value, tf.Tensor | tf.Variable)


def to_numpy(value: Any) -> np.ndarray:
    """A numpy array of a numpy, torch (any device, detached), TensorFlow (eager) or Python
    value; neither torch nor TensorFlow is imported.

    Args:
      value: An array, tensor, variable, number or nest of numbers that `np.asarray` takes.

    Returns:
      The array (numpy input is returned as it is, without a copy; a floating point tensor of
      a dtype numpy lacks, such as bfloat16, widened to float32).
    """
    if is_torch_tensor(value):
        tensor = value.detach().cpu()
        try:
            return tensor.numpy()
        except TypeError:  # bfloat16, float8: no numpy dtype
            if not tensor.is_floating_point():
                raise
            return tensor.float().numpy()
    if is_tf_tensor(value):
        return value.numpy()
    return np.asarray(value)


class StepType:
    """TF-Agents' step types, as plain ints (`tf_agents.trajectories.time_step.StepType`)."""

    FIRST = 0
    MID = 1
    LAST = 2


@dataclasses.dataclass(frozen=True, eq=False)
class ArraySpec:
    """The shape, dtype and name of one field of a step (a leaf for `dm-tree`).

    Attributes:
      shape: Non-negative dimensions (a tuple of ints; `()` for a scalar).
      dtype: A numpy dtype; anything `np.dtype` accepts is normalized to one.
      name: The field's name, or None.
      minimum: Optional lower bound, broadcastable to `shape` (kept as an array of `dtype`).
      maximum: Optional upper bound, broadcastable to `shape` (kept as an array of `dtype`).

    Raises:
      SpecMismatchError: If the shape holds anything but non-negative ints, the dtype is not a
        numeric or bool numpy dtype, the name is not a string, or a bound does not fit the
        shape or dtype.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    name: str | None = None
    minimum: Any = None
    maximum: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", _check_shape(self.shape, self.name))
        object.__setattr__(self, "dtype", _check_dtype(self.dtype, self.name))
        if self.name is not None and not isinstance(self.name, str):
            raise SpecMismatchError(f"ArraySpec name must be a str or None, got {self.name!r}")
        for bound in ("minimum", "maximum"):
            value = getattr(self, bound)
            if value is not None:
                object.__setattr__(self, bound, self._check_bound(bound, value))

    @property
    def is_bounded(self) -> bool:
        """Whether a minimum or a maximum is set."""
        return self.minimum is not None or self.maximum is not None

    def zeros(self) -> np.ndarray:
        """An array of zeros of this spec's shape and dtype."""
        return np.zeros(self.shape, self.dtype)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ArraySpec):
            return NotImplemented
        return (
            (self.shape, self.dtype, self.name) == (other.shape, other.dtype, other.name)
            and _same_bound(self.minimum, other.minimum)
            and _same_bound(self.maximum, other.maximum)
        )

    def __hash__(self) -> int:
        return hash((self.shape, self.dtype, self.name))

    def _check_bound(self, bound: str, value: Any) -> np.ndarray:
        try:
            array = np.asarray(value, dtype=self.dtype)
            np.broadcast_to(array, self.shape)
        except (TypeError, ValueError) as e:
            raise SpecMismatchError(
                f"ArraySpec {self.name!r}: {bound} {value!r} does not fit shape {self.shape} "
                f"and dtype {self.dtype.name}: {e}"
            ) from e
        return array


class Trajectory(NamedTuple):
    """One step as TF-Agents stores it: the fields of `tf_agents.trajectories.Trajectory`.

    Attributes:
      step_type: `StepType` of the step.
      observation: The observation (a nest).
      action: The action taken (a nest).
      policy_info: What the policy reported (a nest; `()` for nothing).
      next_step_type: `StepType` of the following step.
      reward: Reward received after the action.
      discount: Discount applied to the following step's value.
    """

    step_type: Any
    observation: Any
    action: Any
    policy_info: Any
    next_step_type: Any
    reward: Any
    discount: Any


TRAJECTORY_FIELDS: tuple[str, ...] = Trajectory._fields
"""TF-Agents' `Trajectory` fields, in its order."""


def trajectory_spec(observation: Any, action: Any, policy_info: Any = ()) -> Trajectory:
    """A `Trajectory` of `ArraySpec` with TF-Agents' scalar step type, reward and discount.

    Args:
      observation: The observation spec (a nest of `ArraySpec`).
      action: The action spec (a nest of `ArraySpec`).
      policy_info: The policy info spec; `()` for none.

    Returns:
      `Trajectory(step_type=int32[], observation, action, policy_info, next_step_type=int32[],
      reward=float32[], discount=float32[])`.
    """
    return Trajectory(
        step_type=ArraySpec((), np.int32, "step_type"),
        observation=observation,
        action=action,
        policy_info=policy_info,
        next_step_type=ArraySpec((), np.int32, "next_step_type"),
        reward=ArraySpec((), np.float32, "reward"),
        discount=ArraySpec((), np.float32, "discount"),
    )


def space_spec(space: Any, name: str, is_action: bool) -> Any:
    """The spec of one gymnasium space, with Stable-Baselines3's storage conventions.

    Observations keep their space's shape and dtype (Discrete: int64 `[1]`; MultiDiscrete:
    `[len(nvec)]`). Actions are flat: `[action_dim]` (Discrete: int64 `[1]`; Box: float32 when
    the space is float64, as SB3's `ReplayBuffer` casts it). Dict spaces give dicts and Tuple
    spaces tuples of their members' specs.

    Args:
      space: A gymnasium Box, Discrete, MultiDiscrete, MultiBinary, Dict or Tuple space.
      name: The field's name (the leaf's `name`; a Dict member is named by its key, a Tuple
        member by its index).
      is_action: Whether the space is the action space.

    Returns:
      A nest of `ArraySpec`.

    Raises:
      ConfigError: For any other space, or an empty Dict or Tuple.
    """
    from gymnasium import spaces

    if isinstance(space, spaces.Dict | spaces.Tuple):
        if not len(space.spaces):
            raise ConfigError(f"the {_role(is_action)} space {name!r} is empty: {space!r}")
        if isinstance(space, spaces.Dict):
            return {
                str(key): space_spec(member, str(key), is_action)
                for key, member in space.spaces.items()
            }
        return tuple(
            space_spec(member, str(index), is_action) for index, member in enumerate(space.spaces)
        )
    if isinstance(space, spaces.Discrete):
        return ArraySpec((1,), np.int64, name)
    if isinstance(space, spaces.Box | spaces.MultiDiscrete | spaces.MultiBinary):
        dtype = np.dtype(space.dtype)
        if not is_action:
            return ArraySpec(tuple(space.shape), dtype, name)
        if dtype == np.float64:
            dtype = np.dtype(np.float32)  # as SB3's ReplayBuffer casts it
        return ArraySpec((int(np.prod(space.shape)),), dtype, name)
    raise ConfigError(
        f"{_role(is_action)} space {name!r}: supported spaces are Box, Discrete, MultiDiscrete, "
        f"MultiBinary, Dict and Tuple, got {type(space).__name__}: {space!r}"
    )


def spec_for_spaces(
    observation_space: Any, action_space: Any, *, extras: Mapping[str, Any] | None = None
) -> Trajectory:
    """The per-step `Trajectory` of `ArraySpec` for a gymnasium env's spaces.

    The TF-free twin of `replay_service.specs.nests.data_spec_for_spaces`: the same fields, shapes,
    dtypes and names (see `space_spec`), with `policy_info=()` (or the `extras`), int32 scalar
    step types and float32 scalar reward and discount.

    Args:
      observation_space: A gymnasium space (a vector env's `single_observation_space`).
      action_space: A gymnasium space (`single_action_space`).
      extras: Extra per-step fields, stored as the `policy_info` dict (see `extras_spec`);
        None or empty for none.

    Returns:
      A `Trajectory` of `ArraySpec`.

    Raises:
      ConfigError: For a space `space_spec` does not support, naming it, or a bad extra (see
        `extras_spec`).
    """
    return trajectory_spec(
        observation=space_spec(observation_space, "observation", is_action=False),
        action=space_spec(action_space, "action", is_action=True),
        policy_info=extras_spec(extras),
    )


RESERVED_EXTRA_NAMES: frozenset[str] = frozenset(
    (
        *TRAJECTORY_FIELDS,
        # TransitionWriter.add/add_multi's own arguments and TransitionBatch's fields.
        *("state", "states", "next_state", "next_states", "actions", "rewards"),
        *("done", "dones", "truncated", "final_states", "hiddens", "priority"),
        *("mask", "self"),
        # GymVectorWriter.add's own arguments.
        *("observations", "terminated", "infos", "end_episodes"),
    )
)
"""Names an extra per-step field cannot take: a `Trajectory` field, or an argument of
`TransitionWriter.add`/`add_multi` or a field of `TransitionBatch` ("hidden" is allowed)."""


def extras_spec(extras: Mapping[str, Any] | None) -> Any:
    """The `policy_info` spec of extra per-step fields (hidden states, log-probs, ...).

    Each extra is one array per step, stored in the trajectory's `policy_info` as a dict keyed
    by its name, as TF-Agents policies report their info (`policy_info["log_prob"]`). The
    transition writer takes each as a keyword (`add(..., hidden=h, log_prob=lp)`), and sampled
    batches carry them in `policy_info` (trajectories) or `hiddens` (transitions).

    Args:
      extras: Name -> spec of one step's value: a `(shape, dtype)` pair (e.g. `((64,),
        np.float32)`, `((), np.float32)`), an `ArraySpec` or `tf.TensorSpec`, or a gymnasium
        Box, Discrete, MultiDiscrete or MultiBinary space (stored like an observation of that
        space, see `space_spec`). Names are Python identifiers and not one of
        `RESERVED_EXTRA_NAMES`. None or empty: no extras.

    Returns:
      A dict name -> `ArraySpec` (named by its key), in the given order; `()` for no extras
      (TF-Agents' empty policy info).

    Raises:
      ConfigError: If `extras` is not a mapping, a name is not an identifier or is reserved,
        or a spec is not one of the above or has a bad shape or dtype (naming the extra and
        the value).
    """
    if extras is None:
        return ()
    if not isinstance(extras, Mapping):
        raise ConfigError(
            f"extras must be a dict of name -> (shape, dtype) or space, got "
            f"{type(extras).__name__}: {extras!r}"
        )
    specs: dict[str, ArraySpec] = {}
    for name, value in extras.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(f"extra name {name!r} must be a Python identifier (a keyword)")
        if name in RESERVED_EXTRA_NAMES:
            raise ConfigError(
                f"extra name {name!r} clashes with a trajectory field or a transition "
                f"argument; reserved names are {sorted(RESERVED_EXTRA_NAMES)}"
            )
        specs[name] = _extra_leaf(name, value)
    return specs or ()


def _extra_leaf(name: str, value: Any) -> ArraySpec:
    """One extra's `ArraySpec` (see `extras_spec`)."""
    if _is_space(value):
        spec = space_spec(value, name, is_action=False)
        if not isinstance(spec, ArraySpec):
            raise ConfigError(
                f"extra {name!r}: a Dict or Tuple space is not one array per step; declare "
                f"each of its members as an extra of its own, got {value!r}"
            )
        return spec
    if isinstance(value, tuple) and len(value) == 2:
        shape, dtype = value
    elif hasattr(value, "shape") and hasattr(value, "dtype") and not hasattr(value, "__array__"):
        shape, dtype = value.shape, value.dtype
        if hasattr(shape, "as_list"):  # a tf.TensorShape
            if shape.rank is None or None in shape.as_list():
                raise ConfigError(f"extra {name!r}: the shape must be fully known, got {value!r}")
            shape = shape.as_list()
    else:
        raise ConfigError(
            f"extra {name!r}: expected a (shape, dtype) pair, an ArraySpec or TensorSpec, or a "
            f"gymnasium Box/Discrete/MultiDiscrete/MultiBinary space, got {value!r}"
        )
    try:
        return ArraySpec(shape, dtype, name)
    except SpecMismatchError as e:
        raise ConfigError(f"extra {name!r}: bad spec {value!r}: {e}") from e


def _is_space(value: Any) -> bool:
    """Whether `value` is a gymnasium space (without importing gymnasium for other values)."""
    gymnasium = sys.modules.get("gymnasium")  # a space exists only if gymnasium is imported
    return gymnasium is not None and isinstance(value, gymnasium.spaces.Space)


def _role(is_action: bool) -> str:
    return "action" if is_action else "observation"


def _check_shape(shape: Any, name: str | None) -> tuple[int, ...]:
    if isinstance(shape, numbers.Integral) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        dims = None
    if dims is None or not all(
        isinstance(d, numbers.Integral) and not isinstance(d, bool) and d >= 0 for d in dims
    ):
        raise SpecMismatchError(
            f"ArraySpec {name!r}: shape must be a sequence of non-negative ints, got {shape!r}"
        )
    return tuple(int(d) for d in dims)


def _check_dtype(dtype: Any, name: str | None) -> np.dtype:
    if dtype is None:
        raise SpecMismatchError(f"ArraySpec {name!r}: dtype is required, got None")
    dtype = getattr(dtype, "as_numpy_dtype", dtype)  # a tf.DType
    try:
        result = np.dtype(dtype)
    except TypeError as e:
        raise SpecMismatchError(f"ArraySpec {name!r}: dtype {dtype!r} is not a numpy dtype") from e
    if result.kind not in "biufc":
        raise SpecMismatchError(
            f"ArraySpec {name!r}: dtype must be numeric or bool, got {dtype!r} ({result})"
        )
    return result


def _same_bound(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return bool(np.array_equal(a, b))


def bytes_equal(array: Any, expected: bytes) -> bool:
    """Whether `array`'s bytes are `expected`: compared in place where it is a C-contiguous
    array (no copy), else through `tobytes`.

    Args:
      array: A numpy array or scalar.
      expected: The bytes it should hold.

    Returns:
      True if they are the same bytes.
    """
    if type(array) is np.ndarray and array.flags.c_contiguous:
        return array.nbytes == len(expected) and expected.startswith(array)
    return array.tobytes() == expected

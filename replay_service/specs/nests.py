"""Data specs: table signatures, JSON descriptions and field-by-field comparison.

A table's signature is the data spec with a leading time dimension of `sequence_length`, so plain
Reverb clients (`reverb.TrajectoryDataset.from_table_signature`) can read the table and Reverb
rejects wrongly shaped items at insert time. Descriptions are the JSON form kept beside every
checkpoint, so a restore can name each field that differs.

Every function but `table_signature` and `trajectory_spec` takes either TF specs
(`tf.TensorSpec`, TF-Agents specs) or `array_specs.ArraySpec`, and this module imports no
TensorFlow of its own: a leaf is recognized as a TF spec only if TensorFlow is already imported
(it must be, for such a leaf to exist). Equivalent TF and `ArraySpec` specs have equal
`describe_spec` descriptions.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import tree

from replay_service.errors import ConfigError, SpecMismatchError
from replay_service.specs import arrays as array_specs
from replay_service.specs.arrays import ArraySpec

FieldDescription = dict[str, Any]

SpecType = Literal["auto", "tf", "array"]
"""Which specs a builder returns: "tf" (`tf.TensorSpec` in TF-Agents' `Trajectory`), "array"
(`ArraySpec` in `array_specs.Trajectory`) or "auto" (TF when TF-Agents can be imported)."""

SPEC_TYPES = ("auto", "tf", "array")


@functools.cache
def tf_agents_available() -> bool:
    """Whether TensorFlow and TF-Agents can be imported (imports them if so)."""
    try:
        import tensorflow  # noqa: F401
        from tf_agents.trajectories import trajectory  # noqa: F401
    except ImportError:
        return False
    return True


def is_tf_spec(leaf: Any) -> bool:
    """Whether `leaf` is a TF `TypeSpec` or a TF-Agents `ArraySpec` (never imports TF)."""
    tf = sys.modules.get("tensorflow")
    if tf is not None and isinstance(leaf, tf.TypeSpec):
        return True
    tfa_array_spec = sys.modules.get("tf_agents.specs.array_spec")
    return tfa_array_spec is not None and isinstance(leaf, tfa_array_spec.ArraySpec)


def flatten_with_paths(structure: Any) -> list[tuple[str, Any]]:
    """Returns `(path, leaf)` pairs in `tf.nest` order, paths joined with "/"."""
    return [("/".join(map(str, path)), leaf) for path, leaf in tree.flatten_with_path(structure)]


def normalize_spec(data_spec: Any) -> Any:
    """Turns a nest of specs into a nest of `tf.TensorSpec`, or of `ArraySpec`.

    Args:
      data_spec: A nest (e.g. a TF-Agents or `array_specs` `Trajectory`) of `tf.TensorSpec`,
        `BoundedTensorSpec`, `tf_agents.specs.ArraySpec` or `array_specs.ArraySpec`.

    Returns:
      The same nest with every leaf a plain spec, bounds dropped and names kept: all
      `ArraySpec` if every leaf is one, else all `tf.TensorSpec`.

    Raises:
      SpecMismatchError: If the nest is empty or a leaf is not a spec.
    """
    if not tree.flatten(data_spec):
        raise SpecMismatchError(f"data_spec has no tensors: {data_spec!r}")
    any_tf = False
    for path, leaf in flatten_with_paths(data_spec):
        if isinstance(leaf, ArraySpec):
            continue
        if not is_tf_spec(leaf):
            raise SpecMismatchError(
                f"data_spec field {path or '<root>'!r} is not a TensorSpec or ArraySpec: {leaf!r}"
            )
        any_tf = True
    if not any_tf:
        return tree.map_structure(lambda s: ArraySpec(s.shape, s.dtype, s.name), data_spec)
    import tensorflow as tf
    from tf_agents.specs import tensor_spec

    tf_spec = tensor_spec.from_spec(_array_leaves_to_tf(data_spec))
    return tf.nest.map_structure(lambda s: tf.TensorSpec(s.shape, s.dtype, s.name), tf_spec)


def to_tf_spec(data_spec: Any) -> Any:
    """The spec as TF specs: a nest of `tf.TensorSpec`, every `array_specs.Trajectory` in it (the
    spec, or the step of a `Masked` one) becoming a TF-Agents `Trajectory` (imports TensorFlow).

    Args:
      data_spec: A nest of specs (see `normalize_spec`).

    Returns:
      The same nest with every leaf a `tf.TensorSpec`.

    Raises:
      SpecMismatchError: If the nest is empty or a leaf is not a spec.
    """
    spec = normalize_spec(data_spec)
    if any(isinstance(leaf, ArraySpec) for leaf in tree.flatten(spec)):
        spec = _array_leaves_to_tf(spec)

    def tf_agents_trajectory(node: Any) -> Any:
        if not isinstance(node, array_specs.Trajectory):
            return None  # looked into
        from tf_agents.trajectories import trajectory

        return trajectory.Trajectory(*node)

    return tree.traverse(tf_agents_trajectory, spec)


def to_array_spec(data_spec: Any) -> Any:
    """The spec as a nest of `ArraySpec` (a TF-Agents `Trajectory` becomes an
    `array_specs.Trajectory`); names kept, bounds dropped.

    Args:
      data_spec: A nest of specs (see `normalize_spec`).

    Returns:
      The same nest with every leaf an `ArraySpec`.

    Raises:
      SpecMismatchError: If the nest is empty, a leaf is not a spec or has an unknown dimension
        or a dtype numpy has not.
    """
    spec = normalize_spec(data_spec)
    if _is_trajectory(spec) and not isinstance(spec, array_specs.Trajectory):
        spec = array_specs.Trajectory(*spec)
    return tree.map_structure(
        lambda s: (
            s
            if isinstance(s, ArraySpec)
            else ArraySpec(_shape_list(s, strict=True), numpy_dtype(s), s.name)
        ),
        spec,
    )


def check_collect_spec(data_spec: Any, user: str) -> Any:
    """Checks that `data_spec` is what the observer and `TransitionWriter` collect: a
    `Trajectory` (TF-Agents' or `array_specs.Trajectory`) of specs.

    Both find episode boundaries in each step's `step_type` and write `Trajectory` steps, so a
    plain dict or tuple spec would be accepted by a table but fail at the first collected step.

    Args:
      data_spec: The per-step data spec (e.g. `agent.collect_data_spec`).
      user: What needs the spec, named in the error (e.g. "ReplayBufferManager").

    Returns:
      The spec normalized (see `normalize_spec`): a TF-Agents `Trajectory` of `tf.TensorSpec`
      if any leaf is a TF spec, else an `array_specs.Trajectory` of `ArraySpec`.

    Raises:
      SpecMismatchError: If a leaf is not a spec, or the nest is not a `Trajectory`; the message
        names the type and fields given.
    """
    spec = normalize_spec(data_spec)
    if not _is_trajectory(spec):
        fields = [path for path, _ in flatten_with_paths(spec)]
        raise SpecMismatchError(
            f"{user} needs a TF-Agents Trajectory data spec with fields "
            f"{list(array_specs.TRAJECTORY_FIELDS)} (e.g. agent.collect_data_spec, "
            "replay_service.specs.nests.trajectory_spec(env) or "
            "replay_service.specs.arrays.spec_for_spaces(...)): its observer and transition "
            "writer take the episode boundaries from step_type; got a "
            f"{type(data_spec).__name__} with fields {fields}"
        )
    if isinstance(spec, array_specs.Trajectory) and not isinstance(
        tree.flatten(spec)[0], ArraySpec
    ):
        spec = to_tf_spec(spec)
    return spec


def table_signature(data_spec: Any, sequence_length: int) -> Any:
    """Returns the Reverb table signature for windows of `sequence_length` steps.

    Imports TensorFlow: a Reverb table's signature is made of `tf.TensorSpec`.

    Args:
      data_spec: The per-step data spec (see `normalize_spec`; `ArraySpec` leaves are
        converted).
      sequence_length: Number of steps in one item.

    Returns:
      A nest of `tf.TensorSpec` of shape `[sequence_length, *step_shape]`.
    """
    import tensorflow as tf

    return tf.nest.map_structure(
        lambda s: tf.TensorSpec([sequence_length, *s.shape], s.dtype, s.name),
        _array_leaves_to_tf(normalize_spec(data_spec)),
    )


def variable_container_spec(variables: Any) -> Any:
    """The signature of a TF-Agents variable-container table holding `variables`.

    What TF-Agents' `sac_reverb_server.py` builds for its "variables" table: one
    `tf.TensorSpec(shape, dtype)` per variable, in the same nest, e.g.

        variable_container_spec({
            reverb_variable_container.POLICY_KEY: policy.variables(),
            reverb_variable_container.TRAIN_STEP_KEY: train_step,
        })

    Args:
      variables: A nest of `tf.Variable`s (or tensors, or numpy arrays).

    Returns:
      The same nest with a `tf.TensorSpec(shape, dtype)` for each leaf.

    Raises:
      SpecMismatchError: If the nest is empty or a leaf has no shape and dtype; the message
        names its path.
    """
    leaves = flatten_with_paths(variables)
    if not leaves:
        raise SpecMismatchError(f"variables hold no tensors: {variables!r}")
    for path, leaf in leaves:
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise SpecMismatchError(
                f"variable {path or '<root>'!r} has no shape and dtype: {type(leaf).__name__} "
                f"{leaf!r}"
            )
    import tensorflow as tf

    return tf.nest.map_structure(lambda v: tf.TensorSpec(v.shape, tf.as_dtype(v.dtype)), variables)


def describe_spec(data_spec: Any) -> list[FieldDescription]:
    """Describes every field of a spec as JSON-compatible data.

    Args:
      data_spec: A nest of specs (TF or `ArraySpec`; see `normalize_spec`).

    Returns:
      One `{"path", "dtype", "shape"}` dict per leaf, in `tf.nest` order; the same for
      equivalent TF and `ArraySpec` specs.

    Raises:
      SpecMismatchError: If the nest is empty or a leaf is not a spec.
    """
    spec = normalize_spec(data_spec)
    return [
        {"path": path, "dtype": _dtype_name(leaf), "shape": _shape_list(leaf)}
        for path, leaf in flatten_with_paths(spec)
    ]


def diff_descriptions(
    expected: list[FieldDescription], actual: list[FieldDescription]
) -> list[str]:
    """Lists every field that differs between two spec descriptions.

    Args:
      expected: The description the caller asked for.
      actual: The description found (in a checkpoint, on a server).

    Returns:
      Human-readable differences, empty when the specs agree.
    """
    want = {f["path"]: f for f in expected}
    have = {f["path"]: f for f in actual}
    problems = [f"field {p!r} is missing (expected {_fmt(want[p])})" for p in want if p not in have]
    problems += [f"field {p!r} is unexpected ({_fmt(have[p])})" for p in have if p not in want]
    for path in want.keys() & have.keys():
        if (want[path]["dtype"], want[path]["shape"]) != (have[path]["dtype"], have[path]["shape"]):
            problems.append(
                f"field {path!r}: expected {_fmt(want[path])}, found {_fmt(have[path])}"
            )
    return sorted(problems)


def diff_value(value: Any, data_spec: Any) -> list[str]:
    """Lists every way a single step (no batch or time dimension) departs from a spec.

    Args:
      value: A nest of arrays or tensors, e.g. one `Trajectory`.
      data_spec: The per-step spec it should match (TF or `ArraySpec`).

    Returns:
      Human-readable differences, empty when the value matches.
    """
    spec = normalize_spec(data_spec)
    leaf_specs = flatten_with_paths(spec)
    if isinstance(leaf_specs[0][1], ArraySpec):
        nest: Any = tree
        as_dtype: Any = np.dtype
    else:
        import tensorflow as tf

        nest, as_dtype = tf.nest, tf.as_dtype
    try:
        nest.assert_same_structure(spec, value, check_types=False)
    except (ValueError, TypeError) as e:
        return [f"structure differs from the data spec: {e}"]
    differs = _nest_difference(spec, value, "")
    if differs:
        return [f"structure differs from the data spec: {differs}"]
    problems = []
    for (path, leaf_spec), leaf in zip(leaf_specs, nest.flatten(value), strict=True):
        array = np.asarray(leaf)
        dtype = as_dtype(array.dtype)
        if isinstance(leaf_spec, ArraySpec):
            matches = dtype == leaf_spec.dtype and array.shape == leaf_spec.shape
        else:
            matches = dtype == leaf_spec.dtype and leaf_spec.shape.is_compatible_with(array.shape)
        if not matches:
            problems.append(
                f"field {path!r}: expected {_dtype_name(leaf_spec)}{_shape_list(leaf_spec)}, "
                f"got {dtype.name}{list(array.shape)}"
            )
    return problems


TRAJECTORY_DEFAULTS: dict[str, FieldDescription] = {
    "step_type": {"dtype": "int32", "shape": []},
    "next_step_type": {"dtype": "int32", "shape": []},
    "reward": {"dtype": "float32", "shape": []},
    "discount": {"dtype": "float32", "shape": []},
}


def spec_from_description(
    fields: list[FieldDescription],
    structure: str = "trajectory",
    spec_type: SpecType = "auto",
) -> Any:
    """Rebuilds a data spec from `describe_spec`-style field descriptions.

    Args:
      fields: `{"path", "dtype", "shape"}` dicts; "a/b" paths build nested dicts.
      structure: "trajectory" wraps the top level in a `Trajectory` (missing `step_type`,
        `next_step_type`, `reward` and `discount` get TF-Agents' standard scalar specs, a
        missing `policy_info` is `()`); "dict" keeps plain nested dicts.
      spec_type: "tf" builds `tf.TensorSpec` leaves in a TF-Agents `Trajectory`; "array"
        builds `ArraySpec` leaves in an `array_specs.Trajectory` (no TensorFlow needed);
        "auto" (default) is "tf" when TensorFlow and TF-Agents can be imported, else "array".

    Returns:
      A nest of `tf.TensorSpec` or of `ArraySpec`.

    Raises:
      SpecMismatchError: If a dtype, shape or path is invalid, or a Trajectory field is unknown.
      ConfigError: If `spec_type` is unknown.
    """
    use_tf = _use_tf(spec_type)
    if use_tf:
        import tensorflow as tf

        as_dtype: Any = tf.as_dtype
    else:
        as_dtype = np.dtype
    root: dict[str, Any] = {}
    for field in fields:
        path = str(field.get("path", ""))
        try:
            dtype = as_dtype(field["dtype"])
            shape = [int(d) for d in field["shape"]]
        except (KeyError, TypeError, ValueError) as e:
            raise SpecMismatchError(f"data spec field {path!r} is invalid ({field!r}): {e}") from e
        if not path or any(d < 0 for d in shape):
            raise SpecMismatchError(f"data spec field {field!r} needs a path and shape >= 0")
        *parents, leaf = path.split("/")
        node = root
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = _leaf_spec(shape, dtype, leaf, use_tf)
    if structure == "dict":
        return root
    if structure != "trajectory":
        raise SpecMismatchError(f"structure must be 'trajectory' or 'dict', got {structure!r}")
    for name, default in TRAJECTORY_DEFAULTS.items():
        root.setdefault(
            name, _leaf_spec(default["shape"], as_dtype(default["dtype"]), name, use_tf)
        )
    root.setdefault("policy_info", ())
    unknown = sorted(set(root) - set(array_specs.TRAJECTORY_FIELDS))
    if unknown or "observation" not in root or "action" not in root:
        raise SpecMismatchError(
            f"a trajectory data spec needs 'observation' and 'action' and takes only "
            f"{array_specs.TRAJECTORY_FIELDS}; got fields {sorted(root)}"
        )
    if not use_tf:
        return array_specs.Trajectory(**root)
    from tf_agents.trajectories import trajectory

    return trajectory.Trajectory(**root)


def data_spec_for_spaces(
    observation_space: Any,
    action_space: Any,
    spec_type: SpecType = "auto",
    *,
    extras: Any = None,
) -> Any:
    """The per-step `Trajectory` spec for a gymnasium env's spaces.

    What `replay_service.integrations.sb3.ReverbReplayBuffer` stores SB3's transitions with, and a
    ready data spec for `ReplayBufferManager` with `transition_writer()` or
    `gym_vector_writer(envs)`.

    Observations keep their space's shape and dtype (Discrete: int64 `[1]`, as SB3 stores them);
    actions are `[action_dim]` (Discrete: int64 `[1]`; Box: float32 unless the space's dtype is
    another non-float64 one). MultiDiscrete and MultiBinary spaces are stored like Box spaces
    of their dtype; Dict and Tuple spaces give dicts and tuples of their members' specs (see
    `array_specs.space_spec`).

    Args:
      observation_space: A gymnasium space (a vector env's `single_observation_space`).
      action_space: A gymnasium space (`single_action_space`).
      spec_type: "tf" for a TF-Agents `Trajectory` of `tf.TensorSpec`, "array" for an
        `array_specs.Trajectory` of `ArraySpec` (the same as `array_specs.spec_for_spaces`),
        "auto" (default) for "tf" when TensorFlow and TF-Agents can be imported, else "array".
      extras: Extra per-step fields (hidden states, log-probs...), name -> `(shape, dtype)`,
        spec or gymnasium space, stored as the `policy_info` dict (see
        `array_specs.extras_spec`); None: `policy_info` is `()`.

    Returns:
      A `Trajectory` of specs.

    Raises:
      ConfigError: For an unsupported space (naming it), an unknown `spec_type`, or a bad extra
        (naming it and its value).
    """
    use_tf = _use_tf(spec_type)
    spec = array_specs.spec_for_spaces(observation_space, action_space, extras=extras)
    return to_tf_spec(spec) if use_tf else spec


def trajectory_spec(env: Any, policy_info_spec: Any = ()) -> Any:
    """The per-step `Trajectory` spec for `env` (what an agent's `collect_data_spec` gives).

    Imports TF-Agents.

    Args:
      env: A TF-Agents py or TF environment.
      policy_info_spec: The policy's `info_spec`; `()` for none.

    Returns:
      A `Trajectory` of `tf.TensorSpec`/`BoundedTensorSpec`.
    """
    from tf_agents.specs import tensor_spec
    from tf_agents.trajectories import policy_step, trajectory

    return tensor_spec.from_spec(
        trajectory.from_transition(
            env.time_step_spec(),
            policy_step.PolicyStep(env.action_spec(), (), policy_info_spec),
            env.time_step_spec(),
        )
    )


def collect_data_spec(env: Any, policy: Any) -> Any:
    """The per-step `Trajectory` spec an agent's `collect_data_spec` would give.

    Args:
      env: A TF-Agents py environment.
      policy: A TF-Agents policy acting in it (its `info_spec` is not kept: `policy_info` is ()).

    Returns:
      A `Trajectory` of `tf.TensorSpec`s.
    """
    return trajectory_spec(env, policy.info_spec)


def _nest_difference(spec: Any, value: Any, path: str) -> str | None:
    """Where a dict of `value` has other keys than the spec's dict at the same place, or a
    non-empty sequence stands for a dict (or a dict for one), which `assert_same_structure(
    check_types=False)` lets pass when the leaves line up; None if nowhere."""
    where = f"field {path!r}" if path else "the step"
    nests = (Mapping, tuple, list)
    if (
        isinstance(spec, nests)
        and isinstance(value, nests)
        and isinstance(spec, Mapping) != isinstance(value, Mapping)
        and (len(spec) or len(value))
    ):
        return f"{where} is a {type(value).__name__}, the data spec a {type(spec).__name__}"
    if isinstance(spec, Mapping) and isinstance(value, Mapping):
        if set(spec) != set(value):
            return (
                f"{where} has keys {sorted(map(str, value))}, the data spec "
                f"{sorted(map(str, spec))}"
            )
        pairs = [(str(key), spec[key], value[key]) for key in spec]
    elif isinstance(spec, tuple | list) and isinstance(value, tuple | list):
        names = getattr(spec, "_fields", None) or [str(i) for i in range(len(spec))]
        pairs = list(zip(names, spec, value, strict=False))
    else:
        return None
    for name, spec_part, value_part in pairs:
        found = _nest_difference(spec_part, value_part, f"{path}/{name}" if path else name)
        if found:
            return found
    return None


def _use_tf(spec_type: str) -> bool:
    if spec_type not in SPEC_TYPES:
        raise ConfigError(f"spec_type must be one of {SPEC_TYPES}, got {spec_type!r}")
    if spec_type == "auto":
        return tf_agents_available()
    return spec_type == "tf"


def _leaf_spec(shape: list[int], dtype: Any, name: str, use_tf: bool) -> Any:
    if not use_tf:
        return ArraySpec(tuple(shape), dtype, name)
    import tensorflow as tf

    return tf.TensorSpec(shape, dtype, name=name)


def _is_trajectory(spec: Any) -> bool:
    if isinstance(spec, array_specs.Trajectory):
        return True
    module = sys.modules.get("tf_agents.trajectories.trajectory")
    return module is not None and isinstance(spec, module.Trajectory)


def _array_leaves_to_tf(data_spec: Any) -> Any:
    """`data_spec` with every `ArraySpec` leaf a `tf.TensorSpec` (imports TensorFlow)."""
    import tensorflow as tf

    return tree.map_structure(
        lambda s: tf.TensorSpec(s.shape, s.dtype, s.name) if isinstance(s, ArraySpec) else s,
        data_spec,
    )


def _dtype_name(leaf: Any) -> str:
    return leaf.dtype.name


def numpy_dtype(leaf: Any) -> np.dtype:
    """The numpy dtype of a spec leaf (`ArraySpec`, TF or TF-Agents spec).

    Args:
      leaf: A spec.

    Returns:
      Its dtype as a numpy dtype.
    """
    dtype = leaf.dtype
    return np.dtype(getattr(dtype, "as_numpy_dtype", dtype))


def _shape_list(leaf: Any, strict: bool = False) -> list[int | None]:
    """The dimensions of a spec leaf (None for an unknown one unless `strict`)."""
    shape = leaf.shape
    dims = shape.as_list() if hasattr(shape, "as_list") else [int(d) for d in shape]
    if strict and any(d is None for d in dims):
        raise SpecMismatchError(f"spec {leaf!r} has an unknown dimension: {dims}")
    return dims


def _fmt(field: FieldDescription) -> str:
    return f"{field['dtype']}{field['shape']}"

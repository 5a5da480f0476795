"""Data specs: table signatures, JSON descriptions and field-by-field comparison.

A table's signature is the data spec with a leading time dimension of `sequence_length`, so plain
Reverb clients (`reverb.TrajectoryDataset.from_table_signature`) can read the table and Reverb
rejects wrongly shaped items at insert time. Descriptions are the JSON form kept beside every
checkpoint, so a restore can name each field that differs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf
import tree
from tf_agents.specs import array_spec, tensor_spec

from replay_service.errors import ConfigError, SpecMismatchError

FieldDescription = dict[str, Any]


def flatten_with_paths(structure: Any) -> list[tuple[str, Any]]:
    """Returns `(path, leaf)` pairs in `tf.nest` order, paths joined with "/"."""
    return [("/".join(map(str, path)), leaf) for path, leaf in tree.flatten_with_path(structure)]


def normalize_spec(data_spec: Any) -> Any:
    """Turns a nest of TF or array specs into a nest of `tf.TensorSpec`.

    Args:
      data_spec: A nest (e.g. a TF-Agents `Trajectory`) of `tf.TensorSpec`, `BoundedTensorSpec`
        or `tf_agents.specs.ArraySpec`.

    Returns:
      The same nest with every leaf a `tf.TensorSpec` (bounds dropped, names kept).

    Raises:
      SpecMismatchError: If the nest is empty or a leaf is not a spec.
    """
    leaves = tf.nest.flatten(data_spec)
    if not leaves:
        raise SpecMismatchError(f"data_spec has no tensors: {data_spec!r}")
    for path, leaf in flatten_with_paths(data_spec):
        if not isinstance(leaf, tf.TypeSpec | array_spec.ArraySpec):
            raise SpecMismatchError(
                f"data_spec field {path or '<root>'!r} is not a TensorSpec or ArraySpec: {leaf!r}"
            )
    tf_spec = tensor_spec.from_spec(data_spec)
    return tf.nest.map_structure(lambda s: tf.TensorSpec(s.shape, s.dtype, s.name), tf_spec)


def check_collect_spec(data_spec: Any, user: str) -> Any:
    """Checks that `data_spec` is what the observer and `TransitionWriter` collect: a TF-Agents
    `Trajectory` of tensor specs.

    Both find episode boundaries in each step's `step_type` and write `Trajectory` steps, so a
    plain dict or tuple spec would be accepted by a table but fail at the first collected step.

    Args:
      data_spec: The per-step data spec (e.g. `agent.collect_data_spec`).
      user: What needs the spec, named in the error (e.g. "ReplayBufferManager").

    Returns:
      The spec as a `Trajectory` of `tf.TensorSpec` (see `normalize_spec`).

    Raises:
      SpecMismatchError: If a leaf is not a spec, or the nest is not a `Trajectory`; the message
        names the type and fields given.
    """
    from tf_agents.trajectories import trajectory

    spec = normalize_spec(data_spec)
    if not isinstance(spec, trajectory.Trajectory):
        fields = [path for path, _ in flatten_with_paths(spec)]
        raise SpecMismatchError(
            f"{user} needs a TF-Agents Trajectory data spec with fields "
            f"{list(trajectory.Trajectory._fields)} (e.g. agent.collect_data_spec, or "
            "replay_service.specs.trajectory_spec(env)): its observer and transition writer "
            "take the episode boundaries from step_type; got a "
            f"{type(data_spec).__name__} with fields {fields}"
        )
    return spec


def table_signature(data_spec: Any, sequence_length: int) -> Any:
    """Returns the Reverb table signature for windows of `sequence_length` steps.

    Args:
      data_spec: The per-step data spec (see `normalize_spec`).
      sequence_length: Number of steps in one item.

    Returns:
      A nest of `tf.TensorSpec` of shape `[sequence_length, *step_shape]`.
    """
    return tf.nest.map_structure(
        lambda s: tf.TensorSpec([sequence_length, *s.shape], s.dtype, s.name),
        normalize_spec(data_spec),
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
    return tf.nest.map_structure(lambda v: tf.TensorSpec(v.shape, tf.as_dtype(v.dtype)), variables)


def describe_spec(data_spec: Any) -> list[FieldDescription]:
    """Describes every field of a spec as JSON-compatible data.

    Args:
      data_spec: A nest of specs.

    Returns:
      One `{"path", "dtype", "shape"}` dict per leaf, in `tf.nest` order.
    """
    spec = normalize_spec(data_spec)
    return [
        {"path": path, "dtype": leaf.dtype.name, "shape": leaf.shape.as_list()}
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
      value: A nest of arrays or tensors, e.g. one TF-Agents `Trajectory`.
      data_spec: The per-step spec it should match.

    Returns:
      Human-readable differences, empty when the value matches.
    """
    spec = normalize_spec(data_spec)
    try:
        tf.nest.assert_same_structure(spec, value, check_types=False)
    except (ValueError, TypeError) as e:
        return [f"structure differs from the data spec: {e}"]
    problems = []
    for (path, leaf_spec), leaf in zip(
        flatten_with_paths(spec), tf.nest.flatten(value), strict=True
    ):
        array = np.asarray(leaf)
        dtype = tf.as_dtype(array.dtype)
        if dtype != leaf_spec.dtype or not leaf_spec.shape.is_compatible_with(array.shape):
            problems.append(
                f"field {path!r}: expected {leaf_spec.dtype.name}{leaf_spec.shape.as_list()}, "
                f"got {dtype.name}{list(array.shape)}"
            )
    return problems


def _fmt(field: FieldDescription) -> str:
    return f"{field['dtype']}{field['shape']}"


TRAJECTORY_DEFAULTS: dict[str, FieldDescription] = {
    "step_type": {"dtype": "int32", "shape": []},
    "next_step_type": {"dtype": "int32", "shape": []},
    "reward": {"dtype": "float32", "shape": []},
    "discount": {"dtype": "float32", "shape": []},
}


def spec_from_description(fields: list[FieldDescription], structure: str = "trajectory") -> Any:
    """Rebuilds a data spec from `describe_spec`-style field descriptions.

    Args:
      fields: `{"path", "dtype", "shape"}` dicts; "a/b" paths build nested dicts.
      structure: "trajectory" wraps the top level in a TF-Agents `Trajectory` (missing
        `step_type`, `next_step_type`, `reward` and `discount` get TF-Agents' standard scalar
        specs, a missing `policy_info` is `()`); "dict" keeps plain nested dicts.

    Returns:
      A nest of `tf.TensorSpec`.

    Raises:
      SpecMismatchError: If a dtype, shape or path is invalid, or a Trajectory field is unknown.
    """
    root: dict[str, Any] = {}
    for field in fields:
        path = str(field.get("path", ""))
        try:
            dtype = tf.as_dtype(field["dtype"])
            shape = [int(d) for d in field["shape"]]
        except (KeyError, TypeError, ValueError) as e:
            raise SpecMismatchError(f"data spec field {path!r} is invalid ({field!r}): {e}") from e
        if not path or any(d < 0 for d in shape):
            raise SpecMismatchError(f"data spec field {field!r} needs a path and shape >= 0")
        *parents, leaf = path.split("/")
        node = root
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = tf.TensorSpec(shape, dtype, name=leaf)
    if structure == "dict":
        return root
    if structure != "trajectory":
        raise SpecMismatchError(f"structure must be 'trajectory' or 'dict', got {structure!r}")
    from tf_agents.trajectories import trajectory

    for name, default in TRAJECTORY_DEFAULTS.items():
        root.setdefault(name, tf.TensorSpec(default["shape"], default["dtype"], name=name))
    root.setdefault("policy_info", ())
    unknown = sorted(set(root) - set(trajectory.Trajectory._fields))
    if unknown or "observation" not in root or "action" not in root:
        raise SpecMismatchError(
            f"a trajectory data spec needs 'observation' and 'action' and takes only "
            f"{trajectory.Trajectory._fields}; got fields {sorted(root)}"
        )
    return trajectory.Trajectory(**root)


def data_spec_for_spaces(observation_space: Any, action_space: Any) -> Any:
    """The per-step TF-Agents `Trajectory` spec for a gymnasium env's spaces.

    What `replay_service.sb3.ReverbReplayBuffer` stores SB3's transitions with, and a ready data
    spec for `ReplayBufferManager` with `transition_writer()` or `gym_vector_writer(envs)`.

    Observations keep their space's shape and dtype (Discrete: int64 `[1]`, as SB3 stores them);
    actions are `[action_dim]` (Discrete: int64 `[1]`; Box: float32 unless the space's dtype is
    another non-float64 one).

    Args:
      observation_space: A gymnasium Box or Discrete space (a vector env's
        `single_observation_space`).
      action_space: A gymnasium Box or Discrete space (`single_action_space`).

    Returns:
      A `Trajectory` of `tf.TensorSpec`.

    Raises:
      ConfigError: For a space other than Box or Discrete (e.g. Dict observations).
    """
    from gymnasium import spaces

    fields = []
    for name, space in (("observation", observation_space), ("action", action_space)):
        if isinstance(space, spaces.Discrete):
            fields.append({"path": name, "dtype": "int64", "shape": [1]})
        elif isinstance(space, spaces.Box):
            dtype = np.dtype(space.dtype)
            if name == "action" and dtype == np.float64:
                dtype = np.dtype(np.float32)  # as SB3's ReplayBuffer casts it
            shape = list(space.shape) if name == "observation" else [int(np.prod(space.shape))]
            fields.append({"path": name, "dtype": dtype.name, "shape": shape})
        else:
            raise ConfigError(
                f"data_spec_for_spaces supports Box and Discrete {name} spaces, got {space!r}"
            )
    return spec_from_description(fields)


def trajectory_spec(env: Any, policy_info_spec: Any = ()) -> Any:
    """The per-step `Trajectory` spec for `env` (what an agent's `collect_data_spec` gives).

    Args:
      env: A TF-Agents py or TF environment.
      policy_info_spec: The policy's `info_spec`; `()` for none.

    Returns:
      A `Trajectory` of `tf.TensorSpec`/`BoundedTensorSpec`.
    """
    from tf_agents.trajectories import policy_step, trajectory

    return tensor_spec.from_spec(
        trajectory.from_transition(
            env.time_step_spec(),
            policy_step.PolicyStep(env.action_spec(), (), policy_info_spec),
            env.time_step_spec(),
        )
    )

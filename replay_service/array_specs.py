"""Former path of `replay_service.specs.arrays`, kept for existing imports."""

from replay_service.specs.arrays import (  # noqa: F401
    RESERVED_EXTRA_NAMES,
    TRAJECTORY_FIELDS,
    ArraySpec,
    StepType,
    Trajectory,
    extras_spec,
    is_tf_tensor,
    is_torch_tensor,
    space_spec,
    spec_for_spaces,
    to_numpy,
    trajectory_spec,
)

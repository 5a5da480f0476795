"""What an item is: data specs, array specs, windows and the storage layouts.

`replay_service.specs` was one module; its public names stay importable from here.
"""

from replay_service.specs.nests import (  # noqa: F401
    SPEC_TYPES,
    TRAJECTORY_DEFAULTS,
    FieldDescription,
    SpecType,
    check_collect_spec,
    collect_data_spec,
    data_spec_for_spaces,
    describe_spec,
    diff_descriptions,
    diff_value,
    flatten_with_paths,
    is_tf_spec,
    normalize_spec,
    numpy_dtype,
    spec_from_description,
    table_signature,
    tf_agents_available,
    to_array_spec,
    to_tf_spec,
    trajectory_spec,
    variable_container_spec,
)

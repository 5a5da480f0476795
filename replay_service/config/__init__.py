"""What a buffer is configured with: tables, sampling, timeouts, TOML files.

`replay_service.config` was one module; its public names stay importable from here.
"""

from replay_service.config.options import (  # noqa: F401
    DEFAULT_TABLE_NAME,
    DEFAULT_VARIABLE_TABLE_NAME,
    INT32_MAX,
    MAX_TIMEOUT_S,
    REMOVERS,
    SAMPLERS,
    SamplingConfig,
    TableConfig,
    Timeouts,
    VariableTableConfig,
    require_int,
    require_number,
    require_positive_int,
    to_ms,
    validate_manager_options,
    validate_table_name,
)

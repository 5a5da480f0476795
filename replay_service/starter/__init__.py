"""The starter-buffer application: fill a buffer from a baseline policy, copy it.

Starter buffers are replay buffers filled once from a baseline policy, then copied for
training. A starter buffer is an ordinary replay_service checkpoint directory,
`<output_dir>/<name>`:

    <output_dir>/
      <name>/                      replay_service.json, checkpoints/ckpt-*/, .reverb/, .lock
      <name>.summary.png           reward and action summary of what was collected
      .<name>.partial-<pid>/       only while a populate run is in progress

`populate` (`filling.py`) builds the buffer beside its final path and renames it into place only
when it is complete (`staging.py`). Training never writes into a starter buffer: `copy_buffer`
(`copying.py`) copies its newest checkpoint into the training run's own checkpoint directory,
which `ReplayBufferManager.load_replay_buffer()` then restores; a bare Reverb checkpoint root
(e.g. sbsim's) is adopted the same way (`adoption.py`). `options.py` holds `PopulateConfig`,
`naming.py` the names and paths, `sources.py` the environments, policies and data specs,
`results.py` what a run collected and `plots.py` its summary plot.

`replay_service.starter` was one module; its public names stay importable from here.
"""

from replay_service.starter.adoption import diff_columns
from replay_service.starter.copying import copy_buffer
from replay_service.starter.filling import STARTER_KEEP_CHECKPOINTS, Progress, populate
from replay_service.starter.naming import (
    MAX_BUFFER_NAME_LENGTH,
    SUMMARY_PLOT_SUFFIX,
    starter_buffer_path,
    summary_plot_path,
    validate_buffer_name,
)
from replay_service.starter.options import (
    DEFAULT_CAPACITY,
    DEFAULT_ENV,
    DEFAULT_NUM_ENVS,
    DEFAULT_NUM_RUNS,
    DEFAULT_OUTPUT_DIR,
    DEFAULT_POLICY,
    DEFAULT_SEQUENCE_LENGTH,
    DEFAULT_STEPS_PER_RUN,
    SEED_RANGE,
    PopulateConfig,
    check_capacity,
    max_new_items,
)
from replay_service.starter.plots import BUILDING_ACTION_NAMES, PLOT_DPI, write_summary_plot
from replay_service.starter.results import PopulateResult, StepRecorder, format_summary
from replay_service.starter.sources import (
    DATA_SPEC_ENV_PREFIX,
    load_data_spec,
    make_envs_and_policies,
    starter_data_spec,
)
from replay_service.starter.staging import COPY_TAG, OLD_TAG, PARTIAL_TAG, STORE_ENTRIES

__all__ = [
    "BUILDING_ACTION_NAMES",
    "COPY_TAG",
    "DATA_SPEC_ENV_PREFIX",
    "DEFAULT_CAPACITY",
    "DEFAULT_ENV",
    "DEFAULT_NUM_ENVS",
    "DEFAULT_NUM_RUNS",
    "DEFAULT_OUTPUT_DIR",
    "DEFAULT_POLICY",
    "DEFAULT_SEQUENCE_LENGTH",
    "DEFAULT_STEPS_PER_RUN",
    "MAX_BUFFER_NAME_LENGTH",
    "OLD_TAG",
    "PARTIAL_TAG",
    "PLOT_DPI",
    "SEED_RANGE",
    "STARTER_KEEP_CHECKPOINTS",
    "STORE_ENTRIES",
    "SUMMARY_PLOT_SUFFIX",
    "PopulateConfig",
    "PopulateResult",
    "Progress",
    "StepRecorder",
    "check_capacity",
    "copy_buffer",
    "diff_columns",
    "format_summary",
    "load_data_spec",
    "make_envs_and_policies",
    "max_new_items",
    "populate",
    "starter_buffer_path",
    "starter_data_spec",
    "summary_plot_path",
    "validate_buffer_name",
    "write_summary_plot",
]

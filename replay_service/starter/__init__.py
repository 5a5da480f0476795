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

`replay_service.starter` was one module; its public names stay importable from here, each
module imported on first use (a command's `--help` loads no TensorFlow).
"""

from __future__ import annotations

import importlib

# Public name -> the module of this package that defines it.
_EXPORTS: dict[str, tuple[str, ...]] = {
    "adoption": ("diff_columns",),
    "copying": ("copy_buffer",),
    "filling": (
        "STARTER_KEEP_CHECKPOINTS",
        "Progress",
        "populate",
    ),
    "naming": (
        "MAX_BUFFER_NAME_LENGTH",
        "SUMMARY_PLOT_SUFFIX",
        "starter_buffer_path",
        "summary_plot_path",
        "validate_buffer_name",
    ),
    "options": (
        "DATA_SPEC_ENV_PREFIX",
        "DEFAULT_CAPACITY",
        "DEFAULT_ENV",
        "DEFAULT_NUM_ENVS",
        "DEFAULT_NUM_RUNS",
        "DEFAULT_OUTPUT_DIR",
        "DEFAULT_POLICY",
        "DEFAULT_SEQUENCE_LENGTH",
        "DEFAULT_STEPS_PER_RUN",
        "SEED_RANGE",
        "PopulateConfig",
        "check_capacity",
        "max_new_items",
    ),
    "plots": (
        "BUILDING_ACTION_NAMES",
        "PLOT_DPI",
        "write_summary_plot",
    ),
    "results": (
        "PopulateResult",
        "StepRecorder",
        "format_summary",
    ),
    "sources": (
        "load_data_spec",
        "make_envs_and_policies",
        "starter_data_spec",
    ),
    "staging": (
        "COPY_TAG",
        "OLD_TAG",
        "PARTIAL_TAG",
        "STORE_ENTRIES",
    ),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)
_SUBMODULES = frozenset({*_EXPORTS, "envs", "policies"})


def __getattr__(name: str) -> object:
    """Imports a public name's module on first use (see `_EXPORTS`).

    Raises:
      AttributeError: If `name` is not a public name of replay_service.starter.
    """
    module_name = _MODULE_OF.get(name)
    if module_name is None:
        if name in _SUBMODULES:  # `replay_service.starter.envs` and the like
            return importlib.import_module(f"replay_service.starter.{name}")
        raise AttributeError(f"module 'replay_service.starter' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"replay_service.starter.{module_name}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF, *_SUBMODULES})

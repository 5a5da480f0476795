"""replay_service: a replay service for reinforcement learning built on DeepMind Reverb.

The public names are those of `__all__`; the command-line tools' modules are
`replay_service.cli.{serve,populate,demo}`. `replay_service.populate` is the function
`starter.populate`.
"""

import importlib
import os

# With the default polling strategy of the gRPC inside Reverb 0.13, a process streaming to several
# servers saw item confirmations picked up only by gRPC's 5 s backup poller. It must be set before
# the process opens its first gRPC channel; an explicit setting in the environment wins.
os.environ.setdefault("GRPC_POLL_STRATEGY", "epoll1")

# The command-line tools print only their own lines unless asked to be verbose; this must run
# before TensorFlow, Reverb or gym is imported (see replay_service.cli.output).
from replay_service.cli import output as cli_output

cli_output.configure()

# Every public name is imported from its module on first use (PEP 562), so that
# `import replay_service` imports neither TensorFlow, TF-Agents nor Reverb: the local backend
# runs where they are not installed.
_EXPORTS: dict[str, tuple[str, ...]] = {
    "specs.arrays": ("ArraySpec",),
    "storage.metadata": ("Checkpoint", "StoreMetadata"),
    "storage.store": ("CheckpointStore",),
    "config.options": ("DEFAULT_TABLE_NAME", "SamplingConfig", "TableConfig", "Timeouts"),
    "backends.reverb.tf_agents_buffer": ("ReplayBuffer",),
    "errors": (
        "BackendMismatchError",
        "BufferStateError",
        "CheckpointError",
        "CheckpointExistsError",
        "ConfigError",
        "ManagerClosedError",
        "NoCheckpointError",
        "PortInUseError",
        "ReplayServiceError",
        "ServerError",
        "ServerUnavailableError",
        "SpecMismatchError",
        "UnknownFormatError",
        "WriteTimeoutError",
    ),
    "manager": ("ReplayBufferManager",),
    "sample.nstep": ("NStepBatch", "NStepTargets", "n_step_targets", "windows_to_n_step"),
    "collect.observer": ("TrajectoryObserver",),
    "sample.priorities": (
        "BetaSchedule",
        "MaxPriorityTracker",
        "importance_weights",
        "update_priorities",
    ),
    "sample.rate_limit": ("LimiterState", "TrainSchedule"),
    "specs.windows": ("Masked", "padding_needed"),
    "distributed.sharding": ("ShardedCheckpoint", "ShardedReplayBuffer"),
    "distributed.shard_config": ("ShardedConfig", "load_sharded_config"),
    "distributed.shard_status": (
        "ShardedStats",
        "ShardedStatus",
        "format_sharded_status",
        "sharded_status",
    ),
    "specs.nests": ("data_spec_for_spaces",),
    "starter": ("PopulateConfig", "PopulateResult", "copy_buffer", "populate"),
    "monitoring.stats": ("BufferStats", "CheckpointStats", "TableStats"),
    "backends.reverb.tables": ("make_replay_tables", "make_table"),
    "sample.torch_streams": ("TorchBatchStream", "TorchSampleSource"),
    "sample.torch_dataset": ("TorchReplayDataset",),
    "sample.batches": ("TorchSampleInfo", "TransitionBatch"),
    "backends.reverb.torch_source": ("SampleSource",),
    "collect.transitions": ("TransitionWriter",),
    "sample.mixing": ("MixedSampleInfo",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [
    "DEFAULT_TABLE_NAME",
    "ArraySpec",
    "BackendMismatchError",
    "BetaSchedule",
    "BufferStateError",
    "BufferStats",
    "Checkpoint",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointStats",
    "CheckpointStore",
    "ConfigError",
    "LimiterState",
    "ManagerClosedError",
    "Masked",
    "MaxPriorityTracker",
    "MixedSampleInfo",
    "NStepBatch",
    "NStepTargets",
    "NoCheckpointError",
    "PopulateConfig",
    "PopulateResult",
    "PortInUseError",
    "ReplayBuffer",
    "ReplayBufferManager",
    "ReplayServiceError",
    "SampleSource",
    "SamplingConfig",
    "ServerError",
    "ServerUnavailableError",
    "ShardedCheckpoint",
    "ShardedConfig",
    "ShardedReplayBuffer",
    "ShardedStats",
    "ShardedStatus",
    "SpecMismatchError",
    "StoreMetadata",
    "TableConfig",
    "TableStats",
    "Timeouts",
    "TorchBatchStream",
    "TorchReplayDataset",
    "TorchSampleInfo",
    "TorchSampleSource",
    "TrainSchedule",
    "TrajectoryObserver",
    "TransitionBatch",
    "TransitionWriter",
    "UnknownFormatError",
    "WriteTimeoutError",
    "copy_buffer",
    "data_spec_for_spaces",
    "format_sharded_status",
    "importance_weights",
    "load_sharded_config",
    "make_replay_tables",
    "make_table",
    "n_step_targets",
    "padding_needed",
    "populate",
    "sharded_status",
    "update_priorities",
    "windows_to_n_step",
]
__version__ = "0.1.0"


# Top-level modules of the Reverb stack: a public name whose module needs one of them says so.
_REVERB_STACK = frozenset({"reverb", "tensorflow", "tf_agents", "tensorflow_probability", "gym"})


def __getattr__(name: str) -> object:
    """Imports a public name's module on first use (see `_EXPORTS`).

    Raises:
      AttributeError: If `name` is not a public name of replay_service.
    """
    module_name = _MODULE_OF.get(name)
    if module_name is None:
        raise AttributeError(f"module 'replay_service' has no attribute {name!r}")
    try:
        module = importlib.import_module(f"replay_service.{module_name}")
    except ImportError as e:
        if e.name not in _REVERB_STACK:
            raise
        raise ImportError(
            f"replay_service.{name} needs dm-reverb 0.13, TensorFlow 2.14 and TF-Agents 0.18 "
            f"(Linux x86_64, Python <= 3.11), and {e.name!r} does not import here ({e}); "
            "ReplayBufferManager(..., backend='local') runs without them",
            name=e.name,
        ) from e
    cli_output.after_imports()
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's attributes, the public names not imported yet included."""
    return sorted(set(globals()) | set(__all__))

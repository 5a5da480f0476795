"""replay_service: a replay service for reinforcement learning built on DeepMind Reverb."""

import os

# With the default polling strategy of the gRPC inside Reverb 0.13, a process streaming to several
# servers saw item confirmations picked up only by gRPC's 5 s backup poller. It must be set before
# the process opens its first gRPC channel; an explicit setting in the environment wins.
os.environ.setdefault("GRPC_POLL_STRATEGY", "epoll1")

# The command-line tools print only their own lines unless asked to be verbose; this must run
# before TensorFlow, Reverb or gym is imported (see replay_service.cli_output).
from replay_service import cli_output

cli_output.configure()

from replay_service.checkpoints import Checkpoint, CheckpointStore, StoreMetadata
from replay_service.config import DEFAULT_TABLE_NAME, SamplingConfig, TableConfig, Timeouts
from replay_service.datasets import ReplayBuffer
from replay_service.errors import (
    BufferStateError,
    CheckpointError,
    CheckpointExistsError,
    ConfigError,
    ManagerClosedError,
    NoCheckpointError,
    PortInUseError,
    ReplayServiceError,
    ServerError,
    ServerUnavailableError,
    SpecMismatchError,
    WriteTimeoutError,
)
from replay_service.manager import ReplayBufferManager
from replay_service.nstep import NStepBatch, NStepTargets, n_step_targets, windows_to_n_step
from replay_service.observers import TrajectoryObserver
from replay_service.priorities import (
    BetaSchedule,
    MaxPriorityTracker,
    importance_weights,
    update_priorities,
)
from replay_service.rate_limit import LimiterState, TrainSchedule
from replay_service.sequences import Masked, padding_needed
from replay_service.sharding import (
    ShardedCheckpoint,
    ShardedConfig,
    ShardedReplayBuffer,
    ShardedStats,
    ShardedStatus,
    format_sharded_status,
    load_sharded_config,
    sharded_status,
)
from replay_service.starter import PopulateConfig, PopulateResult, copy_buffer, populate
from replay_service.stats import BufferStats, CheckpointStats, TableStats
from replay_service.tables import make_replay_tables, make_table
from replay_service.writers import TransitionWriter

cli_output.after_imports()

__all__ = [
    "DEFAULT_TABLE_NAME",
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
    "TrainSchedule",
    "TrajectoryObserver",
    "TransitionBatch",
    "TransitionWriter",
    "WriteTimeoutError",
    "copy_buffer",
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

_TORCH_EXPORTS = (
    "SampleSource",
    "TorchBatchStream",
    "TorchReplayDataset",
    "TorchSampleInfo",
    "TransitionBatch",
)


def __getattr__(name: str) -> object:
    """Torch-based classes, imported on first use so `import replay_service` needs no torch."""
    if name in _TORCH_EXPORTS:
        from replay_service import torch_sampling

        return getattr(torch_sampling, name)
    raise AttributeError(f"module 'replay_service' has no attribute {name!r}")

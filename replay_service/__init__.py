"""replay_service: a replay service for reinforcement learning built on DeepMind Reverb."""

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
from replay_service.observers import TrajectoryObserver
from replay_service.starter import PopulateConfig, PopulateResult, copy_buffer, populate
from replay_service.tables import make_replay_tables, make_table

__all__ = [
    "DEFAULT_TABLE_NAME",
    "BufferStateError",
    "Checkpoint",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointStore",
    "ConfigError",
    "ManagerClosedError",
    "NoCheckpointError",
    "PopulateConfig",
    "PopulateResult",
    "PortInUseError",
    "ReplayBuffer",
    "ReplayBufferManager",
    "ReplayServiceError",
    "SamplingConfig",
    "ServerError",
    "ServerUnavailableError",
    "SpecMismatchError",
    "StoreMetadata",
    "TableConfig",
    "Timeouts",
    "TrajectoryObserver",
    "WriteTimeoutError",
    "copy_buffer",
    "make_replay_tables",
    "make_table",
    "populate",
]
__version__ = "0.1.0"

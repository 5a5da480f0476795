"""Scale-out over several Reverb servers: one table, N shards, chosen by configuration.

Every shard is a `replay-server` serving the same table (name, data spec, sequence length and
capacity per shard). A `ShardedReplayBuffer` owns one remote `ReplayBufferManager` per shard:

    [sharding]
    addresses = ["localhost:8000", "localhost:8001"]

    config = load_sharded_config("configs/sharded.toml")
    with ShardedReplayBuffer(config, data_spec, capacity=50_000).load() as shards:
        observer = shards.observer(collector_id)      # shard collector_id % N
        dataset = shards.get_dataset(batch_size=64)   # every shard, weighted by its size
        shards.status(); shards.checkpoint()

Writers: collector `i` always writes to shard `i % N`, so a collector's episodes stay on one
server and the spread is deterministic. Readers: a dataset draws each item from shard `k` with
probability size_k / sum(sizes), which is uniform sampling over the union of the shards.
Checkpoints: one id for a checkpoint on every shard, recorded on the client (see `checkpoint`).

gRPC polling: importing replay_service sets `GRPC_POLL_STRATEGY=epoll1` unless the environment
already sets it. With the default strategy of the gRPC inside Reverb 0.13, a process writing to
three or more servers had the item confirmations of some streams picked up only by gRPC's
5-second backup poller, so every flush of those observers took 5 s. The setting takes effect only
if the process has created no gRPC channel yet; export it before starting to be sure.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import tensorflow as tf

from replay_service.backends.reverb.liveness import python_calls_stopped
from replay_service.backends.reverb.tf_agents_buffer import ReplayBuffer
from replay_service.collect.observer import TrajectoryObserver
from replay_service.config.options import DEFAULT_TABLE_NAME, Timeouts, require_positive_int
from replay_service.distributed.shard_config import (
    ShardedConfig,
)
from replay_service.distributed.shard_status import (
    ShardedStats,
    ShardedStatus,
    on_every_shard,
    sharded_status,
)
from replay_service.errors import (
    BufferStateError,
    ConfigError,
    ManagerClosedError,
)
from replay_service.manager import ReplayBufferManager
from replay_service.monitoring.stats import total_table
from replay_service.storage.metadata import Checkpoint
from replay_service.storage.store import CheckpointStore

_T = TypeVar("_T")
_log = logging.getLogger(__name__)

DEFAULT_PREFETCH = 3
# The mixture draws the shard of every block of up to this many items of a batch (see
# `block_size`), at least MIN_BLOCKS_PER_BATCH blocks a batch: mixing item by item in tf.data
# cost more than sampling them (a third of one server's rate from two shards).
MAX_SHARD_FETCH = 16
MIN_BLOCKS_PER_BATCH = 16
SHARD_PARALLEL_CALLS = 3
CHECKPOINT_ID_PREFIX = "sharded-"


# ------------------------------------------------------------------------------ checkpoints


@dataclasses.dataclass(frozen=True)
class ShardedCheckpoint:
    """One checkpoint request sent to every shard under a single id.

    Reverb's checkpoint RPC carries no name, so the id exists only here, on the client: keep
    this record (`to_json()`) next to whatever else the run saves. Each server writes its
    checkpoint at `paths[address]` in its Reverb root and, within about a second, moves it into
    its own `checkpoints/ckpt-NNNNNNNN/` (whose `replay_service_checkpoint.json` names the
    original directory as `reverb_name`; see `find_adopted_checkpoint`).

    Attributes:
      checkpoint_id: The id shared by every shard's checkpoint.
      created_at: When the request was sent (UTC, ISO 8601).
      paths: Shard address -> path of the checkpoint on that server's machine.
    """

    checkpoint_id: str
    created_at: str
    paths: Mapping[str, str]

    def to_json(self) -> dict[str, Any]:
        """Returns a JSON-compatible record of the checkpoint."""
        return {
            "checkpoint_id": self.checkpoint_id,
            "created_at": self.created_at,
            "paths": dict(self.paths),
        }


def new_checkpoint_id() -> str:
    """Returns a fresh, sortable checkpoint id: "sharded-<UTC timestamp>-<8 hex digits>"."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    return f"{CHECKPOINT_ID_PREFIX}{stamp}-{uuid.uuid4().hex[:8]}"


def find_adopted_checkpoint(
    checkpoint_dir: str | os.PathLike[str], reverb_path: str
) -> Checkpoint | None:
    """Finds, in a server's checkpoint directory, the complete checkpoint made from `reverb_path`.

    Args:
      checkpoint_dir: The shard server's `--checkpoint_dir` (readable from this machine).
      reverb_path: `ShardedCheckpoint.paths[address]` for that shard.

    Returns:
      The checkpoint under `checkpoints/`, or None if the server has not moved it there yet
      (or retention already deleted it).
    """
    name = os.path.basename(os.path.normpath(reverb_path))
    for checkpoint in CheckpointStore(checkpoint_dir).checkpoints():
        if checkpoint.info.get("reverb_name") == name:
            return checkpoint
    return None


# -------------------------------------------------------------------------------- the buffer


class ShardedReplayBuffer:
    """One table spread over several `replay-server`s, one remote `ReplayBufferManager` each.

    Call `load()` (attach to the shards' tables as they are) or `create()` (start empty) before
    anything else. Every shard must serve `table_name` with the same data spec, sequence
    length and `capacity` (items per shard; the buffer holds up to N * capacity).

    Args:
      config: The shards' addresses.
      data_spec: Per-step spec, e.g. `agent.collect_data_spec`.
      capacity: Items per shard, as configured on every server.
      sequence_length: Steps per item.
      table_name: The table every shard serves.
      timeouts: Bounds on every blocking call, per shard.
      stride_length: Observers create an item every `stride_length` steps.
      layout: The shards' table layout: "auto" (the default: each server's, read on
        connecting), "nested" or "packed" (see `config.TableConfig`).

    Raises:
      ConfigError: If a value is invalid.
    """

    def __init__(
        self,
        config: ShardedConfig,
        data_spec: Any,
        capacity: int,
        sequence_length: int = 2,
        *,
        table_name: str = DEFAULT_TABLE_NAME,
        timeouts: Timeouts | None = None,
        stride_length: int = 1,
        layout: str = "auto",
    ) -> None:
        if not isinstance(config, ShardedConfig):
            raise ConfigError(f"config must be a ShardedConfig, got {type(config).__name__}")
        self._config = config
        self._timeouts = timeouts or Timeouts()
        self._managers = tuple(
            ReplayBufferManager(
                data_spec,
                capacity,
                sequence_length=sequence_length,
                table_name=table_name,
                server_address=address,
                timeouts=self._timeouts,
                stride_length=stride_length,
                layout=layout,
            )
            for address in config.addresses
        )
        self._buffers: tuple[ReplayBuffer, ...] = ()
        self._closed = False

    # ------------------------------------------------------------------------ properties

    @property
    def config(self) -> ShardedConfig:
        """The shards' addresses."""
        return self._config

    @property
    def addresses(self) -> tuple[str, ...]:
        """Every shard's "host:port", in shard order."""
        return self._config.addresses

    @property
    def num_shards(self) -> int:
        """Number of shards."""
        return self._config.num_shards

    @property
    def table_name(self) -> str:
        """The table every shard serves."""
        return self._managers[0].table_name

    @property
    def managers(self) -> tuple[ReplayBufferManager, ...]:
        """The per-shard managers, in shard order."""
        return self._managers

    def shard_index(self, collector_id: int) -> int:
        """The shard collector `collector_id` writes to (`collector_id % num_shards`)."""
        return self._config.shard_index(collector_id)

    # ------------------------------------------------------------------------- lifecycle

    def load(self) -> ShardedReplayBuffer:
        """Attaches to every shard's table as it is (connecting in parallel).

        Returns:
          This object, for `with ShardedReplayBuffer(...).load() as shards:`.

        Raises:
          ServerUnavailableError: If a shard does not answer within `timeouts.connect`; the
            message names its address. Nothing stays connected.
          SpecMismatchError: If a shard's table differs from what this object was given.
          BufferStateError: If `load()` or `create()` already ran.
        """
        return self._open(lambda _, m: m.load_replay_buffer()[0])

    def create(self, *, overwrite: bool = False) -> ShardedReplayBuffer:
        """Attaches to every shard's table, which must be empty (or is emptied).

        Args:
          overwrite: Empty shards that hold items instead of refusing.

        Returns:
          This object.

        Raises:
          CheckpointExistsError: If a shard holds items and `overwrite` is False.
          ServerUnavailableError, SpecMismatchError, BufferStateError: As `load()`.
        """
        return self._open(lambda _, m: m.create_replay_buffer(overwrite=overwrite)[0])

    def close(self) -> None:
        """Flushes and closes every observer and releases every shard. Idempotent.

        No checkpoint is taken; the servers keep their items.
        """
        if self._closed:
            return
        self._closed = True
        for manager in self._managers:
            manager.close()
        self._buffers = ()

    def __enter__(self) -> ShardedReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------------------- using it

    def observer(self, collector_id: int) -> TrajectoryObserver:
        """Returns a new observer writing to shard `collector_id % num_shards`.

        Use one observer per collector (an observer holds the collector's current episode).

        Raises:
          ConfigError: If `collector_id` is not an integer >= 0.
          BufferStateError: If neither `load()` nor `create()` ran.
        """
        self._require_open()
        manager = self._managers[self.shard_index(collector_id)]
        return manager.get_replay_buffer_and_observer()[1]

    def shard_sizes(self) -> dict[str, int]:
        """Returns shard address -> items in its table (queried in parallel).

        Raises:
          ServerUnavailableError: If a shard does not answer (naming it).
        """
        self._require_open()
        sizes = on_every_shard(list(self._managers), lambda _, m: m.num_frames())
        return dict(zip(self.addresses, sizes, strict=True))

    def num_frames(self) -> int:
        """Returns the number of items over all shards."""
        return sum(self.shard_sizes().values())

    def get_dataset(
        self,
        batch_size: int,
        num_steps: int | None = None,
        *,
        reweight_every: int | None = None,
        prefetch: int = DEFAULT_PREFETCH,
        seed: int | None = None,
    ) -> tf.data.Dataset:
        """Returns `(trajectory, sample_info)` batches drawn from every shard, weighted by size.

        Each item comes from shard k with probability size_k / sum(sizes), i.e. uniformly from
        the union when the shards sample uniformly. The shard is drawn for every block of
        `block_size(batch_size)` consecutive items of a batch (16 of 256, 4 of 64, 1 below
        32 or for a prime size), at least 16 draws a batch: drawing it item by item in tf.data
        cost more than sampling the items (a third of one server's rate from two shards, now
        about 0.9 of it). Sizes are read when the dataset is created
        and, with `reweight_every`, again every `reweight_every` batches. Without it the
        weights stay fixed: a shard that was empty at creation is never sampled, so create a
        new dataset once the shards filled (full shards of equal capacity weigh the same). If
        every shard is empty, all are weighted equally and iterating raises the single-server
        error (`tf.errors.InvalidArgumentError`, no item within `Timeouts.sample`) unless items
        arrive in time. With one shard this is that shard's `get_dataset`.

        Limits: each re-weighting restarts the shards' sample streams (a few hundred
        milliseconds), so keep `reweight_every` in the hundreds of batches.
        `sample_info.key` identifies an item within its shard only, so priority updates must be
        sent to the right shard by the caller. With prioritized shards the weights are still
        sizes, not total priorities.

        Args:
          batch_size: Items per batch.
          num_steps: Steps per sampled sequence; None or `sequence_length` returns whole items.
          reweight_every: Batches between re-reading the shard sizes; None never re-reads.
            Each re-read restarts the per-shard sample streams.
          prefetch: Batches prefetched.
          seed: Seed of the shard choice.

        Returns:
          An endless dataset of batches.

        Raises:
          ConfigError: If a size is not a positive integer.
          ServerUnavailableError: If a shard does not answer when sizes are read.
        """
        self._require_open()
        for name, value in (("batch_size", batch_size), ("prefetch", prefetch)):
            require_positive_int(name, value, maximum=None)
        if reweight_every is not None:
            require_positive_int("reweight_every", reweight_every, maximum=None)
        if self.num_shards == 1:
            return self._managers[0].get_dataset(batch_size, num_steps, prefetch=prefetch)
        if reweight_every is None:
            blocks = self._fixed_mixture(batch_size, num_steps, seed)
        else:
            blocks = self._reweighted_mixture(
                batch_size, num_steps, seed, reweight_every * (batch_size // block_size(batch_size))
            )
        return self._mixture(blocks, batch_size).prefetch(prefetch)

    def status(self) -> ShardedStatus:
        """Returns every shard's counters and the table's totals.

        Raises:
          ServerUnavailableError: If a shard does not answer within `timeouts.connect`.
        """
        self._require_open()
        return sharded_status(self.addresses, self.table_name, self._timeouts.connect)

    def stats(self) -> ShardedStats:
        """Returns every shard's stats (read in parallel) and the table's totals.

        Rates are measured per shard as in `ReplayBufferManager.stats()` and summed.

        Raises:
          ServerUnavailableError: If a shard does not answer within `timeouts.connect`.
        """
        self._require_open()
        shards = tuple(on_every_shard(list(self._managers), lambda _, m: m.stats()))
        name = self.table_name
        return ShardedStats(
            table_name=name,
            shards=shards,
            total=total_table(name, [shard.table(name) for shard in shards]),
        )

    def checkpoint(self, checkpoint_id: str | None = None) -> ShardedCheckpoint:
        """Flushes observers and checkpoints every shard (in parallel) under one id.

        The id is not sent to the servers (Reverb's checkpoint RPC carries none) and nothing is
        written into their checkpoint directories, which belong to the servers: the returned
        record is the only place the id lives. The shards are checkpointed at nearly, not
        exactly, the same moment; items written meanwhile may be in some shards' checkpoints
        and not in others'.

        Args:
          checkpoint_id: The id to record; None generates one (`new_checkpoint_id`).

        Returns:
          The id, the time and each shard's checkpoint path.

        Raises:
          ConfigError: If `checkpoint_id` is not a non-empty string.
          CheckpointError: If a shard's checkpoint fails or exceeds `timeouts.checkpoint`.
        """
        self._require_open()
        if checkpoint_id is None:
            checkpoint_id = new_checkpoint_id()
        if not isinstance(checkpoint_id, str) or not checkpoint_id.strip():
            raise ConfigError(f"checkpoint_id must be a non-empty string, got {checkpoint_id!r}")
        created_at = datetime.datetime.now(datetime.UTC).isoformat()
        paths = on_every_shard(list(self._managers), lambda _, m: m.checkpoint())
        record = ShardedCheckpoint(
            checkpoint_id=checkpoint_id,
            created_at=created_at,
            paths=dict(zip(self.addresses, paths, strict=True)),
        )
        _log.info("sharded checkpoint %s: %s", checkpoint_id, record.paths)
        return record

    # ---------------------------------------------------------------------------- helpers

    def _open(self, attach: Callable[[int, ReplayBufferManager], ReplayBuffer]) -> Any:
        self._require_not_closed()
        if self._buffers:
            raise BufferStateError("this ShardedReplayBuffer is already attached to its shards")
        try:
            self._buffers = tuple(on_every_shard(list(self._managers), attach))
        except BaseException:
            self.close()
            raise
        return self

    def _shard_blocks(self, index: int, batch_size: int, num_steps: int | None) -> tf.data.Dataset:
        """Shard `index`'s items in blocks of `block_size(batch_size)`."""
        block = block_size(batch_size)
        manager = self._managers[index]
        if num_steps not in (None, manager.sequence_length):
            # Shorter sequences: TF-Agents' pipeline splits the items.
            return self._buffers[index].as_dataset(
                sample_batch_size=block,
                num_steps=num_steps,
                num_parallel_calls=min(block, SHARD_PARALLEL_CALLS),
            )
        # Whole items: the shard's own pipeline, read in batches of the mixture's size and cut
        # into blocks (a reshape: no item is copied).
        blocks = batch_size // block

        def cut(*batch: Any) -> Any:
            return tf.nest.map_structure(
                lambda t: tf.reshape(t, [blocks, block, *t.shape[1:]]), batch
            )

        return manager.get_dataset(batch_size, prefetch=1).map(cut).unbatch()

    def _mixture(self, blocks: tf.data.Dataset, batch_size: int) -> tf.data.Dataset:
        """Batches of `batch_size` items from a stream of mixed blocks."""
        block = block_size(batch_size)

        def join(*batch: Any) -> Any:
            return tf.nest.map_structure(lambda t: tf.reshape(t, [batch_size, *t.shape[2:]]), batch)

        return blocks.batch(batch_size // block, drop_remainder=True).map(join)

    def _fixed_mixture(
        self, batch_size: int, num_steps: int | None, seed: int | None
    ) -> tf.data.Dataset:
        weights = _size_weights(list(self.shard_sizes().values()))
        chosen = [i for i, w in enumerate(weights) if w > 0]
        return tf.data.Dataset.sample_from_datasets(
            [self._shard_blocks(i, batch_size, num_steps) for i in chosen],
            weights=[weights[i] for i in chosen],
            seed=seed,
        )

    def _reweighted_mixture(
        self, batch_size: int, num_steps: int | None, seed: int | None, blocks_per_round: int
    ) -> tf.data.Dataset:
        def read_weights() -> tf.Tensor:
            return tf.constant(_size_weights(list(self.shard_sizes().values())), tf.float32)

        stopped = python_calls_stopped()
        equal = tf.fill([self.num_shards], 1.0 / self.num_shards)

        # Neither function is converted by AutoGraph (they use no Python control flow on
        # tensors): converting `one_round` converted every function building the shards'
        # datasets, which took seconds of CPU on each first `get_dataset` of a process.
        @tf.autograph.experimental.do_not_convert
        def weights(_: tf.Tensor) -> tf.Tensor:
            # At exit, equal weights without calling Python (see `python_calls_stopped`).
            return tf.cond(
                stopped,
                lambda: equal,
                lambda: tf.ensure_shape(
                    tf.py_function(read_weights, [], tf.float32), [self.num_shards]
                ),
            )

        @tf.autograph.experimental.do_not_convert
        def one_round(weights: tf.Tensor) -> tf.data.Dataset:
            shards = [self._shard_blocks(i, batch_size, num_steps) for i in range(self.num_shards)]
            mixture = tf.data.Dataset.sample_from_datasets(shards, weights=weights, seed=seed)
            return mixture.take(blocks_per_round)

        rounds = tf.data.Dataset.from_tensors(0).repeat().map(weights)
        return rounds.flat_map(one_round)

    def _require_not_closed(self) -> None:
        if self._closed:
            raise ManagerClosedError("this ShardedReplayBuffer is closed; create a new one")

    def _require_open(self) -> None:
        self._require_not_closed()
        if not self._buffers:
            raise BufferStateError("no shards attached yet: call load() or create() first")


def block_size(batch_size: int) -> int:
    """Items the mixture takes from one shard at a time in a batch of `batch_size`.

    The largest divisor of `batch_size` of at most `MAX_SHARD_FETCH` that leaves at least
    `MIN_BLOCKS_PER_BATCH` blocks in a batch (1 for small or prime sizes).
    """
    largest = min(MAX_SHARD_FETCH, batch_size // MIN_BLOCKS_PER_BATCH)
    return next((b for b in range(largest, 1, -1) if batch_size % b == 0), 1)


def _size_weights(sizes: Sequence[int]) -> list[float]:
    """Shard weights proportional to `sizes`; all equal when every shard is empty."""
    total = sum(sizes)
    if total <= 0:
        return [1.0 / len(sizes)] * len(sizes)
    return [size / total for size in sizes]


__all__ = [
    "ShardedCheckpoint",
    "ShardedReplayBuffer",
    "block_size",
    "find_adopted_checkpoint",
    "new_checkpoint_id",
]

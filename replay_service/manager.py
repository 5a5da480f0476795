"""`ReplayBufferManager`: owns the lifecycle of one replay buffer.

A facade: each method validates, checks the backend's capabilities, and delegates to the backend,
to `replay_service.collect` (given a `CollectView`) or `replay_service.sample` (a `SampleView`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from replay_service.backends import Backend, Capability
from replay_service.backends.configure import configure, configure_spaces
from replay_service.backends.lifecycle import BufferLifecycle
from replay_service.backends.reverb.platform import inspect_patch
from replay_service.collect import gym_vector, hindsight
from replay_service.collect import view as collect_view
from replay_service.collect import warm_up as warm_up_lib
from replay_service.config.options import (
    DEFAULT_KEEP,
    DEFAULT_TABLE_NAME,
    SamplingConfig,
    TableConfig,
    Timeouts,
)
from replay_service.monitoring.monitor import BufferMonitor
from replay_service.monitoring.stats import BufferStats, checkpoint_stats
from replay_service.sample.view import SampleView
from replay_service.specs.layouts import AUTO
from replay_service.storage import export_target, importing

# TF-Agents' PolicySaver needs it before the first buffer exists (no TensorFlow is imported).
inspect_patch.patch_inspect()

if TYPE_CHECKING:
    import reverb
    import tensorflow as tf

    from replay_service.backends.reverb.handles import TableHandle
    from replay_service.backends.reverb.tf_agents_buffer import ReplayBuffer
    from replay_service.collect.observer import TrajectoryObserver
    from replay_service.collect.transitions import TransitionWriter
    from replay_service.sample.epochs import EpochBatches
    from replay_service.sample.priorities import MaxPriorityTracker
    from replay_service.sample.rate_limit import TrainSchedule
    from replay_service.sample.recent import RecentBatches
    from replay_service.sample.torch_dataset import TorchReplayDataset
    from replay_service.sample.torch_streams import TorchBatchStream


class ReplayBufferManager:
    """Creates, restores, samples and checkpoints one replay buffer.

    Embedded mode (the default) runs a Reverb server in this process, checkpointing into
    `checkpoint_dir`. Remote mode (`server_address="host:port"`) uses a running server
    (`replay-server`), which owns its checkpoints. The local backend keeps the tables in this
    process without Reverb, with the same API and checkpoint protocol
    (`replay_service.backends.local.backend`); remote mode, sharding, `mixed_dataset`,
    `train_schedule` and `replay-server` are Reverb-only.

    Args:
      data_spec: Per-step spec of what is stored, e.g. `agent.collect_data_spec`.
      capacity: Maximum number of items kept; the oldest is evicted first (by default).
      checkpoint_dir: Directory holding this buffer's checkpoints (embedded mode, required).
      sequence_length: Consecutive steps per item; `num_frames()` counts these items.
      table_name: Name of the primary table.
      sampling: Sampler, remover and rate limiter; uniform with `MinSize(1)` by default.
      server_address: "host:port" of a running server; None starts an embedded one.
      port: Port of the embedded server (all interfaces); None picks a free one.
      timeouts: Bounds on every blocking call.
      keep_checkpoints: Complete checkpoints retained in `checkpoint_dir`.
      stride_length: The observer creates an item every `stride_length` steps.
      extra_tables: More tables fed by every collector, sampled by `table=`.
      pad_end_of_episode: Pad episodes' ends so every step is in an item (`specs.windows`).
      checkpoint_interval_s: Embedded: checkpoint every this many seconds; None: on call.
      summary_dir: Write `stats()` as TensorBoard scalars there (`monitoring.summaries`).
      summary_interval_s: Seconds between summary writes.
      backend: "reverb", "local" or "auto": the backend of `checkpoint_dir`'s newest
        checkpoint, else Reverb where dm-reverb imports, else local (`backends.resolve_auto`).
      storage: Local backend: "memory" or "memmap" (files in `<checkpoint_dir>/.memmap`).
      layout: How Reverb tables store steps: "packed" (one `uint8` row per step;
        `specs.packed`), "nested" (one column per field, TF-Agents') or "auto": the layout of
        what exists, else "packed" (`backends.resolve_auto_layout`); local refuses "packed".
      seed: Local backend: seed of the tables' samplers (an integer >= 0); None: fresh entropy.
      device: Local backend: the torch device the tables' storage lives on and batches are
        gathered on ("cpu", "cuda:1"; needs storage="memory"); None: host memory.
      frame_stack, frame_axis: Observations are stacks of `frame_stack` frames on axis 0
        (gymnasium) or -1 (SB3), each step storing one frame (`specs.frames`, `specs.framed`).
      compression: Local backend: codec of large fields, "lz4" (recommended), "zstd" or None.

    Raises:
      ConfigError: If a value is invalid (capacity <= 0, no checkpoint_dir in embedded mode, a
        NUL in a path, two tables with one name...), or an item or the local tables cannot fit
        the memory or disk available, before anything is allocated (`specs.sizes`).
      SpecMismatchError: If `data_spec` is not a TF-Agents `Trajectory` of tensor specs.
    """

    def __init__(
        self,
        data_spec: Any,
        capacity: int,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        sequence_length: int = 2,
        *,
        table_name: str = DEFAULT_TABLE_NAME,
        sampling: SamplingConfig | None = None,
        server_address: str | None = None,
        port: int | None = None,
        timeouts: Timeouts | None = None,
        keep_checkpoints: int = DEFAULT_KEEP,
        stride_length: int = 1,
        extra_tables: Sequence[TableConfig] = (),
        pad_end_of_episode: bool = False,
        checkpoint_interval_s: float | None = None,
        summary_dir: str | os.PathLike[str] | None = None,
        summary_interval_s: float = 30.0,
        backend: str = "auto",
        storage: str = "memory",
        layout: str = AUTO,
        seed: int | None = None,
        device: str | None = None,
        frame_stack: int | None = None,
        frame_axis: int = 0,
        compression: str | None = None,
    ) -> None:
        # Every argument but the summaries' is the backend's (`backends.configure` checks them).
        implementation, options = configure(
            data_spec,
            capacity,
            checkpoint_dir,
            sequence_length,
            table_name=table_name,
            sampling=sampling,
            server_address=server_address,
            port=port,
            timeouts=timeouts,
            keep_checkpoints=keep_checkpoints,
            stride_length=stride_length,
            extra_tables=extra_tables,
            pad_end_of_episode=pad_end_of_episode,
            checkpoint_interval_s=checkpoint_interval_s,
            backend=backend,
            storage=storage,
            layout=layout,
            seed=seed,
            device=device,
            frame_stack=frame_stack,
            frame_axis=frame_axis,
            compression=compression,
        )
        self.backend = implementation.kind
        self._backend: Backend = implementation.from_options(options)
        self._data_spec, self._stored_spec = data_spec, options.stored_spec
        self._timeouts = options.timeouts
        self._state = BufferLifecycle(self._backend)  # none yet, open or closed
        # Observers and writers (flushed, then closed); the buffer as collect and sample see it.
        self._writers = collect_view.Writers()
        self._collect = collect_view.CollectView(
            lambda: self.py_client,
            self._backend,
            data_spec,
            stride_length,
            self._timeouts,
            self._writers,
        )
        limited = Capability.TRAIN_SCHEDULE in self._backend.capabilities
        self._sample = SampleView(
            backend=self._backend,
            require_client=self._state.client,
            require_buffer=self._state.replay_buffer,
            stored_spec=self._stored_spec,
            writers=self._writers,
            timeouts=self._timeouts,
            limiter_state=self._backend.limiter_state if limited else None,
            split_sequences=lambda what: self._backend.require(Capability.SPLIT_SEQUENCES, what),
        )
        self._monitor = BufferMonitor(summary_dir, summary_interval_s)

    @classmethod
    def from_spaces(
        cls,
        observation_space: Any,
        action_space: Any,
        *,
        capacity: int,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        sequence_length: int = 2,
        backend: str = "auto",
        extras: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> ReplayBufferManager:
        """A manager whose data spec is built from gymnasium spaces
        (`specs.nests.data_spec_for_spaces`; extra per-step fields go into `policy_info`).

        Args:
          observation_space: A gymnasium space (Box, Discrete, MultiDiscrete, MultiBinary,
            Dict/Tuple nests), e.g. a vector env's `single_observation_space`.
          action_space: The action space, likewise.
          capacity, checkpoint_dir, sequence_length: As `ReplayBufferManager`'s.
          backend: "auto" (`backends.resolve_auto`: local unless Reverb's checkpoint or option
            is there), "reverb" or "local".
          extras: Name -> one step's spec (`(shape, dtype)`, an `ArraySpec`/`tf.TensorSpec` or
            a gymnasium space), e.g. `{"hidden": ((64,), np.float32)}`; None: none.
          **options: Any other `ReplayBufferManager` argument (e.g. `frame_stack=4`).

        Raises:
          ConfigError: For an unsupported space, a bad extra (a reserved name, shape or dtype),
            naming it and its value, or an option or sizes as `ReplayBufferManager` refuses.
        """
        data_spec, chosen = configure_spaces(
            observation_space, action_space, extras, backend, checkpoint_dir, options
        )
        return cls(data_spec, capacity, checkpoint_dir, sequence_length, backend=chosen, **options)

    @property
    def table_name(self) -> str:
        """Name of the primary table."""
        return self.table_config.name

    @property
    def tables(self) -> tuple[TableConfig, ...]:
        """Every table of the buffer: the primary one first, then `extra_tables`."""
        return self._backend.tables

    @property
    def table_config(self) -> TableConfig:
        """Name, capacity, sequence length and sampling of the primary table."""
        return self._backend.tables[0]

    @property
    def sequence_length(self) -> int:
        """Steps per item."""
        return self.table_config.sequence_length

    @property
    def checkpoint_dir(self) -> str | None:
        """Absolute checkpoint directory (embedded mode), else None."""
        return self._backend.checkpoint_dir

    @property
    def data_spec(self) -> Any:
        """The per-step data spec this manager was given."""
        return self._data_spec

    @property
    def stored_spec(self) -> Any:
        """What each step stores: `data_spec`, or `Masked(data_spec, mask)` when padded."""
        return self._stored_spec

    @property
    def timeouts(self) -> Timeouts:
        """Bounds on every blocking call."""
        return self._timeouts

    @property
    def server_address(self) -> str:
        """ "host:port" of the server in use.

        Raises:
          BufferStateError: If no buffer was created or loaded yet.
        """
        return self._state.client().server_address

    @property
    def py_client(self) -> reverb.Client:
        """The client of the server in use (local: a `LocalClient`; packed layout: a
        `PackingClient`, so TF-Agents' own observers given it write this buffer's items)."""
        return self._state.users_client()

    def create_replay_buffer(self, *, overwrite: bool = False) -> tuple[ReplayBuffer, Any]:
        """Starts a new, empty buffer; returns `(replay_buffer, observer)`: a TF-Agents
        `ReverbReplayBuffer` and a `TrajectoryObserver` for an `Actor` or driver.

        Args:
          overwrite: Embedded: delete `checkpoint_dir`'s checkpoints (never other files).
            Remote: empty non-empty tables.

        Raises:
          CheckpointExistsError: If checkpoints (or remote items) exist and not `overwrite`.
          CheckpointError: If `checkpoint_dir` is foreign, not writable or in use.
          PortInUseError, ServerUnavailableError: If the server cannot be started or reached.
          BufferStateError: If this manager already has a buffer.
        """
        self._state.require_none()
        return self._hand_out(self._backend.create(overwrite))

    def load_replay_buffer(self) -> tuple[ReplayBuffer, Any]:
        """Restores the newest complete checkpoint (embedded) or attaches to the server's tables;
        returns `(replay_buffer, observer)` as `create_replay_buffer`.

        Raises:
          NoCheckpointError: If `checkpoint_dir` is missing, empty or holds no checkpoint.
          CheckpointError: If it is foreign, in use, or the checkpoint cannot be restored.
          SpecMismatchError: If what is stored (spec, tables, lengths, capacities) differs from
            this manager's, naming every differing field.
          BufferStateError: If this manager already has a buffer.
        """
        self._state.require_none()
        return self._hand_out(self._backend.load())

    def get_replay_buffer_and_observer(self) -> tuple[ReplayBuffer, Any]:
        """The buffer created or loaded before, with a new observer (BufferStateError before)."""
        return self._state.replay_buffer(), self.observer()

    def observer(
        self, *, pad_end_of_episodes: bool = False, tile_end_of_episodes: bool = False
    ) -> TrajectoryObserver:
        """Returns a new observer of every table; with the flags, it pads as TF-Agents'
        `ReverbAddTrajectoryObserver` options of those names (`collect.view.observer`).

        Raises:
          BufferStateError, ConfigError: No buffer yet; a bad flag, or tables that pad already.
        """
        return collect_view.observer(self._collect, pad_end_of_episodes, tile_end_of_episodes)

    def close(self) -> None:
        """Closes collectors, stops the embedded server and releases the directory (no checkpoint:
        call `checkpoint()` first). Idempotent."""
        if self._state.closed:
            return
        self._state.closed = True
        try:
            self._writers.close_all()
        finally:
            self._monitor.close()
            self._state.close()  # its datasets and streams fail, not block; the backend stops

    def __len__(self) -> int:
        """`num_frames()`: the items of the primary table now (raises as it does)."""
        return self.num_frames()

    def __bool__(self) -> bool:
        """Always True, whatever the size (use `len(manager)` for that)."""
        return True

    def __enter__(self) -> ReplayBufferManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_dataset(
        self,
        batch_size: int,
        num_steps: int | None = None,
        *,
        num_parallel_calls: int = 3,
        prefetch: int = 3,
        table: str | None = None,
    ) -> tf.data.Dataset:
        """Returns a tf.data dataset of `(trajectory, sample_info)` batches of one table
        (`Backend.dataset`): whole items for `num_steps` None or `sequence_length`, else split ones;
        `num_parallel_calls` unpack those, `prefetch` batches are prefetched.

        Raises:
          ConfigError: If a size or `table` (None: the primary one) is invalid (`SampleView`).
          tf.errors.InvalidArgumentError: When iterating, if nothing can be sampled within
            `timeouts.sample`, the server is lost, or the manager was closed.
        """
        return self._sample.dataset(batch_size, num_steps, num_parallel_calls, prefetch, table)

    def mixed_dataset(
        self,
        batch_size: int,
        weights: Mapping[str, float],
        *,
        seed: int | None = None,
        prefetch: int = 3,
    ) -> tf.data.Dataset:
        """Returns `(trajectory, sample_info)` batches mixing the tables by `weights` (name ->
        weight; `backends.reverb.mixing.mixed_dataset`), seeded by `seed`, `prefetch` ahead.

        Raises:
          ConfigError: If a weight, name, size or the sequence lengths are invalid.
          tf.errors.InvalidArgumentError: When iterating, as `get_dataset`.
        """
        self._state.replay_buffer()
        self._backend.require(Capability.MIXED_DATASET, "mixed_dataset")
        return self._sample.mixed_dataset(batch_size, weights, seed, prefetch)

    def num_frames(self, *, table: str | None = None) -> int:
        """Returns the items (of `sequence_length` steps) in `table` (None: the primary one), after
        flushing the collectors without waiting on a rate limiter (`rate_limit.flush_for_count`).

        Raises:
          ConfigError, WriteTimeoutError: An unknown `table`; unconfirmed items (`SampleView`).
        """
        return self._sample.count(table)

    def clear(self) -> None:
        """Empties every table in place (handed-out objects stay valid), then checkpoints the empty
        tables so that a later load or a restarted server does not bring them back.

        Raises:
          CheckpointError: If that checkpoint fails (the tables are empty either way).
          WriteTimeoutError: If the server does not empty a table within `timeouts.write`.
        """
        client = self.py_client  # its `reset` is bounded by `timeouts.write`
        for table in self.tables:
            client.reset(table.name)
        self._backend.note_clear(self._state.replay_buffer())
        self._backend.after_clear()

    def checkpoint(self) -> str:
        """Flushes collectors, writes a checkpoint and returns its path (embedded: under
        `<checkpoint_dir>/checkpoints/`; remote: on the server's machine).

        Raises:
          CheckpointError: If it fails, is incomplete or exceeds `timeouts.checkpoint`.
        """
        self._state.client()
        self._writers.flush()
        return self._backend.checkpoint()

    def save_checkpoint(self) -> str:
        """Same as `checkpoint()` (returns and raises as it does)."""
        return self.checkpoint()

    def stats(self) -> BufferStats:
        """Returns each table's fill, rates and the last checkpoint (`monitoring.stats`).

        Raises:
          BufferStateError, ServerUnavailableError: No buffer yet; no answer in `timeouts.connect`.
        """
        self._state.client()
        return self._monitor.read(checkpoint_stats(*self._backend.last_checkpoint()))

    def train_schedule(self, batch_size: int, *, table: str | None = None) -> TrainSchedule:
        """Returns a `TrainSchedule` of `table` (None: the primary one): when a single-threaded loop
        may sample `batch_size` items without deadlocking on a rate limiter (`sample.rate_limit`).

        Raises:
          BufferStateError, ConfigError: No buffer yet; an error buffer too small (naming the
            one needed), an unknown `table`, or a backend without rate limiters.
        """
        self._state.client()
        self._backend.require(Capability.TRAIN_SCHEDULE, "train_schedule")
        return self._sample.train_schedule(batch_size, table)

    def update_priorities(
        self,
        keys: Any,
        priorities: Any,
        *,
        tracker: MaxPriorityTracker | None = None,
        table: str | None = None,
    ) -> dict[int, float]:
        """Sets the priorities of sampled items by key (numpy, tf or torch, `[B]` or `[B, T]`),
        e.g. to |TD error|, recording the largest in `tracker`; keys of other tables than `table`
        (None: the primary one) or of evicted items are ignored. Returns the updates sent.

        Raises:
          ConfigError, SpecMismatchError: A bad priority (named with its key) or `table`; other
            shapes or a key not an integer >= 0. Either way no priority is changed.
        """
        return self._sample.update_priorities(keys, priorities, tracker, table)

    def torch_batches(
        self,
        batch_size: int,
        *,
        device: str | Any = "cpu",
        pin_memory: bool = False,
        prefetch: int | None = None,
        transitions: bool = False,
        with_info: bool = False,
        table: str | None = None,
    ) -> TorchBatchStream:
        """Returns an endless iterator of torch batches of one table (arguments and the bound on a
        lost server: `sample.torch_streams.torch_batches`).

        Raises:
          BufferStateError, ConfigError: As `torch_streams.torch_batches`.
          ServerUnavailableError, ManagerClosedError: When iterating, if the server is lost
            or once the manager (or stream) is closed.
        """
        from replay_service.sample import torch_streams

        return torch_streams.torch_batches(
            self._sample, batch_size, device, pin_memory, prefetch, transitions, with_info, table
        )

    def torch_dataset(
        self,
        batch_size: int,
        *,
        transitions: bool = False,
        with_info: bool = False,
        table: str | None = None,
    ) -> TorchReplayDataset:
        """Returns an `IterableDataset` of batches of one table for
        `dataset.data_loader(num_workers=N)` (arguments: `sample.torch_dataset.torch_dataset`).

        Raises:
          BufferStateError, ConfigError: As `torch_streams.torch_dataset`.
        """
        from replay_service.sample.torch_dataset import torch_dataset

        return torch_dataset(self._sample, batch_size, transitions, with_info, table)

    def mixed_torch_batches(
        self,
        batch_size: int,
        weights: Mapping[str, float],
        *,
        seed: int | None = None,
        device: str | Any = "cpu",
        pin_memory: bool = False,
        prefetch: int | None = None,
        transitions: bool = False,
        with_info: bool = False,
    ) -> TorchBatchStream:
        """Returns an endless iterator of torch batches mixing tables by weight, on every backend
        (arguments: `sample.mixing.mixed_torch_batches`).

        Raises:
          BufferStateError, ConfigError: As `mixing.mixed_torch_batches`.
          ServerUnavailableError, ManagerClosedError: When iterating, as `torch_batches`.
        """
        from replay_service.sample import mixing

        view = self._sample
        return mixing.mixed_torch_batches(
            view, batch_size, weights, seed, device, pin_memory, prefetch, transitions, with_info
        )

    def epoch_batches(
        self,
        batch_size: int,
        num_epochs: int = 1,
        *,
        seed: int | None = None,
        drop_last: bool = False,
        transitions: bool = False,
        device: str | Any = "cpu",
        table: str | None = None,
    ) -> EpochBatches:
        """Returns shuffled batches holding every item of a snapshot of one table once per epoch
        (arguments and the snapshot: `sample.epochs.epoch_batches`).

        Raises:
          ConfigError, BufferStateError, CheckpointError: As `epochs.epoch_batches`.
        """
        from replay_service.sample import epochs

        return epochs.epoch_batches(
            self._sample, batch_size, num_epochs, seed, drop_last, transitions, device, table
        )

    def recent_batches(
        self,
        batch_size: int,
        num_updates: int,
        *,
        eta: float = 0.996,
        c_min: int = 5000,
        seed: int | None = None,
        transitions: bool = False,
        device: str | Any = "cpu",
        table: str | None = None,
    ) -> RecentBatches:
        """Returns one round of ERE batches (arguments: `recent.recent_batches`): batch `k` of
        `num_updates` reads the newest `max(N * eta ** (k * 1000 / num_updates), c_min)` items.

        Raises:
          ConfigError: As `recent.recent_batches` (Reverb cannot read the newest items).
          BufferStateError: If no buffer was created or loaded; when iterating, if it is empty.
        """
        from replay_service.sample import recent

        return recent.recent_batches(
            self._sample, batch_size, num_updates, eta, c_min, seed, transitions, device, table
        )

    def transition_writer(
        self, *, priority: float = 1.0, check_continuity: bool = True
    ) -> TransitionWriter:
        """Returns a writer of `(state, action, reward, next_state, done, truncated)` transitions
        into every table (`collect.view.transition_writer`).

        Raises:
          BufferStateError: If no buffer was created or loaded.
        """
        return collect_view.transition_writer(self._collect, priority, check_continuity)

    def hindsight_writer(
        self,
        compute_reward: Callable[[Any, Any, Any], Any],
        *,
        strategy: str = "future",
        k: int | None = None,
        seed: int | None = None,
        priority: float = 1.0,
    ) -> hindsight.HindsightWriter:
        """Returns a writer of goal-conditioned transitions and their hindsight relabels (HER;
        arguments: `collect.hindsight.hindsight_writer`).

        Raises:
          BufferStateError, ConfigError: As `hindsight.hindsight_writer`.
        """
        view = self._collect
        return hindsight.hindsight_writer(view, compute_reward, strategy, k, seed, priority)

    def gym_vector_writer(
        self, envs: Any, *, autoreset_mode: Any = None, priority: float = 1.0
    ) -> gym_vector.GymVectorWriter:
        """Returns a writer of a gymnasium vector env's steps (`gym_vector.gym_vector_writer`).

        Raises:
          BufferStateError, ConfigError: As `gym_vector.gym_vector_writer`.
        """
        return gym_vector.gym_vector_writer(self._collect, envs, autoreset_mode, priority)

    def warm_up(
        self,
        env: Any,
        num_steps: int,
        policy: Callable[[Any], Any] | None = None,
        *,
        seed: int | None = None,
        progress: bool = True,
    ) -> int:
        """Writes `num_steps` transitions of a gymnasium env or vector env stepped by `policy`
        (Velora's `warm`; arguments: `collect.warm_up`); returns how many.

        Raises:
          BufferStateError, ConfigError, SpecMismatchError, WriteTimeoutError: As
            `warm_up.fill` (the old gym API is refused before anything is written).
        """
        return warm_up_lib.fill(self._collect, env, num_steps, policy, seed, progress)

    def export(
        self,
        dirpath: str | os.PathLike[str],
        prefix: str = export_target.DEFAULT_PREFIX,
        *,
        overwrite: bool = False,
    ) -> tuple[str, str]:
        """Writes every item once to `<prefix>state.safetensors` + `<prefix>metadata.json` after a
        checkpoint (`storage.export`); returns the two paths.

        Raises:
          ConfigError: If there are extra tables, or `prefix` is not a plain file-name prefix.
          CheckpointExistsError: If `dirpath` is not empty and `overwrite` is False.
          CheckpointError: If the checkpoint cannot be taken or read.
        """
        export_target.require_one_table(self.tables, "export")
        export_target.export_paths(dirpath, prefix)  # a bad prefix fails before the checkpoint
        export_target.check_target(os.fspath(dirpath), overwrite)
        self._state.client()
        self._writers.flush()
        return self._backend.export(self.table_config, os.fspath(dirpath), prefix, overwrite)

    def import_buffer(
        self,
        dirpath: str | os.PathLike[str],
        prefix: str = export_target.DEFAULT_PREFIX,
        *,
        overwrite: bool = False,
        drop_oldest: bool = False,
    ) -> tuple[ReplayBuffer, Any]:
        """Creates this buffer from an export: every item and priority, in order (more items than
        slots need `drop_oldest`: the newest are kept); returns `(replay_buffer, observer)` as
        `create_replay_buffer`.

        Raises:
          CheckpointError: If a file is missing, corrupt or truncated.
          SpecMismatchError: If the data spec or sequence length differ.
          ConfigError: If the items do not fit, or there are extra tables.
          CheckpointExistsError, BufferStateError: As `create_replay_buffer`.
        """
        export_target.require_one_table(self.tables, "import")
        self._state.require_none()
        items = importing.read_export(
            self.table_config, self._stored_spec, dirpath, prefix, drop_oldest=drop_oldest
        )
        replay_buffer, observer = self.create_replay_buffer(overwrite=overwrite)
        self._backend.insert_items(self.table_config, items)
        return replay_buffer, observer

    def table_handle(self, table: str | None = None) -> TableHandle:
        """Returns a picklable description of one table of a Reverb server (`TableHandle`).

        Raises:
          BufferStateError, ConfigError: No buffer yet; an unknown `table`, or a local buffer.
        """
        self._state.client()
        self._backend.require(Capability.TABLE_HANDLE, "table_handle")
        return self._backend.table_handle(self._sample.table(table))

    def _hand_out(self, client: Any) -> tuple[Any, Any]:
        """Opens the buffer behind `create`/`load`'s client; a failure stops the backend."""
        try:
            replay_buffer = self._state.open(client, self.clear)
            self._monitor.start(client, self._timeouts.connect, self.stats)
            return replay_buffer, self.observer()
        except BaseException:
            self._backend.close()
            raise

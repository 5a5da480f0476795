"""`ReplayBufferManager`: owns the lifecycle of one replay buffer.

It starts (or connects to) a Reverb server with one table (or several, `extra_tables`), hands out
a TF-Agents replay buffer and a trajectory observer, and checkpoints and restores. Layout,
validation and sampling live in their own modules; this class only puts them in order.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from replay_service.backends import (
    Backend,
    BackendOptions,
    Capability,
    backend_class,
    resolve_auto,
    resolve_auto_layout,
)
from replay_service.backends.reverb.tables import check_extra_tables, check_mix_weights, find_table
from replay_service.collect.observer import TrajectoryObserver
from replay_service.collect.transitions import TransitionWriter
from replay_service.config.options import (
    DEFAULT_TABLE_NAME,
    SamplingConfig,
    TableConfig,
    Timeouts,
    require_positive_int,
    require_seed,
    validate_manager_options,
    validate_path,
)
from replay_service.errors import (
    BufferStateError,
    ConfigError,
    ManagerClosedError,
    WriteTimeoutError,
)
from replay_service.integrations import tf_compat
from replay_service.monitoring import summaries
from replay_service.monitoring.stats import BufferStats, StatsTracker, checkpoint_stats
from replay_service.sample import priorities as priorities_lib
from replay_service.sample import rate_limit
from replay_service.specs import nests as specs
from replay_service.specs import sizes
from replay_service.specs import windows as sequences
from replay_service.specs.layouts import AUTO, NESTED, resolve_layout
from replay_service.storage import export as export_lib
from replay_service.storage.store import DEFAULT_KEEP

# TF-Agents' PolicySaver fails in this environment without it (see integrations.tf_compat): a
# process that imports the manager can save policies before its first buffer exists. The probe
# patches only where the failure occurs; no TensorFlow is imported here.
tf_compat.patch_inspect()

if TYPE_CHECKING:
    import reverb
    import tensorflow as tf

    from replay_service.backends.reverb.handles import TableHandle
    from replay_service.backends.reverb.tf_agents_buffer import ReplayBuffer
    from replay_service.collect.gym_vector import GymVectorWriter
    from replay_service.collect.hindsight import HindsightWriter
    from replay_service.sample.epochs import EpochBatches
    from replay_service.sample.recent import RecentBatches
    from replay_service.sample.torch_streams import TorchBatchStream, TorchReplayDataset


_log = logging.getLogger(__name__)

# `num_frames()` waits this long at a time for its writers' items to be confirmed before it
# asks whether a rate limiter holds them back (a confirmation takes a round trip otherwise).
_COUNT_WAIT_MS = 100


class ReplayBufferManager:
    """Creates, restores, samples and checkpoints one replay buffer.

    Embedded mode (the default) runs a Reverb server in this process, checkpointing into
    `checkpoint_dir`. Remote mode (`server_address="host:port"`) uses a running server (see
    `replay-server`), which owns its checkpoints. The local backend (`backend="local"`, or
    `"auto"` where dm-reverb does not import: macOS, Windows, ARM, Python 3.12+) keeps the
    tables in this process without Reverb, with the same API and checkpoint directory protocol
    (see `replay_service.backends.local.backend`); remote mode, sharding, `mixed_dataset`,
    `train_schedule` and `replay-server` are Reverb-only.

    Args:
      data_spec: Per-step spec of what is stored, e.g. `agent.collect_data_spec`.
      capacity: Maximum number of items kept; the oldest is evicted first (by default).
      checkpoint_dir: Directory holding this buffer's checkpoints (embedded mode, required).
      sequence_length: Consecutive steps per item; `num_frames()` counts these items.
      table_name: Name of the Reverb table.
      sampling: Sampler, remover and rate limiter; uniform with `MinSize(1)` by default.
      server_address: "host:port" of a running server; None starts an embedded one.
      port: Port of the embedded server (all interfaces); None picks a free one.
      timeouts: Bounds on every blocking call.
      keep_checkpoints: Complete checkpoints retained in `checkpoint_dir`.
      stride_length: The observer creates an item every `stride_length` steps.
      extra_tables: More tables on the same server with the same data spec, each with its own
        name, capacity, sequence length and sampling. Observers and transition writers feed
        every table; the replay buffer, `num_frames()` and datasets address the primary table
        unless given `table=`.
      pad_end_of_episode: Pad the end of every episode so that no step is left out of an item,
        and store a mask: items are `Masked(step, mask)` (see `replay_service.specs.windows`).
        Extra tables must then be padded too, with the same sequence length.
      checkpoint_interval_s: Embedded mode: take a checkpoint every this many seconds in a
        background thread (failures are logged and retried); None: only on `checkpoint()`.
        After a crash at most one interval plus one checkpoint's duration is lost.
      summary_dir: Write `stats()` as TensorBoard scalars into this directory every
        `summary_interval_s` seconds from a background thread, from the time the buffer is
        created or loaded until `close()` (see `replay_service.monitoring.summaries`); None: no
        summaries.
      summary_interval_s: Seconds between summary writes.
      backend: "reverb" (a Reverb server), "local" (in this process, no Reverb) or "auto":
        the backend that wrote `checkpoint_dir`'s newest checkpoint, if any; else Reverb when
        dm-reverb and TensorFlow import, else local (logged once per process). `from_spaces`'
        "auto" prefers local for a new buffer (see there).
      storage: Local backend: "memory" or "memmap" (memory-mapped files under
        `<checkpoint_dir>/.memmap`, deleted by `close()`, for buffers larger than RAM).
      layout: How Reverb tables store steps: "packed" (one `uint8` row per step: several
        times less server memory per step, faster inserts and sampling; see
        `replay_service.specs.packed`), "nested" (one column per field, what TF-Agents'
        `ReverbReplayBuffer` tables hold) or "auto" (the default): the layout of what exists,
        i.e. the one `checkpoint_dir`'s store recorded (an older nested buffer restores
        nested) or a remote server's tables' (read on connecting), else "packed" for a new
        embedded buffer. Every table of the server gets it (an extra `TableConfig` naming
        another layout is refused). Every sampling path returns the same items in both, and
        TF-Agents' own observers write packed items through `py_client` (a `PackingClient`);
        a plain `reverb.Client` of your own writes nested items, which a packed table cannot
        read. The local backend has its own storage ("auto" means it; "packed" is refused).
      seed: Local backend: seed of the tables' samplers (an integer >= 0; each table draws
        from its own `np.random.Generator` seeded from it), so that the same seed and the same
        inserts give the same samples; None draws fresh entropy. A Reverb server's samplers
        cannot be seeded: backend="reverb" refuses it.
      device: Local backend: the torch device the tables' storage lives on ("cpu", "cuda",
        "cuda:1"), as Velora and pytorchrl keep their buffers on the learner's device: steps
        are written there and batches are gathered there, so sampled tensors come back on it
        with no host copy; checkpoints and exports still write host files in the same format.
        Needs storage="memory". None (the default): host memory. backend="reverb" refuses it.

    Raises:
      ConfigError: If a value is invalid (capacity <= 0, no checkpoint_dir in embedded mode, a
        checkpoint_dir with a NUL character, two tables with one name...), or the sizes cannot
        fit before anything is allocated: one item larger than the memory available (every
        backend), or the local backend's tables (capacity x bytes per step) larger than the
        memory (storage="memory") or free disk ("memmap") available; the error names the
        largest fields with their shapes, the bytes per step, the total and what is available.
      SpecMismatchError: If `data_spec` is not a TF-Agents `Trajectory` of tensor specs (what
        the observer and transition writer collect).
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
    ) -> None:
        implementation = backend_class(
            resolve_auto(backend, checkpoint_dir=checkpoint_dir, server_address=server_address),
            server_address,
        )
        # "auto" on a remote server: its tables' layout, read once connected (`_hand_out`).
        self._layout_from_server = layout == AUTO and server_address is not None
        layout = resolve_auto_layout(
            layout,
            kind=implementation.kind,
            checkpoint_dir=checkpoint_dir,
            server_address=server_address,
        )
        self._table = TableConfig(
            name=table_name,
            capacity=capacity,
            sequence_length=sequence_length,
            sampling=sampling or SamplingConfig(),
            pad_end_of_episode=pad_end_of_episode,
            layout=layout,
        )
        if (
            layout != NESTED
            and isinstance(extra_tables, Sequence)
            and not isinstance(extra_tables, str)
        ):
            # The manager's layout is every table's: extra tables left at the default take it.
            extra_tables = [
                dataclasses.replace(t, layout=layout)
                if isinstance(t, TableConfig) and t.layout == NESTED
                else t
                for t in extra_tables
            ]
        self._extra_tables = check_extra_tables(self._table, extra_tables)
        validate_manager_options(
            port=port, stride_length=stride_length, keep_checkpoints=keep_checkpoints
        )
        specs.check_collect_spec(data_spec, "ReplayBufferManager")
        self._data_spec = data_spec
        self._stored_spec = sequences.stored_spec(data_spec, pad_end_of_episode)
        specs.describe_spec(data_spec)  # refuses a spec that is not a nest of tensor specs
        # The one place the layout's name becomes the object that the backend, its tables'
        # handles, the observers and the writers receive.
        self._layout = resolve_layout(layout, self._stored_spec)
        # Before anything is allocated (the local backend checks its whole rings on create).
        sizes.check_item_fits(specs.describe_spec(self._stored_spec), self.tables)
        if server_address is None and checkpoint_dir is None:
            raise ConfigError("checkpoint_dir is required unless server_address is given")
        if checkpoint_dir is not None:
            checkpoint_dir = validate_path(checkpoint_dir, "checkpoint_dir")
        _check_interval(checkpoint_interval_s, server_address)
        self._stride_length = stride_length
        self._timeouts = timeouts or Timeouts()
        if storage not in ("memory", "memmap"):
            raise ConfigError(f"storage must be 'memory' or 'memmap', got {storage!r}")
        require_seed("seed", seed)
        self.backend = implementation.kind
        for capability, asked, what in (
            (Capability.MEMMAP_STORAGE, storage != "memory", f"storage={storage!r}"),
            (Capability.PACKED_LAYOUT, self._layout.reverb_only, f"layout={layout!r}"),
            (Capability.PORT, port is not None, f"port={port!r}"),
            (Capability.SEEDED_SAMPLING, seed is not None, f"seed={seed!r}"),
            (Capability.DEVICE_STORAGE, device is not None, f"device={device!r}"),
        ):
            if asked and capability not in implementation.capabilities:
                raise implementation.refusal(capability, what)
        self._backend: Backend = implementation.from_options(
            BackendOptions(
                tables=self.tables,
                data_spec=data_spec,
                stored_spec=self._stored_spec,
                timeouts=self._timeouts,
                layout=self._layout,
                checkpoint_dir=checkpoint_dir,
                keep_checkpoints=keep_checkpoints,
                checkpoint_interval_s=checkpoint_interval_s,
                port=port,
                server_address=server_address,
                storage=storage,
                seed=seed,
                device=device,
            )
        )
        self._client: Any = None
        self._users_client: Any = None
        self._replay_buffer: Any = None
        self._observers: list[TrajectoryObserver] = []
        self._stats_tracker: StatsTracker | None = None
        self._summary_dir = (
            None if summary_dir is None else validate_path(summary_dir, "summary_dir")
        )
        self._summary_interval_s = summaries.check_interval(summary_interval_s)
        self._summary_writer: summaries.StatsSummaryWriter | None = None
        self._closed = False

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
        """A manager whose data spec is built from gymnasium spaces (no spec written by hand).

        Extra per-step fields (a recurrent hidden state, action log-probs, an intrinsic
        reward...) are declared with `extras` and stored in the trajectory's `policy_info`
        dict, as TF-Agents policies report their info: `transition_writer().add(..., hidden=h,
        log_prob=lp)` writes them, and sampled batches carry them (`trajectory.policy_info[
        "hidden"]`, `transition_batch.hiddens["hidden"]`).

        Args:
          observation_space: A gymnasium space (Box, Discrete, MultiDiscrete, MultiBinary, or
            Dict/Tuple nests of them), e.g. a vector env's `single_observation_space`.
          action_space: The action space, likewise.
          capacity: Maximum number of items.
          checkpoint_dir: The checkpoint directory.
          sequence_length: Steps per item (2: transitions).
          backend: "auto" (the default: the local backend, in-process tables that leave the
            cores to torch, unless `checkpoint_dir` holds a Reverb checkpoint or a Reverb-only
            option is set: `server_address`, `port`, `layout`), "reverb" or "local". Reverb is
            still the default of `ReplayBufferManager(data_spec, ...)`, the TF-Agents door.
          extras: Name -> one step's spec: a `(shape, dtype)` pair such as `((64,),
            np.float32)` or `((), np.float32)`, an `ArraySpec`/`tf.TensorSpec`, or a gymnasium
            Box/Discrete/MultiDiscrete/MultiBinary space. Names are identifiers other than the
            trajectory's fields and the writer's arguments ("hidden" is fine). None: no extras.
          **options: Any other `ReplayBufferManager` argument.

        Returns:
          The manager (call `create_replay_buffer()` or `load_replay_buffer()` next).

        Raises:
          ConfigError: For an unsupported space or option (see `ReplayBufferManager`), a bad
            extra (a reserved name, a bad shape or dtype), naming it and its value, or sizes
            that cannot fit (a huge space or extra: see `ReplayBufferManager`).
        """
        data_spec = specs.data_spec_for_spaces(observation_space, action_space, extras=extras)
        reverb_only = [
            name
            for name, default in (("server_address", None), ("port", None))
            if options.get(name, default) != default
        ]
        if options.get("layout", AUTO) not in (AUTO, NESTED):  # "packed": Reverb's only
            reverb_only.append("layout")
        return cls(
            data_spec,
            capacity,
            checkpoint_dir,
            sequence_length,
            backend=resolve_auto(
                backend,
                checkpoint_dir=checkpoint_dir,
                server_address=options.get("server_address"),
                single_process=True,
                reverb_options=reverb_only,
            ),
            **options,
        )

    # ------------------------------------------------------------------------ properties

    @property
    def table_name(self) -> str:
        """Name of the primary Reverb table."""
        return self._table.name

    @property
    def tables(self) -> tuple[TableConfig, ...]:
        """Every table of the buffer: the primary one first, then `extra_tables`."""
        return (self._table, *self._extra_tables)

    @property
    def sequence_length(self) -> int:
        """Steps per item."""
        return self._table.sequence_length

    @property
    def checkpoint_dir(self) -> str | None:
        """Absolute checkpoint directory (embedded mode), else None."""
        return self._backend.checkpoint_dir

    @property
    def server_address(self) -> str:
        """ "host:port" of the server in use.

        Raises:
          BufferStateError: If no buffer was created or loaded yet.
        """
        return self._require_client().server_address

    @property
    def py_client(self) -> reverb.Client:
        """The Reverb client of the server in use (local backend: its `LocalClient`, with the
        `reset`, `mutate_priorities` and `server_info` calls).

        On a `layout="packed"` buffer it is a `PackingClient`: a `reverb.Client` whose
        `trajectory_writer()` packs each appended step, so TF-Agents' own
        `ReverbAddTrajectoryObserver(manager.py_client, ...)` writes the items this project's
        observer writes (see `replay_service.backends.reverb.packing_client`)."""
        client = self._require_client()
        if self._users_client is None:
            self._users_client = self._backend.users_client(client)
        return self._users_client

    # ------------------------------------------------------------------------- lifecycle

    def create_replay_buffer(self, *, overwrite: bool = False) -> tuple[ReplayBuffer, Any]:
        """Starts a new, empty buffer.

        Args:
          overwrite: Embedded: delete existing checkpoints of `checkpoint_dir` (files that are not
            replay_service's are never touched). Remote: empty a non-empty table.

        Returns:
          `(replay_buffer, observer)`: a TF-Agents `ReverbReplayBuffer` and a
          `TrajectoryObserver` to pass to an `Actor` or driver.

        Raises:
          CheckpointExistsError: If checkpoints exist (or the remote table holds items) and
            `overwrite` is False.
          CheckpointError: If `checkpoint_dir` is foreign, not writable or in use.
          PortInUseError, ServerUnavailableError: If the server cannot be started or reached.
          BufferStateError: If this manager already has a buffer.
        """
        self._require_no_buffer()
        client = self._backend.create(overwrite)
        try:
            return self._hand_out(client)
        except BaseException:
            self._backend.close()
            raise

    def load_replay_buffer(self) -> tuple[ReplayBuffer, Any]:
        """Restores the newest complete checkpoint (embedded) or attaches to the server's table.

        The stored data spec, sequence length, table name and capacity, and the extra tables
        (names, capacities, sequence lengths), must equal this manager's; every differing field
        is named. Reverb restores the capacity stored in the
        checkpoint, so a different `capacity` is refused rather than silently ignored.

        Returns:
          `(replay_buffer, observer)` as from `create_replay_buffer`.

        Raises:
          NoCheckpointError: If `checkpoint_dir` is missing, empty or holds no checkpoint.
          CheckpointError: If it is foreign, in use, or the checkpoint cannot be restored.
          SpecMismatchError: If what is stored differs from what this manager was given.
          BufferStateError: If this manager already has a buffer.
        """
        self._require_no_buffer()
        client = self._backend.load()
        try:
            return self._hand_out(client)
        except BaseException:
            self._backend.close()
            raise

    def get_replay_buffer_and_observer(self) -> tuple[ReplayBuffer, Any]:
        """Returns the buffer created or loaded before, with a new observer.

        Raises:
          BufferStateError: If neither `create_replay_buffer` nor `load_replay_buffer` ran.
        """
        self._require_client()
        assert self._replay_buffer is not None
        return self._replay_buffer, self._new_observer()

    def observer(
        self, *, pad_end_of_episodes: bool = False, tile_end_of_episodes: bool = False
    ) -> TrajectoryObserver:
        """Returns a new trajectory observer of this buffer, optionally padding as TF-Agents.

        Without options it is the observer `create_replay_buffer()` hands out. With
        `pad_end_of_episodes` (and `tile_end_of_episodes`) it writes exactly the items of
        TF-Agents' `ReverbAddTrajectoryObserver(pad_end_of_episodes=...,
        tile_end_of_episodes=...)`: zero boundary steps end each episode and the windows they
        complete are written as plain `Trajectory` items (see
        `replay_service.collect.episode_padding`), on both backends and layouts.

        Args:
          pad_end_of_episodes: TF-Agents' option of that name.
          tile_end_of_episodes: TF-Agents' option of that name (needs `pad_end_of_episodes`).

        Returns:
          A `TrajectoryObserver` writing to every table; `checkpoint()` flushes it and
          `close()` closes it.

        Raises:
          BufferStateError: If no buffer was created or loaded.
          ConfigError: If a flag is not a bool, `tile_end_of_episodes` comes without
            `pad_end_of_episodes`, or the tables pad on their own (`pad_end_of_episode=True`).
        """
        return self._new_observer(pad_end_of_episodes, tile_end_of_episodes)

    def close(self) -> None:
        """Flushes observers, stops the embedded server and releases the directory. Idempotent.

        No checkpoint is taken: call `checkpoint()` first to keep what was collected.
        """
        if self._closed:
            return
        self._closed = True
        try:
            for observer in self._observers:
                try:
                    observer.close()
                except Exception as e:  # a dead server must not prevent the rest of close()
                    _log.warning("observer close failed: %s", e)
        finally:
            if self._summary_writer is not None:
                self._summary_writer.close()
            if self._replay_buffer is not None:  # its datasets and streams fail, not block
                self._replay_buffer.stop_sampling()
            self._backend.close()
            self._client = self._users_client = self._replay_buffer = None
            self._observers = []

    def __len__(self) -> int:
        """The number of items in the primary table now: `len(manager) == num_frames()`.

        The primary table is the one the replay buffer and the sampling calls address by
        default; `num_frames(table=name)` counts another one.

        Raises:
          BufferStateError: Before `create_replay_buffer()` or `load_replay_buffer()` (the size
            is not known until then: a load or a remote server may hold items).
          ManagerClosedError: After `close()`.
        """
        return self.num_frames()

    def __bool__(self) -> bool:
        """Always True: a manager is truthy whatever its size (`if manager:` tests that there
        is one, not that its buffer holds items; use `len(manager)` for that)."""
        return True

    def __enter__(self) -> ReplayBufferManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------------------- using it

    def get_dataset(
        self,
        batch_size: int,
        num_steps: int | None = None,
        *,
        num_parallel_calls: int = 3,
        prefetch: int = 3,
        table: str | None = None,
    ) -> tf.data.Dataset:
        """Returns a tf.data dataset of `(trajectory, sample_info)` batches of one table.

        The same batches as `replay_buffer.as_dataset(batch_size, num_steps).prefetch(3)`, from a
        tuned pipeline (see `pipeline.sample_dataset`) when `num_steps` is None or
        `sequence_length`; other `num_steps` split items with TF-Agents' pipeline. If no item can
        be sampled within `timeouts.sample`, iterating raises `tf.errors.InvalidArgumentError`
        naming the table instead of blocking forever.

        Bounded when the server is lost: if the server dies (SIGKILL, SIGTERM), the network
        drops or this manager is closed, `next()` raises `tf.errors.InvalidArgumentError`
        naming the server address, the table and what to do, within
        `liveness.liveness_bound(timeouts.sample, timeouts.connect)` seconds (at most
        `2 * timeouts.sample + timeouts.connect`; about `timeouts.sample + 1 s` after a kill,
        at once after `close()`). This holds for `iter(dataset)` and for a dataset iterated
        inside a `tf.function`, in this process.

        Args:
          batch_size: Items per batch.
          num_steps: Steps per sampled sequence; None or `sequence_length` returns whole items.
          num_parallel_calls: Parallel unpacking in TF-Agents' pipeline (other `num_steps`).
          prefetch: Batches prefetched.
          table: Table to sample; None is the primary table.

        Raises:
          ConfigError: If a size is not a positive integer or `table` is unknown.
          tf.errors.InvalidArgumentError: When iterating, if nothing can be sampled within
            `timeouts.sample`, the server is lost, or the manager was closed (see above).
        """
        replay_buffer = self._require_buffer()
        config = find_table(self.tables, table)
        for name, value in (("batch_size", batch_size), ("prefetch", prefetch)):
            require_positive_int(name, value)
        if num_steps not in (None, config.sequence_length):
            self._require(
                Capability.SPLIT_SEQUENCES,
                f"get_dataset(num_steps={num_steps!r}) of items of {config.sequence_length} steps",
            )
            require_positive_int("num_steps", num_steps)
        return self._backend.dataset(
            replay_buffer, config, batch_size, num_steps, num_parallel_calls, prefetch
        )

    def mixed_dataset(
        self,
        batch_size: int,
        weights: Mapping[str, float],
        *,
        seed: int | None = None,
        prefetch: int = 3,
    ) -> tf.data.Dataset:
        """Returns `(trajectory, sample_info)` batches mixing several tables of this buffer.

        Each item comes from table `name` with probability `weights[name] / sum(weights)`,
        sampled by that table's own sampler (see `mixing.mixed_dataset`). Item keys are
        unique across tables, so `update_priorities(info.key, p, table=name)` with all the keys
        of a mixed batch updates the items of `name` and ignores the others.

        Args:
          batch_size: Items per batch.
          weights: Table name -> weight; finite, >= 0, with a positive sum. The tables must
            have one sequence length.
          seed: Seed of the choice of tables; None draws one.
          prefetch: Batches prefetched.

        Raises:
          ConfigError: If a weight, name, size or the sequence lengths are invalid.
          tf.errors.InvalidArgumentError: When iterating, as `get_dataset`.
        """
        replay_buffer = self._require_buffer()
        self._require(Capability.MIXED_DATASET, "mixed_dataset")
        require_positive_int("prefetch", prefetch)
        return self._backend.mixed_dataset(replay_buffer, weights, batch_size, seed, prefetch)

    def num_frames(self, *, table: str | None = None) -> int:
        """Returns the number of items in a table (the primary one by default).

        An item is one window of `sequence_length` consecutive steps (with the default stride of
        1, an episode of T steps gives T - sequence_length + 1 items), not one environment step.
        Every item this manager's observers and writers wrote counts: they are flushed first
        (a packed writer sends its items at episode ends and soon after, not at every step).
        Items of other processes count once their writers sent them, and items a
        `samples_per_insert` rate limiter holds back count once it lets them in: a count never
        waits for samples (a learner that logs it while its collectors wait for it goes on).

        Raises:
          ConfigError: If `table` is not one of this buffer's tables.
          WriteTimeoutError: If this manager's writers cannot get their items confirmed
            within `Timeouts.write` while no rate limiter holds them back (the server is gone).
        """
        name = find_table(self.tables, table).name
        client = self._require_client()
        self._flush_for_count()
        return self._backend.num_items(client, name)

    def clear(self) -> None:
        """Empties every table in place; every object handed out stays valid.

        It then takes a checkpoint of the empty tables (embedded: into `checkpoint_dir`;
        remote: on the server), so a later `load_replay_buffer()` or a restarted server does
        not bring the old items back (older checkpoints are kept until retention removes them).

        Raises:
          CheckpointError: If that checkpoint fails (the tables are empty either way).
        """
        client = self._require_client()
        for table in self.tables:
            client.reset(table.name)
        self._backend.note_clear(self._require_buffer())
        self._backend.after_clear()

    def checkpoint(self) -> str:
        """Writes a checkpoint and returns its path.

        Embedded: the path is a complete checkpoint under `<checkpoint_dir>/checkpoints/`.
        Remote: the path on the server's machine where Reverb wrote it.

        Raises:
          CheckpointError: If the checkpoint fails, is incomplete or takes longer than
            `timeouts.checkpoint`.
        """
        self._require_client()
        self._flush_writers()
        return self._backend.checkpoint()

    def save_checkpoint(self) -> str:
        """Same as `checkpoint()`: flushes writers, writes a checkpoint and returns its path.

        Returns:
          The path of the complete checkpoint.

        Raises:
          As `checkpoint()`.
        """
        return self.checkpoint()

    def stats(self) -> BufferStats:
        """Returns how full every table is, how fast it fills and is sampled, and the last
        checkpoint (see `replay_service.monitoring.stats`).

        Rates (inserts/s, samples/s, samples per insert, time blocked by the rate limiter) are
        measured over the last `stats.DEFAULT_WINDOW_S` seconds of readings, the first window
        starting when the buffer was created or loaded. The checkpoint (time, duration, bytes,
        items) is known in embedded mode; a remote server reports its own
        (`replay-server status --json`).

        Returns:
          The stats of every table of the server.

        Raises:
          BufferStateError: If no buffer was created or loaded.
          ServerUnavailableError: If the server does not answer within `timeouts.connect`.
        """
        self._require_client()
        assert self._stats_tracker is not None
        return self._stats_tracker.read(checkpoint_stats(*self._backend.last_checkpoint()))

    def train_schedule(
        self, batch_size: int, *, table: str | None = None
    ) -> rate_limit.TrainSchedule:
        """Returns a `TrainSchedule`: when a single-threaded collect/train loop may train.

        With a `samples_per_insert` rate limiter, a loop that collects and trains in one thread
        deadlocks as soon as it samples while the limiter waits for inserts (or the reverse);
        the schedule says "train" only when a whole batch can be sampled at once and "collect"
        otherwise. See `replay_service.sample.rate_limit` for the rule it checks.

        Args:
          batch_size: Items sampled per training step.
          table: The table sampled from; None: the primary table.

        Raises:
          ConfigError: If the table's error buffer is too small for such a loop (the message
            names the error buffer needed), or `table` is unknown.
          BufferStateError: If no buffer was created or loaded.
        """
        self._require_client()
        self._require(Capability.TRAIN_SCHEDULE, "train_schedule")
        name = find_table(self.tables, table).name
        return rate_limit.TrainSchedule(
            lambda: self._backend.limiter_state(name),
            self._flush_writers,
            batch_size,
            table_name=name,
        )

    # ---------------------------------------------------------------------------- helpers

    def _take_layout(self, name: str) -> None:
        """Makes `name` every table's layout (`layout="auto"` on a remote server)."""
        if name == self._table.layout:
            return
        self._table = dataclasses.replace(self._table, layout=name)
        self._extra_tables = tuple(dataclasses.replace(t, layout=name) for t in self._extra_tables)
        self._layout = resolve_layout(name, self._stored_spec)
        self._backend.take_layout(self._layout, self.tables)

    def _flush_writers(self) -> None:
        for observer in self._observers:
            observer.flush()

    def _flush_for_count(self) -> None:
        """Flushes this manager's writers for `num_frames`, in waits of `_COUNT_WAIT_MS`: it
        stops waiting, without an error, once a table's rate limiter blocks inserts (their
        items reach the table when samples let them in; waiting for them could only time
        out).

        Raises:
          WriteTimeoutError: If the items are not confirmed within `Timeouts.write` while no
            limiter blocks inserts.
        """
        if Capability.TRAIN_SCHEDULE not in self._backend.capabilities:
            self._flush_writers()
            return
        write_s = self._timeouts.write
        deadline = math.inf if write_s is None else time.monotonic() + write_s
        while True:
            try:
                for observer in self._observers:
                    observer.flush(_COUNT_WAIT_MS)
                return
            except WriteTimeoutError:
                if time.monotonic() >= deadline:
                    raise
                if any(not self._backend.limiter_state(t.name).can_insert() for t in self.tables):
                    return

    def _hand_out(self, client: Any) -> tuple[Any, Any]:
        if self._layout_from_server:
            self._take_layout(self._backend.server_layout(client))
        replay_buffer = self._backend.open_buffer(client, self.clear)
        self._client = client
        self._replay_buffer = replay_buffer
        self._stats_tracker = StatsTracker(client, timeout=self._timeouts.connect)
        self._stats_tracker.read(wait_for_rates=False)  # the start of the first rate window
        if self._summary_dir is not None:
            self._summary_writer = summaries.StatsSummaryWriter(
                self.stats, self._summary_dir, interval_s=self._summary_interval_s
            )
            self._summary_writer.start()
        return self._replay_buffer, self._new_observer()

    def _require(self, capability: Capability, what: str) -> None:
        """Refuses `what` unless the backend has `capability` (the error says the way out)."""
        if capability not in self._backend.capabilities:
            raise self._backend.refusal(capability, what)

    def _extra_windows(self) -> list[tuple[str, int]]:
        return [(t.name, t.sequence_length) for t in self._extra_tables]

    def _new_observer(
        self, pad_end_of_episodes: bool = False, tile_end_of_episodes: bool = False
    ) -> TrajectoryObserver:
        observer = TrajectoryObserver(
            self._require_client(),
            self.table_name,
            self.sequence_length,
            self._data_spec,
            stride_length=self._stride_length,
            timeouts=self._timeouts,
            extra_tables=self._extra_windows(),
            pad_end_of_episode=self._table.pad_end_of_episode,
            layout=self._layout,
            pad_end_of_episodes=pad_end_of_episodes,
            tile_end_of_episodes=tile_end_of_episodes,
        )
        self._observers.append(observer)
        return observer

    def _require_open(self) -> None:
        if self._closed:
            raise ManagerClosedError("this ReplayBufferManager is closed; create a new one")

    def _require_no_buffer(self) -> None:
        self._require_open()
        if self._client is not None:
            raise BufferStateError(
                "this manager already has a buffer; use get_replay_buffer_and_observer(), "
                "clear() to empty it, or close() and a new manager to start another"
            )

    def _require_client(self) -> Any:
        self._require_open()
        if self._client is None:
            raise BufferStateError(
                "no buffer yet: call create_replay_buffer() or load_replay_buffer() first"
            )
        return self._client

    def _require_buffer(self) -> Any:
        self._require_client()
        assert self._replay_buffer is not None
        return self._replay_buffer

    def update_priorities(
        self,
        keys: Any,
        priorities: Any,
        *,
        tracker: priorities_lib.MaxPriorityTracker | None = None,
        table: str | None = None,
    ) -> dict[int, float]:
        """Sets the priorities of sampled items (prioritized tables), e.g. to |TD error|.

        Args:
          keys: Item keys from sampled info (numpy, tf or torch; `[B]` or `[B, T]`).
          priorities: New priorities, finite and >= 0, same leading shape.
          tracker: Optional `MaxPriorityTracker` to record the largest priority.
          table: Table whose items to update; None is the primary table. Keys of other tables
            (e.g. from a `mixed_dataset` batch) are ignored like evicted ones.

        Returns:
          The updates sent, key -> priority; keys of evicted items are ignored by the server.

        Raises:
          ConfigError: If a priority is NaN, infinite or negative (named with its key), or
            `table` is unknown.
          SpecMismatchError: If keys and priorities do not match in shape.
        """
        name = find_table(self.tables, table).name
        return priorities_lib.update_priorities(
            self._require_client(),
            name,
            keys,
            priorities,
            timeout=self._timeouts.connect,
            tracker=tracker,
        )

    # ---- PyTorch, collection without TF-Agents, export/import

    @property
    def data_spec(self) -> Any:
        """The per-step data spec this manager was given."""
        return self._data_spec

    @property
    def stored_spec(self) -> Any:
        """The per-step spec of what the table stores: `data_spec`, or
        `sequences.Masked(data_spec, mask)` with `pad_end_of_episode`."""
        return self._stored_spec

    @property
    def table_config(self) -> TableConfig:
        """Name, capacity, sequence length and sampling of the primary table."""
        return self._table

    @property
    def timeouts(self) -> Timeouts:
        """Bounds on every blocking call."""
        return self._timeouts

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
        """Returns an endless iterator of torch batches sampled from this buffer.

        See `replay_service.sample.torch_streams.TorchBatchStream` (options) and `TransitionBatch`
        (`transitions=True`: states, actions, rewards, next_states, dones, truncated, hiddens).
        `table` picks the table to sample (None: the primary one).

        Bounded when the server is lost: if the server dies (SIGKILL, SIGTERM) or the network
        drops, `next()` raises `ServerUnavailableError` naming the address, the table and what
        to do within `liveness.liveness_bound(timeouts.sample, timeouts.connect)` seconds (at
        most `2 * timeouts.sample + timeouts.connect`); after `close()` it raises
        `ManagerClosedError` at once.

        Raises:
          BufferStateError: If no buffer was created or loaded; when iterating, if nothing can
            be sampled within `Timeouts.sample`.
          ServerUnavailableError: When iterating, if the server is lost (see above).
          ManagerClosedError: When iterating, once this manager (or the stream) is closed.
          ConfigError: If an option is invalid or `table` is unknown.
        """
        from replay_service.sample import torch_streams as torch_sampling

        if prefetch is None:  # sampled in the calling thread (see TorchBatchStream)
            prefetch = torch_sampling.DEFAULT_PREFETCH
        return torch_sampling.TorchBatchStream(
            self._torch_source(table),
            batch_size,
            device=device,
            pin_memory=pin_memory,
            prefetch=prefetch,
            transitions=transitions,
            with_info=with_info,
        )

    def torch_dataset(
        self,
        batch_size: int,
        *,
        transitions: bool = False,
        with_info: bool = False,
        table: str | None = None,
    ) -> TorchReplayDataset:
        """Returns a `torch.utils.data.IterableDataset` of batches sampled from this buffer.

        Use `dataset.data_loader(num_workers=N)`, or a `DataLoader(dataset, batch_size=None,
        num_workers=N, multiprocessing_context="forkserver")`; see `TorchReplayDataset`.
        `table` picks the table to sample (None: the primary one). Iterating fails like
        `torch_batches` when the server is lost; a DataLoader worker holds a copy of the
        manager's state, so after `close()` it fails when the (embedded) server is gone.

        Raises:
          BufferStateError: If no buffer was created or loaded.
          ConfigError: If an option is invalid or `table` is unknown.
        """
        from replay_service.sample import torch_streams as torch_sampling

        return torch_sampling.TorchReplayDataset(
            self._torch_source(table),
            batch_size,
            transitions=transitions,
            with_info=with_info,
        )

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
        """Returns an endless iterator of torch batches mixing several tables of this buffer.

        `mixed_dataset` for PyTorch, on every backend: each item of a batch comes from table
        `name` with probability `weights[name] / sum(weights)`, drawn independently per item
        from a generator seeded by `seed`, and is sampled by that table's own sampler. The
        proportions hold on average (a batch holds a binomial number of each table's items),
        and the tables' items are interleaved in a batch. With `with_info`, batches come as
        `(batch, MixedSampleInfo)`: each item's own table's info, and `info.table`, the
        position of its table in `weights` (see `replay_service.sample.mixing`). Batches and
        the other options are those of `torch_batches`.

        Args:
          batch_size: Items per batch.
          weights: Table name -> weight; finite, >= 0, with a positive sum. The tables must
            have one sequence length.
          seed: Seed of the choice of tables (an integer >= 0); None draws one. The items of
            each table are drawn by its sampler, which no seed fixes.
          device: Where the tensors are placed (see `torch_batches`).
          pin_memory: Pin host memory before the transfer to `device`.
          prefetch: Batches prepared ahead by a background thread; None: none.
          transitions: Yield `TransitionBatch`es (tables of 2-step items).
          with_info: Yield `(batch, MixedSampleInfo)` pairs.

        Returns:
          A `TorchBatchStream` (close it, or use it in `with`, to stop its thread).

        Raises:
          BufferStateError: If no buffer was created or loaded; when iterating, if a table
            yields nothing within `Timeouts.sample` (named).
          ConfigError: If a weight, table name, size, seed or option is invalid, or the
            tables' sequence lengths differ.
          ServerUnavailableError, ManagerClosedError: When iterating, as `torch_batches`.
        """
        from replay_service.sample import mixing
        from replay_service.sample import torch_streams as torch_sampling

        replay_buffer = self._require_buffer()
        probabilities = check_mix_weights(self.tables, weights)
        sources = {
            name: self._backend.torch_source(replay_buffer, find_table(self.tables, name))
            for name in probabilities
        }
        source = mixing.MixedSampleSource(
            sources, probabilities, {name: i for i, name in enumerate(weights)}, seed=seed
        )
        return torch_sampling.TorchBatchStream(
            source,
            batch_size,
            device=device,
            pin_memory=pin_memory,
            prefetch=torch_sampling.DEFAULT_PREFETCH if prefetch is None else prefetch,
            transitions=transitions,
            with_info=with_info,
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
        """Returns shuffled batches holding every stored item exactly once per epoch.

        pytorchrl's `generate_batches(num_mini_batch, mini_batch_size, num_epochs)`: each
        epoch is a new random permutation of the items cut into batches of `batch_size`
        (`len(manager) // batch_size` full batches and, unless `drop_last`, one shorter
        batch of the rest). The items are the table's at this call: a snapshot read once
        (Reverb: from a checkpoint taken now, which becomes the newest checkpoint, as with
        `export()`, and needs the checkpoint files on this machine; local: a copy), held in
        memory and never sampled from the table, so rate limiters and `times_sampled` are
        untouched. Batches are torch tensors like `torch_batches` (see
        `replay_service.sample.epochs.EpochBatches`).

        Args:
          batch_size: Items per batch.
          num_epochs: Passes over the items.
          seed: Seed of the permutations (the same seed gives the same batches); None draws
            fresh ones.
          drop_last: Leave out each epoch's last, shorter batch.
          transitions: Yield `TransitionBatch`es (tables of 2-step items) instead of item
            nests.
          device: Torch device of the batches.
          table: Table to pass over; None is the primary table.

        Returns:
          An `EpochBatches` (iterable, `len()` is the number of batches of all epochs).

        Raises:
          ConfigError: If a size, seed, flag or device is invalid, `table` is unknown,
            `transitions` does not apply to the table's items, or `drop_last` leaves no batch.
          BufferStateError: If no buffer was created or loaded, or the table holds no items.
          CheckpointError: Reverb: if the snapshot's checkpoint cannot be taken or read.
        """
        from replay_service.sample import epochs

        config = find_table(self.tables, table)
        epochs.check_options(batch_size, num_epochs, seed, drop_last, transitions)
        self._require_client()
        self._flush_writers()
        items = self._backend.read_items(config)
        return epochs.EpochBatches(
            items.data,
            self._stored_spec,
            batch_size,
            num_epochs=num_epochs,
            seed=seed,
            drop_last=drop_last,
            transitions=transitions,
            device=device,
            table_name=config.name,
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
        """Returns one round of ERE batches: update `k` of `num_updates` samples only the newest
        `c_k = max(N * eta ** (k * 1000 / num_updates), c_min)` items (capped at `N`).

        Emphasizing recent experience (Wang & Ross 2019; pytorchrl's `EREBuffer(eta=, cmin=)`):
        iterate it once per round of updates, e.g. after each episode with `num_updates` the
        episode's length. `N` is the table's size when each batch is drawn. The items are read,
        not sampled (`times_sampled` and rate limits are untouched). See
        `replay_service.sample.recent`.

        Args:
          batch_size: Items per batch.
          num_updates: Batches in the round (K).
          eta: ERE's eta, in (0, 1]; 1 samples the whole table every time.
          c_min: The smallest window, in items.
          seed: Seed of the draws; None draws fresh ones.
          transitions: Yield `TransitionBatch`es (tables of 2-step items) instead of item
            nests.
          device: Torch device of the batches.
          table: Table to sample; None is the primary table.

        Returns:
          A `RecentBatches` (iterable, `len()` is `num_updates`; `windows` lists each batch's
          `c_k`).

        Raises:
          ConfigError: If an option is invalid (named with its value), `table` is unknown, or
            the backend cannot sample the newest items (Reverb: use backend='local').
          BufferStateError: If no buffer was created or loaded; when iterating, if the table
            is empty.
        """
        from replay_service.sample import recent

        recent.check_options(batch_size, num_updates, eta, c_min, seed, transitions)
        self._require_client()
        self._require(Capability.RECENT_SAMPLING, f"recent_batches(eta={eta!r}, c_min={c_min!r})")
        config = find_table(self.tables, table)
        backend = self._backend
        return recent.RecentBatches(
            lambda size, window, rng: backend.read_newest(config, size, window, rng),
            lambda: self.num_frames(table=config.name),
            self._stored_spec,
            batch_size,
            num_updates,
            eta=eta,
            c_min=c_min,
            seed=seed,
            transitions=transitions,
            device=device,
            table_name=config.name,
            sequence_length=config.sequence_length,
        )

    def _torch_source(self, table: str | None) -> Any:
        replay_buffer = self._require_buffer()
        return self._backend.torch_source(replay_buffer, find_table(self.tables, table))

    def transition_writer(
        self, *, priority: float = 1.0, check_continuity: bool = True
    ) -> TransitionWriter:
        """Returns a writer of `(state, action, reward, next_state, done, truncated)` transitions.

        It writes the same items as the observer, into every table (see
        `replay_service.collect.transitions`); `checkpoint()` flushes it and `close()` closes it.

        Raises:
          BufferStateError: If no buffer was created or loaded.
        """
        writer = TransitionWriter(
            self._require_client(),
            self.table_name,
            self.sequence_length,
            self._data_spec,
            stride_length=self._stride_length,
            priority=priority,
            timeouts=self._timeouts,
            check_continuity=check_continuity,
            extra_tables=self._extra_windows(),
            pad_end_of_episode=self._table.pad_end_of_episode,
            layout=self._layout,
        )
        self._observers.append(writer)  # type: ignore[arg-type]
        return writer

    def hindsight_writer(
        self,
        compute_reward: Callable[[Any, Any, Any], Any],
        *,
        strategy: str = "future",
        k: int | None = None,
        seed: int | None = None,
        priority: float = 1.0,
    ) -> HindsightWriter:
        """Returns a writer of goal-conditioned transitions and their hindsight relabels (HER).

        Each episode's transitions are written as they come; when it ends, `k` relabelled
        copies of each, whose `desired_goal` is a goal the episode achieved and whose reward is
        `compute_reward(achieved_goal, desired_goal, info)` (see
        `replay_service.collect.hindsight`). The buffer's observation must be a
        gymnasium-robotics goal observation, e.g. `from_spaces(env.observation_space, ...)` of
        a Dict space with `observation`, `achieved_goal` and `desired_goal`.

        Args:
          compute_reward: The environment's vectorised `compute_reward(achieved_goal,
            desired_goal, info)` (gymnasium-robotics: `env.unwrapped.compute_reward`).
          strategy: "future" (goals achieved later in the episode) or "final" (the episode's
            final achieved goal).
          k: Relabels per transition; None: 4 for "future", 1 for "final" (the only value).
          seed: Seed of the "future" draws; None draws fresh ones.
          priority: Initial priority of new items.

        Returns:
          A `HindsightWriter`; `checkpoint()` flushes it and `close()` closes it.

        Raises:
          BufferStateError: If no buffer was created or loaded.
          ConfigError: If the observation is not a goal observation (naming what it is), a
            table's items are not single transitions (sequence_length 2, stride_length 1), or
            an option is invalid (naming it and its value).
        """
        from replay_service.collect import hindsight

        hindsight.check_options(compute_reward, strategy, k, seed)
        hindsight.check_goal_spec(getattr(self._data_spec, "observation", None))
        for config in self.tables:
            if config.sequence_length != 2 or self._stride_length != 1:
                raise ConfigError(
                    f"hindsight_writer writes relabelled transitions as items of 2 steps; table "
                    f"{config.name!r} has sequence_length={config.sequence_length} and "
                    f"stride_length={self._stride_length} (it needs 2 and 1)"
                )
        writer = self.transition_writer(priority=priority)
        return hindsight.HindsightWriter(writer, compute_reward, strategy=strategy, k=k, seed=seed)

    def gym_vector_writer(
        self, envs: Any, *, autoreset_mode: Any = None, priority: float = 1.0
    ) -> GymVectorWriter:
        """Returns a writer of a gymnasium vector env's steps as they come (`GymVectorWriter`).

        Use `writer.reset(obs)` after `envs.reset()` and `writer.add(actions, *envs.step(actions))`
        after each step: NEXT_STEP reset steps are never stored, SAME_STEP final observations
        are taken from `infos` (see `replay_service.collect.gym_vector`).

        Args:
          envs: The vector env (its `num_envs` and `metadata["autoreset_mode"]` are read), or the
            number of environments.
          autoreset_mode: Overrides the env's mode; required when `envs` is a number or its
            metadata has none (gymnasium < 1.0 envs reset in the same step).
          priority: Initial priority of new items.

        Raises:
          BufferStateError: If no buffer was created or loaded.
          ConfigError: If the number of envs or the mode is invalid.
        """
        from replay_service.collect.gym_vector import GymVectorWriter

        num_envs = envs if isinstance(envs, int) else getattr(envs, "num_envs", None)
        if not isinstance(num_envs, int) or isinstance(num_envs, bool) or num_envs < 1:
            raise ConfigError(f"envs must be a vector env or a number of envs >= 1, got {envs!r}")
        if autoreset_mode is None:
            metadata = getattr(envs, "metadata", None) or {}
            autoreset_mode = metadata.get("autoreset_mode")
        if autoreset_mode is None:
            raise ConfigError(
                f"{envs!r} does not say its autoreset_mode; pass autoreset_mode='next_step' or "
                "'same_step'"
            )
        writers = [self.transition_writer(priority=priority) for _ in range(num_envs)]
        return GymVectorWriter(writers, autoreset_mode)

    def warm_up(
        self,
        env: Any,
        num_steps: int,
        policy: Callable[[Any], Any] | None = None,
        *,
        seed: int | None = None,
        progress: bool = True,
    ) -> int:
        """Fills the buffer with `num_steps` transitions of a gymnasium env (Velora's `warm`).

        Steps `env` (a gymnasium env, or a vector env such as `gymnasium.vector.SyncVectorEnv`)
        with `policy`, random actions by default, and writes every transition into every table,
        as `transition_writer` (single env) or `gym_vector_writer` (vector env, either
        auto-reset mode) does: terminations and truncations as gymnasium defines them, and the
        episodes still running at the end written as truncated (see
        `replay_service.collect.warm_up`). The env is reset first (`env.reset(seed=seed)`) and
        left after its last step.

        Args:
          env: A gymnasium env or vector env whose spaces match the data spec (e.g. the spaces
            this manager was made `from_spaces` of).
          num_steps: Transitions to write; a vector env steps all its environments, so up to
            `num_envs - 1` more are written.
          policy: `policy(observation) -> action` (numpy or torch; batched for a vector env),
            or, when the data spec declares extras, `policy(observation) -> (action, {name:
            value})`. None: random actions, `env.action_space.sample()`.
          seed: Seeds the env's reset and the random actions (an integer >= 0); None: unseeded.
          progress: Show a progress bar (tqdm; without tqdm, a log line every 10 s).

        Returns:
          The number of transitions written.

        Raises:
          BufferStateError: If no buffer was created or loaded.
          ConfigError: If `env`, `num_steps`, `policy`, `seed` or `progress` is invalid,
            random actions are asked of a data spec with extras (naming the value), or the env
            speaks the old gym API (`reset() -> observation`, `step() -> (observation, reward,
            done, info)`; naming what it returned, before anything is written: wrap it with
            shimmy).
          SpecMismatchError: If an observation, action or extra does not fit the data spec
            (named; the transitions before it stay written).
          WriteTimeoutError: If the server does not confirm items within `timeouts.write`.
        """
        from replay_service.collect import warm_up as warm_up_lib

        extras = warm_up_lib.extra_names(self._data_spec)
        warm_up_lib.check_options(env, num_steps, policy, seed, progress, extras)
        self._require_client()
        writer: Any = (
            self.gym_vector_writer(env)
            if warm_up_lib.is_vector_env(env)
            else self.transition_writer()
        )
        return warm_up_lib.warm_up(
            env, writer, num_steps, policy, seed=seed, progress=progress, extras=extras
        )

    def export(
        self,
        dirpath: str | os.PathLike[str],
        prefix: str = export_lib.DEFAULT_PREFIX,
        *,
        overwrite: bool = False,
    ) -> tuple[str, str]:
        """Writes every item exactly once to `<prefix>state.safetensors` + `<prefix>metadata.json`.

        Takes a checkpoint first (see `replay_service.storage.export` for the method and format).

        Returns:
          `(state_path, metadata_path)`.

        Raises:
          ConfigError: If the buffer has extra tables (export supports one table), or `prefix`
            is not a plain file-name prefix (a path separator, "..", a NUL character).
          CheckpointExistsError: If `dirpath` is not empty and `overwrite` is False.
          CheckpointError: If the checkpoint cannot be taken or read.
        """
        export_lib.require_one_table(self.tables, "export")
        export_lib.export_paths(dirpath, prefix)  # a bad prefix fails before the checkpoint
        export_lib.check_target(os.fspath(dirpath), overwrite)
        self._require_client()
        self._flush_writers()
        return self._backend.export(self._table, os.fspath(dirpath), prefix, overwrite)

    def import_buffer(
        self,
        dirpath: str | os.PathLike[str],
        prefix: str = export_lib.DEFAULT_PREFIX,
        *,
        overwrite: bool = False,
        drop_oldest: bool = False,
    ) -> tuple[ReplayBuffer, Any]:
        """Creates this manager's buffer from an export: every item, its priority, in order.

        The capacity may differ from the exported one; fewer slots than items is refused unless
        `drop_oldest=True` (the newest items are kept). See `replay_service.storage.export`.

        Returns:
          `(replay_buffer, observer)` as from `create_replay_buffer`.

        Raises:
          CheckpointError: If a file is missing, corrupt or truncated.
          SpecMismatchError: If the data spec or sequence length differ.
          ConfigError: If the items do not fit and `drop_oldest` is False, or this manager has
            extra tables (import supports one table).
          CheckpointExistsError, BufferStateError: As `create_replay_buffer`.
        """
        export_lib.require_one_table(self.tables, "import")
        self._require_no_buffer()
        items = export_lib.read_export(
            self._table, self._stored_spec, dirpath, prefix, drop_oldest=drop_oldest
        )
        replay_buffer, observer = self.create_replay_buffer(overwrite=overwrite)
        self._backend.insert_items(self._table, items)
        return replay_buffer, observer

    def table_handle(self, table: str | None = None) -> TableHandle:
        """Returns a picklable description of one table of this buffer (see `TableHandle`).

        Args:
          table: Table name; None is the primary table.

        Raises:
          BufferStateError: If no buffer was created or loaded.
          ConfigError: If `table` is not one of this buffer's tables, or the buffer uses the
            local backend (a handle describes a table of a Reverb server).
        """
        self._require_client()
        self._require(Capability.TABLE_HANDLE, "table_handle")
        return self._backend.table_handle(find_table(self.tables, table))


def _check_interval(interval: float | None, server_address: str | None) -> None:
    if interval is None:
        return
    if server_address is not None:
        raise ConfigError(
            f"checkpoint_interval_s={interval!r} applies only to the embedded server; a remote "
            "server checkpoints on its own schedule (replay-server --checkpoint_interval_s)"
        )
    if (
        not isinstance(interval, int | float)
        or isinstance(interval, bool)
        or not math.isfinite(interval)
        or interval <= 0
    ):
        raise ConfigError(
            f"checkpoint_interval_s must be a finite number of seconds > 0 or None, got "
            f"{interval!r}"
        )

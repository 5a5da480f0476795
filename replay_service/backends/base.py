"""The one interface every backend implements, and what a backend can do beyond it.

`ReplayBufferManager` holds one `Backend` and never asks which one it is: its public methods
validate their arguments, check the backend's `capabilities` where a feature is not universal,
then delegate (the pattern of TF-Agents' `replay_buffer.py`). A third backend implements this
class and declares its capabilities; the manager does not change.

Implementations: `backends.reverb.embedded.EmbeddedBackend` and `backends.reverb.remote.
RemoteBackend` (one Reverb server, in this process or reached by address) and
`backends.local.backend.LocalBackend` (tables in this process, no Reverb or TensorFlow).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from replay_service.config.options import TableConfig, Timeouts, require_seed
from replay_service.errors import ConfigError
from replay_service.sample.view import DatasetRequest, MixRequest
from replay_service.storage.store import CheckpointStore

if TYPE_CHECKING:
    import numpy as np
    import tensorflow as tf
    import torch

    from replay_service.sample.rate_limit import LimiterState
    from replay_service.sample.torch_streams import TorchSampleSource
    from replay_service.specs.layouts import Layout
    from replay_service.storage.export import ExportedItems
    from replay_service.storage.metadata import Checkpoint


class Lifeline:
    """A flag shared by a manager and the streams and datasets it hands out, raised by `close()`,
    and a count of the manager's `clear()` calls, by which torch streams drop what they sampled
    before one. Every backend hands its streams one.

    A pickled copy (a DataLoader worker's) keeps the state it had when pickled; such workers
    notice a closed embedded manager through its stopped server instead.
    """

    def __init__(self) -> None:
        self.closed = False
        self.clears = 0

    def close(self) -> None:
        """Makes every stream or dataset holding this lifeline fail at its next check."""
        self.closed = True

    def cleared(self) -> None:
        """Records that the tables were emptied."""
        self.clears += 1


class Capability(enum.Enum):
    """A feature some backends have; the value says it the way an error message does."""

    SPLIT_SEQUENCES = "get_dataset(num_steps=...) shorter than the stored items"
    MIXED_DATASET = "mixed_dataset"
    TRAIN_SCHEDULE = "train_schedule (a samples_per_insert rate limiter)"
    TABLE_HANDLE = "table_handle (a picklable table of a Reverb server)"
    PACKED_LAYOUT = "layout='packed' (a Reverb table storing one byte row per step)"
    PORT = "port= (a server listening for other processes)"
    MEMMAP_STORAGE = "storage='memmap' (tables in memory-mapped files)"
    RECENT_SAMPLING = (
        "recent_batches (sampling only the newest items, ERE: no Reverb sampler draws from "
        "the newest c items with c changing every update)"
    )
    SEEDED_SAMPLING = "seed= (reproducible sampling; a Reverb server's samplers cannot be seeded)"
    DEVICE_STORAGE = "device= (a table's storage on a torch device, sampled there)"
    COMPRESSION = "compression= (a local table's steps stored compressed)"


STORAGES = ("memory", "memmap")
"""The values of a manager's `storage=` (`Capability.MEMMAP_STORAGE` for "memmap")."""

# The manager's options that ask a capability of the backend, in the order they are checked:
# (name, capability, whether the value asks for it).
_CAPABILITY_OPTIONS: tuple[tuple[str, Capability, Callable[[Any], bool]], ...] = (
    ("storage", Capability.MEMMAP_STORAGE, lambda value: value != "memory"),
    ("layout", Capability.PACKED_LAYOUT, lambda value: value not in ("auto", "nested")),
    ("port", Capability.PORT, lambda value: value is not None),
    ("seed", Capability.SEEDED_SAMPLING, lambda value: value is not None),
    ("device", Capability.DEVICE_STORAGE, lambda value: value is not None),
    ("compression", Capability.COMPRESSION, lambda value: value is not None),
)


@dataclasses.dataclass(frozen=True)
class BackendOptions:
    """Everything a backend is built from, validated by the manager.

    Attributes:
      tables: Table configurations, the primary one first.
      data_spec: Per-step data spec.
      stored_spec: What each step stores (`data_spec`, or `Masked` for padded tables).
      timeouts: Bounds on blocking calls.
      checkpoint_dir: The checkpoint directory (None with a remote server).
      keep_checkpoints: Complete checkpoints retained.
      checkpoint_interval_s: Seconds between automatic checkpoints; None: only on request.
      port: Port of an embedded server; None picks one.
      server_address: "host:port" of a running server (remote mode), else None.
      storage: "memory" or "memmap".
      seed: Seed of the samplers (`Capability.SEEDED_SAMPLING`); None: fresh entropy.
      device: Torch device of the tables' storage (`Capability.DEVICE_STORAGE`); None: host
        memory.
      compression: Codec of the local tables' stored steps (`backends.local.codecs.CODECS`);
        None: uncompressed.
      layout_from_server: Remote mode: take the layout of the server's tables on connecting
        (the manager's `layout="auto"`), replacing `layout` and the tables' `layout`.
    """

    tables: tuple[TableConfig, ...]
    data_spec: Any
    stored_spec: Any
    timeouts: Timeouts
    checkpoint_dir: str | os.PathLike[str] | None = None
    keep_checkpoints: int = 3
    checkpoint_interval_s: float | None = None
    port: int | None = None
    server_address: str | None = None
    storage: str = "memory"
    seed: int | None = None
    device: str | None = None
    compression: str | None = None
    layout_from_server: bool = False

    def checkpoint_store(self) -> CheckpointStore:
        """The store of `checkpoint_dir`, keeping `keep_checkpoints` checkpoints: what a backend
        that owns its checkpoint directory checkpoints into (nothing is read or locked yet)."""
        assert self.checkpoint_dir is not None
        return CheckpointStore(self.checkpoint_dir, keep=self.keep_checkpoints)


class Backend(abc.ABC):
    """Where a buffer's tables live: lifecycle, checkpoints, and how items go in and out.

    The lifecycle is `create` or `load` (each returns the client collectors write through),
    then any of the other calls, then `close`. `open_buffer` turns that client into the replay
    buffer object the manager hands out; the sampling calls take it back, since it carries
    what ends a stream (the buffer's lifeline).
    """

    kind: ClassVar[str]
    """What `ReplayBufferManager.backend` reports: "reverb" or "local"."""

    capabilities: ClassVar[frozenset[Capability]] = frozenset()
    """The features beyond this interface that the backend has."""

    description: ClassVar[str] = "this backend"
    """How errors name the backend, e.g. "the local backend (tables in this process)"."""

    def __init__(self, tables: Sequence[TableConfig], layout: Layout) -> None:
        """Keeps the buffer's tables (the primary one first) and how they store steps."""
        self._configs = tuple(tables)
        self._layout = layout

    @classmethod
    def way_out(cls, capability: Capability) -> str:
        """What to use instead where this backend lacks `capability` (for error messages)."""
        del capability
        return "choose another backend (ReplayBufferManager's backend argument)"

    @classmethod
    def refusal(cls, capability: Capability, what: str) -> ConfigError:
        """The error for asking this backend for a feature it lacks.

        Args:
          capability: The feature.
          what: What the user asked for, naming the value (e.g. "storage='memmap'").

        Returns:
          A `ConfigError` naming `what`, this backend and the way out.
        """
        return ConfigError(
            f"{what}: {capability.value} is not available with {cls.description}; "
            f"{cls.way_out(capability)}"
        )

    @classmethod
    def require(cls, capability: Capability, what: str) -> None:
        """Refuses `what` where this backend lacks `capability`.

        Raises:
          ConfigError: The `refusal` of `capability` for `what`.
        """
        if capability not in cls.capabilities:
            raise cls.refusal(capability, what)

    @classmethod
    def refused_options(cls, options: Mapping[str, Any]) -> list[str]:
        """The options among `options` (a manager's keyword arguments, by name) that ask for a
        capability this backend lacks, in the order `check_options` checks them."""
        return [
            name
            for name, capability, asks in _CAPABILITY_OPTIONS
            if name in options and asks(options[name]) and capability not in cls.capabilities
        ]

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        """Refuses a manager's backend options before anything is built.

        Args:
          options: `storage`, `layout` (a resolved name), `port`, `seed`, `device` and
            `compression`, by name.

        Raises:
          ConfigError: If `storage` is not one of `STORAGES`, `seed` not an integer >= 0, or an
            option asks for a capability this backend lacks (`refusal`, naming the value).
        """
        storage = options.get("storage", "memory")
        if storage not in STORAGES:
            raise ConfigError(f"storage must be 'memory' or 'memmap', got {storage!r}")
        require_seed("seed", options.get("seed"))
        refused = cls.refused_options(options)
        for name, capability, _ in _CAPABILITY_OPTIONS:
            if name in refused:
                raise cls.refusal(capability, f"{name}={options[name]!r}")

    @classmethod
    @abc.abstractmethod
    def from_options(cls, options: BackendOptions) -> Backend:
        """Builds the backend; nothing starts and nothing is written before `create`/`load`."""

    @property
    def tables(self) -> tuple[TableConfig, ...]:
        """The buffer's tables, the primary one first (with a remote server's layout once
        `load` took it: `BackendOptions.layout_from_server`)."""
        return self._configs

    @property
    def layout(self) -> Layout:
        """How the tables store steps (`BackendOptions.layout`, or the remote server's; a
        local table has its own storage and the layout is only what its collectors are given)."""
        return self._layout

    # ------------------------------------------------------------------------ lifecycle

    @property
    @abc.abstractmethod
    def checkpoint_dir(self) -> str | None:
        """The absolute checkpoint directory this process owns, or None (remote)."""

    @abc.abstractmethod
    def create(self, overwrite: bool) -> Any:
        """Starts a new, empty buffer; returns its client.

        Raises:
          CheckpointExistsError: If checkpoints (or items) exist and `overwrite` is False.
          CheckpointError: If the checkpoint directory cannot be used.
        """

    @abc.abstractmethod
    def load(self) -> Any:
        """Restores the newest complete checkpoint (or attaches to a server); returns the client.

        Raises:
          NoCheckpointError, CheckpointError, SpecMismatchError: See `ReplayBufferManager`.
        """

    @abc.abstractmethod
    def checkpoint(self) -> str:
        """Takes a checkpoint; returns its path.

        Raises:
          CheckpointError: If it fails.
        """

    @abc.abstractmethod
    def after_clear(self) -> None:
        """Records that every table was emptied, so that a later load does not bring it back."""

    @abc.abstractmethod
    def last_checkpoint(self) -> tuple[Checkpoint | None, float | None]:
        """The last checkpoint taken or adopted and the seconds it took (None if unknown)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stops what this backend started and releases the checkpoint directory."""

    # --------------------------------------------------------------------- items in and out

    @abc.abstractmethod
    def open_buffer(self, client: Any, clear: Callable[[], None]) -> Any:
        """Checks the tables behind `client` and returns the replay buffer to hand out.

        Args:
          client: What `create` or `load` returned.
          clear: The manager's `clear`, for a buffer whose own `clear()` must do what it does.

        Raises:
          SpecMismatchError: If a table does not hold what this buffer stores.
        """

    def users_client(self, client: Any) -> Any:
        """The client handed to users (`ReplayBufferManager.py_client`) for the client
        `create`/`load` returned: itself unless the tables' storage needs writers of its own
        (a packed Reverb layout)."""
        return client

    @abc.abstractmethod
    def num_items(self, client: Any, table: str) -> int:
        """The number of items in `table`."""

    @abc.abstractmethod
    def dataset(self, replay_buffer: Any, request: DatasetRequest) -> tf.data.Dataset:
        """A tf.data pipeline of `(items, info)` batches of `request.table`, `request.prefetch`
        batches ahead.

        `request.num_steps` is None or the table's sequence length unless the backend has
        `Capability.SPLIT_SEQUENCES`.
        """

    @abc.abstractmethod
    def torch_source(self, replay_buffer: Any, table: TableConfig) -> TorchSampleSource:
        """The `TorchSampleSource` the PyTorch streams of `table` draw from."""

    def note_clear(self, replay_buffer: Any) -> None:  # noqa: B027 (optional hook)
        """Called after the tables were reset, before `after_clear`: streams drop what they
        fetched before. The default does nothing (streams that compare the table's own clear
        count need nothing more)."""

    @abc.abstractmethod
    def export(
        self, table: TableConfig, dirpath: str, prefix: str, overwrite: bool
    ) -> tuple[str, str]:
        """Writes every item of `table` once in the export format; returns the two paths.

        Raises:
          CheckpointError: If the items cannot be read or written.
        """

    @abc.abstractmethod
    def read_items(self, table: TableConfig) -> ExportedItems:
        """Every item of `table` once, oldest first: a consistent snapshot, read now.

        Nothing is sampled from the table (its rate limiter and `times_sampled` are untouched).

        Raises:
          CheckpointError: If the items cannot be read.
        """

    @abc.abstractmethod
    def insert_items(self, table: TableConfig, items: ExportedItems) -> None:
        """Inserts exported items, with their priorities, in order, into an empty `table`."""

    # --------------------------------------------------------- features of some backends

    def mixed_dataset(self, replay_buffer: Any, request: MixRequest) -> tf.data.Dataset:
        """Batches mixing the buffer's tables by `request.weights`
        (`Capability.MIXED_DATASET`)."""
        raise NotImplementedError(Capability.MIXED_DATASET.value)

    def limiter_state(self, table: str) -> LimiterState:
        """The rate limiter state of `table` (`Capability.TRAIN_SCHEDULE`)."""
        raise NotImplementedError(Capability.TRAIN_SCHEDULE.value)

    def table_handle(self, table: TableConfig) -> Any:
        """A picklable description of `table` (`Capability.TABLE_HANDLE`)."""
        raise NotImplementedError(Capability.TABLE_HANDLE.value)

    def newest_reader(
        self, table: TableConfig, what: str
    ) -> Callable[[int, int, np.random.Generator], list[torch.Tensor]]:
        """`read_newest` of `table`: `reader(batch_size, window, rng)`.

        Args:
          table: The table read.
          what: What the user asked for, naming the values (for the refusal).

        Raises:
          ConfigError: If the backend lacks `Capability.RECENT_SAMPLING` (`refusal`).
        """
        if Capability.RECENT_SAMPLING not in self.capabilities:
            raise self.refusal(Capability.RECENT_SAMPLING, what)
        return functools.partial(self.read_newest, table)

    def read_newest(
        self, table: TableConfig, batch_size: int, window: int, rng: np.random.Generator
    ) -> list[torch.Tensor]:
        """`batch_size` items of `table` drawn uniformly from its newest `window` items, one
        torch tensor per field, without counting them as sampled (`Capability.RECENT_SAMPLING`)."""
        raise NotImplementedError(Capability.RECENT_SAMPLING.value)

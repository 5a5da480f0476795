"""`EmbeddedBackend`: the buffer's tables on a Reverb server in this process, and its checkpoints.

The server owns the checkpoint directory. It is a `CheckpointedServer`: `create` starts it
empty, `load` restores the newest checkpoint that verifies, and it checkpoints into the
directory on request and on a schedule. What it shares with the remote backend (tables,
datasets, export and import) is `backends.reverb.backend.ReverbBackend`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import reverb

from replay_service.backends.base import BackendOptions, Capability
from replay_service.backends.reverb import transfer
from replay_service.backends.reverb.backend import ReverbBackend, options_layout
from replay_service.backends.reverb.server import CheckpointedServer
from replay_service.config.options import TableConfig, Timeouts
from replay_service.specs.layouts import Layout
from replay_service.storage import export as export_lib
from replay_service.storage.metadata import Checkpoint
from replay_service.storage.store import CheckpointStore

_log = logging.getLogger(__name__)


class EmbeddedBackend(ReverbBackend):
    """A Reverb server in this process that checkpoints into `store`.

    Args:
      store: The checkpoint directory.
      tables: Table configurations, the primary one first.
      data_spec: Per-step data spec.
      port: Port to listen on; None picks one.
      timeouts: Bounds on blocking calls (`checkpoint` bounds each checkpoint).
      checkpoint_interval_s: Seconds between automatic checkpoints; None: only on request.
      stored_spec: What each step stores; None: `data_spec`.
      layout: How the tables store steps.
    """

    capabilities = ReverbBackend.capabilities | {Capability.PORT}
    description = "an embedded Reverb server"

    def __init__(
        self,
        store: CheckpointStore,
        tables: Sequence[TableConfig],
        data_spec: Any,
        port: int | None,
        timeouts: Timeouts,
        checkpoint_interval_s: float | None = None,
        stored_spec: Any = None,
        *,
        layout: Layout,
    ) -> None:
        super().__init__(tables, data_spec, stored_spec, timeouts, layout)
        self._store = store
        self._port = port
        self._interval = checkpoint_interval_s
        self._owner: CheckpointedServer | None = None

    @classmethod
    def from_options(cls, options: BackendOptions) -> EmbeddedBackend:
        """An embedded server for `options` (its checkpoint directory is locked on start)."""
        assert options.checkpoint_dir is not None
        return cls(
            CheckpointStore(options.checkpoint_dir, keep=options.keep_checkpoints),
            options.tables,
            options.data_spec,
            options.port,
            options.timeouts,
            options.checkpoint_interval_s,
            stored_spec=options.stored_spec,
            layout=options_layout(options),
        )

    @property
    def checkpoint_dir(self) -> str | None:
        """The absolute checkpoint directory."""
        return self._store.root

    def create(self, overwrite: bool) -> reverb.Client:
        """Starts a new, empty buffer; see `CheckpointedServer.create`."""
        client = self._serve(CheckpointedServer.create, overwrite=overwrite)
        _log.info("Created an empty buffer in %s", self._store.root)
        return client

    def load(self) -> reverb.Client:
        """Restores the newest checkpoint that verifies; see `CheckpointedServer.restore`."""
        client = self._serve(CheckpointedServer.restore)
        assert self._owner is not None and self._owner.restored_from is not None
        restored = self._owner.restored_from
        _log.info("Loaded %s items from %s", restored.num_items, restored.path)
        return client

    def _serve(self, start: Callable[..., CheckpointedServer], **options: Any) -> reverb.Client:
        """Starts the server with `start` (`CheckpointedServer.create` or `.restore`, given
        `options`) and its checkpoint schedule; returns its client."""
        self._owner = start(
            self._tables,
            self._data_spec,
            self._store,
            port=self._port,
            checkpoint_timeout=self._timeouts.checkpoint,
            **options,
        )
        self._owner.start_schedule(self._interval)
        self._client = self._owner.client
        return self._client

    def replay_buffer_kwargs(self) -> dict[str, Any]:
        """How TF-Agents' `ReverbReplayBuffer` reaches the server."""
        assert self._owner is not None
        return {"local_server": self._owner.server}

    def checkpoint(self) -> str:
        """Takes a verified checkpoint; returns its path under `checkpoints/`.

        Raises:
          CheckpointError: If it fails.
        """
        assert self._owner is not None
        return self._owner.checkpoint().path

    def read_items(self, table: TableConfig) -> export_lib.ExportedItems:
        """The items of a checkpoint taken now and deleted once read (`CheckpointedServer.
        snapshot`): the user's checkpoints, their retention and the newest one stay as they
        were."""
        assert self._owner is not None
        handle = self.table_handle(table)
        return self._owner.snapshot(lambda path: transfer.read_items(handle, path))

    def after_clear(self) -> None:
        """Checkpoints the emptied tables, so a later load does not bring old items back."""
        self.checkpoint()

    def last_checkpoint(self) -> tuple[Checkpoint | None, float | None]:
        """The last checkpoint taken or adopted, and the seconds it took (None if unknown)."""
        if self._owner is None:
            return None, None
        return self._owner.last_checkpoint, self._owner.last_checkpoint_duration_s

    def close(self) -> None:
        """Stops the server (no checkpoint) and releases the directory."""
        if self._owner is not None:
            self._owner.stop(final_checkpoint=False)

"""`EmbeddedBackend`: the buffer's tables on a Reverb server in this process, and its checkpoints.

The server owns the checkpoint directory. It is a `CheckpointedServer`: `create` starts it
empty, `load` restores the newest checkpoint that verifies, and it checkpoints into the
directory on request and on a schedule. What it shares with the remote backend (tables,
datasets, export and import) is `backends.reverb.backend.ReverbBackend`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import reverb

from replay_service.backends.base import BackendOptions, Capability
from replay_service.backends.reverb import transfer
from replay_service.backends.reverb.backend import ReverbBackend
from replay_service.backends.reverb.server import CheckpointedServer
from replay_service.config.options import TableConfig
from replay_service.storage import export as export_lib
from replay_service.storage.metadata import Checkpoint

_log = logging.getLogger(__name__)


class EmbeddedBackend(ReverbBackend):
    """A Reverb server in this process that checkpoints into its checkpoint directory.

    Args:
      options: As `ReverbBackend`'s, and the `checkpoint_dir` (locked on start) keeping
        `keep_checkpoints`, the `port` to listen on (None picks one) and the
        `checkpoint_interval_s` between automatic checkpoints (None: only on request);
        `timeouts.checkpoint` bounds each checkpoint.
    """

    capabilities = ReverbBackend.capabilities | {Capability.PORT}
    description = "an embedded Reverb server"

    def __init__(self, options: BackendOptions) -> None:
        super().__init__(options)
        self._store = options.checkpoint_store()
        self._port = options.port
        self._interval = options.checkpoint_interval_s
        self._owner: CheckpointedServer | None = None

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
            self._configs,
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

"""Where a `ReplayBufferManager`'s tables live: an embedded server, or a remote one.

The manager holds one backend and asks it for a client; it never branches on the mode itself.

- `EmbeddedBackend`: a `CheckpointedServer` in this process, owning `checkpoint_dir`.
- `RemoteBackend`: a running `replay-server` (or any Reverb server with the same tables),
  which owns its checkpoints.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import reverb

from replay_service.backends.reverb import internals as reverb_internals
from replay_service.backends.reverb.connection import call_with_timeout, connect, server_info
from replay_service.backends.reverb.server import CheckpointedServer
from replay_service.config.options import TableConfig, Timeouts
from replay_service.errors import CheckpointError, CheckpointExistsError, SpecMismatchError
from replay_service.integrations import tf_compat
from replay_service.storage.store import Checkpoint, CheckpointStore

tf_compat.patch_inspect()  # lets TF-Agents' PolicySaver save policies (see tf_compat)

_log = logging.getLogger(__name__)


class EmbeddedBackend:
    """A Reverb server in this process that checkpoints into `store`.

    Args:
      store: The checkpoint directory.
      tables: Table configurations, the primary one first.
      data_spec: Per-step data spec.
      port: Port to listen on; None picks one.
      timeouts: Bounds on blocking calls (`checkpoint` bounds each checkpoint).
      checkpoint_interval_s: Seconds between automatic checkpoints; None: only on request.
    """

    def __init__(
        self,
        store: CheckpointStore,
        tables: Sequence[TableConfig],
        data_spec: Any,
        port: int | None,
        timeouts: Timeouts,
        checkpoint_interval_s: float | None = None,
    ) -> None:
        self._store = store
        self._tables = tuple(tables)
        self._data_spec = data_spec
        self._port = port
        self._timeouts = timeouts
        self._interval = checkpoint_interval_s
        self._owner: CheckpointedServer | None = None

    @property
    def checkpoint_dir(self) -> str | None:
        """The absolute checkpoint directory."""
        return self._store.root

    def create(self, overwrite: bool) -> reverb.Client:
        """Starts a new, empty buffer; see `CheckpointedServer.create`."""
        self._owner = CheckpointedServer.create(
            self._tables,
            self._data_spec,
            self._store,
            port=self._port,
            checkpoint_timeout=self._timeouts.checkpoint,
            overwrite=overwrite,
        )
        self._owner.start_schedule(self._interval)
        _log.info("Created an empty buffer in %s", self._store.root)
        return self._owner.client

    def load(self) -> reverb.Client:
        """Restores the newest checkpoint that verifies; see `CheckpointedServer.restore`."""
        self._owner = CheckpointedServer.restore(
            self._tables,
            self._data_spec,
            self._store,
            port=self._port,
            checkpoint_timeout=self._timeouts.checkpoint,
        )
        self._owner.start_schedule(self._interval)
        assert self._owner.restored_from is not None
        _log.info(
            "Loaded %s items from %s",
            self._owner.restored_from.num_items,
            self._owner.restored_from.path,
        )
        return self._owner.client

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


class RemoteBackend:
    """A running Reverb server at `address` that owns its checkpoints.

    Args:
      address: "host:port".
      tables: Table configurations the server must have.
      timeouts: Bounds on blocking calls.
    """

    checkpoint_dir = None

    def __init__(self, address: str, tables: Sequence[TableConfig], timeouts: Timeouts) -> None:
        self._address = address
        self._tables = tuple(tables)
        self._timeouts = timeouts
        self._client: reverb.Client | None = None

    def create(self, overwrite: bool) -> reverb.Client:
        """Empties the server's tables, refusing non-empty ones unless `overwrite`.

        Raises:
          CheckpointExistsError: If a table holds items and `overwrite` is False.
          ServerUnavailableError: If the server does not answer.
        """
        client = self.load()
        infos = server_info(client, self._timeouts.connect)
        for table in self._tables:
            size = infos[table.name].current_size if table.name in infos else 0
            if size and not overwrite:
                raise CheckpointExistsError(
                    f"table {table.name!r} on {self._address!r} already holds {size} items; use "
                    "load_replay_buffer() to keep them or overwrite=True to empty it"
                )
        for table in self._tables:
            client.reset(table.name)
        self.after_clear()
        return client

    def load(self) -> reverb.Client:
        """Connects to the server.

        Raises:
          ServerUnavailableError: If it does not answer within `timeouts.connect`.
        """
        self._client = connect(self._address, self._timeouts.connect)
        return self._client

    def replay_buffer_kwargs(self) -> dict[str, Any]:
        """How TF-Agents' `ReverbReplayBuffer` reaches the server."""
        return {"server_address": self._address}

    def checkpoint(self) -> str:
        """Asks the server for a checkpoint; returns where Reverb wrote it on the server's side
        (`replay-server` then verifies and adopts it into its `checkpoints/`). A save that lost
        a race with another client's or the server's own save is asked for once more.

        Raises:
          CheckpointError: If it fails or takes longer than `timeouts.checkpoint`.
        """
        client, timeout = self._client, self._timeouts.checkpoint
        assert client is not None
        try:
            return reverb_internals.retry_concurrent_save(
                lambda: call_with_timeout(client.checkpoint, timeout, "checkpoint")
            )
        except Exception as e:  # Reverb raises RuntimeError; a timeout raises TimeoutError
            raise CheckpointError(f"checkpoint of {self._address!r} failed: {e}") from e

    def after_clear(self) -> None:
        """Checkpoints the emptied tables on the server, so a restart does not bring them back.

        Raises:
          CheckpointError: If that checkpoint fails (the tables are empty either way).
        """
        try:
            self.checkpoint()
        except CheckpointError as e:
            raise CheckpointError(
                f"the tables were emptied, but the server could not checkpoint that: {e}; "
                "a restart of the server may bring the old items back"
            ) from e

    def last_checkpoint(self) -> tuple[Checkpoint | None, float | None]:
        """Unknown here: the server owns its checkpoints (`replay-server status --json`)."""
        return None, None

    def close(self) -> None:
        """Nothing to release: the server runs on."""
        self._client = None


def check_table_exists(client: reverb.Client, name: str, timeout: float | None) -> Any:
    """Returns the `TableInfo` of `name` on the server behind `client`.

    Raises:
      SpecMismatchError: If the server has no such table.
      ServerUnavailableError: If it does not answer in time.
    """
    infos = server_info(client, timeout)
    if name not in infos:
        raise SpecMismatchError(
            f"server at {client.server_address!r} has no table {name!r}; "
            f"its tables are {sorted(infos)}"
        )
    return infos[name]

"""`RemoteBackend`: the buffer's tables on a running Reverb server, which owns its checkpoints.

The server, reached by address, is a `replay-server` (or any Reverb server with the same
tables): `load` connects to it (taking its tables' layout with `layout="auto"`), `create`
empties its tables, and a checkpoint is asked of it. What it shares with the embedded backend
(tables, datasets, export and import) is `backends.reverb.backend.ReverbBackend`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import reverb

from replay_service.backends.base import BackendOptions
from replay_service.backends.reverb import internals as reverb_internals
from replay_service.backends.reverb.backend import (
    ReverbBackend,
    check_table_exists,
)
from replay_service.backends.reverb.connection import connect, server_info
from replay_service.bounded import call_with_timeout
from replay_service.errors import CheckpointError, CheckpointExistsError
from replay_service.specs.layout_registry import resolve_layout
from replay_service.specs.layouts import NESTED, PACKED, signature_layout
from replay_service.storage.metadata import Checkpoint


class RemoteBackend(ReverbBackend):
    """A running Reverb server at `options.server_address` that owns its checkpoints.

    Args:
      options: As `ReverbBackend`'s (its tables are those the server must have), and the
        `server_address` ("host:port"); with `layout_from_server`, the layout of the server's
        tables is taken on connecting instead (`load`; the manager's `layout="auto"`).
    """

    description = "a remote Reverb server"

    def __init__(self, options: BackendOptions) -> None:
        super().__init__(options)
        assert options.server_address is not None
        self._address = options.server_address
        self._layout_from_server = options.layout_from_server

    @property
    def checkpoint_dir(self) -> None:
        """None: the server owns its checkpoints."""
        return None

    def create(self, overwrite: bool) -> reverb.Client:
        """Empties the server's tables, refusing non-empty ones unless `overwrite`.

        Raises:
          CheckpointExistsError: If a table holds items and `overwrite` is False.
          ServerUnavailableError: If the server does not answer.
        """
        client = self.load()
        infos = server_info(client, self._timeouts.connect)
        for table in self._configs:
            size = infos[table.name].current_size if table.name in infos else 0
            if size and not overwrite:
                raise CheckpointExistsError(
                    f"table {table.name!r} on {self._address!r} already holds {size} items; use "
                    "load_replay_buffer() to keep them or overwrite=True to empty it"
                )
        for table in self._configs:
            client.reset(table.name)
        self.after_clear()
        return client

    def load(self) -> reverb.Client:
        """Connects to the server; with `layout_from_server`, takes its tables' layout
        (`server_layout`) for every table, before anything is built with it.

        Raises:
          ServerUnavailableError: If it does not answer within `timeouts.connect`.
          SpecMismatchError: With `layout_from_server`, if the server has no primary table.
        """
        client = connect(self._address, self._timeouts.connect)
        if self._layout_from_server:
            name = self.server_layout(client)
            if name != self._configs[0].layout:
                self._configs = tuple(dataclasses.replace(t, layout=name) for t in self._configs)
                self._layout = resolve_layout(name, self._stored_spec)
        self._client = client
        return client

    def replay_buffer_kwargs(self) -> dict[str, Any]:
        """How TF-Agents' `ReverbReplayBuffer` reaches the server."""
        return {"server_address": self._address}

    def server_layout(self, client: reverb.Client) -> str:
        """ "packed" when the primary table's signature is one `uint8[sequence_length,
        step_bytes]` tensor (a packed table's), else "nested"; `open_buffer` then checks every
        table against it.

        Raises:
          SpecMismatchError: If the server has no such table.
          ServerUnavailableError: If it does not answer within `timeouts.connect`.
        """
        info = check_table_exists(client, self._configs[0].name, self._timeouts.connect)
        return PACKED if signature_layout(info.signature) == PACKED else NESTED

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

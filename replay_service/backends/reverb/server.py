"""`CheckpointedServer`: the one owner of a Reverb server and its checkpoint directory.

The embedded `ReplayBufferManager` and `replay-server` both run their server through this class;
`replay-server` adds only its schedule flag and signal handling. It creates a new buffer or
restores the newest checkpoint that verifies and loads, takes verified checkpoints (on demand
and on a schedule), adopts checkpoints that remote clients request, and stops cleanly.

Restore, newest checkpoint first:
1. `DONE` and the metadata file must read; the stored tables and data spec (and the spec of
   each variable table) must equal the configured ones (a difference is an error, the search
   stops: it is a configuration mistake, not damage).
2. Every file must have the size and SHA-256 recorded at checkpoint (older checkpoints without
   digests are read back in full instead, and their item count compared).
3. Reverb must load it, and the server must then hold exactly the recorded number of items.
A checkpoint that fails 1 (damage), 2 or 3 is moved to `corrupt/` with a warning naming it and
the one tried next; if none is left, `NoCheckpointError` names what was moved aside.

Stop with a final checkpoint first stops the server from confirming writes (see
`reverb_internals.close_foreign_connections`), so the checkpoint holds every confirmed item.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import reverb

from replay_service.backends.reverb import internals as reverb_internals
from replay_service.backends.reverb.connection import (
    check_port_free,
    first_answer,
    pick_free_port,
    server_info,
)
from replay_service.backends.reverb.tables import make_replay_tables, make_variable_table
from replay_service.bounded import call_with_timeout
from replay_service.config.files import ServiceConfig
from replay_service.config.options import TableConfig, VariableTableConfig
from replay_service.config.tables import check_variable_tables
from replay_service.errors import (
    CheckpointError,
    ReplayServiceError,
    ServerError,
    ServerUnavailableError,
)
from replay_service.specs.layouts import NESTED
from replay_service.storage.files import check_recorded_files, remove_path
from replay_service.storage.metadata import Checkpoint, StoreMetadata
from replay_service.storage.schedule import CheckpointSchedule
from replay_service.storage.store import CheckpointStore, WriteCheckpoint

_T = TypeVar("_T")

_log = logging.getLogger(__name__)
# Seconds a server-info query may take while restoring or stopping.
INFO_TIMEOUT_S = 10.0
# Starts of a server on a port of its owner's choosing before giving up when none answers its
# first calls (`CheckpointedServer._first_contact`).
FIRST_CONTACT_STARTS = 2


class CheckpointedServer:
    """A running Reverb server that checkpoints into its own directory.

    Build one with `create` (a new, empty buffer) or `restore` (the newest checkpoint that
    verifies and loads); the constructor does not start anything.

    Args:
      tables: Table configurations, the primary table first.
      data_spec: Per-step data spec of every table.
      store: The checkpoint directory.
      port: Port to listen on (all interfaces); None picks a free one.
      checkpoint_timeout: Seconds one checkpoint may take; None waits forever.
      variable_tables: TF-Agents variable-container tables served beside `tables`, each with
        its own spec (see `config.VariableTableConfig`).

    Raises:
      ConfigError: If a variable table is not a `VariableTableConfig` or its name is taken.
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        data_spec: Any,
        store: CheckpointStore,
        port: int | None = None,
        checkpoint_timeout: float | None = 600.0,
        *,
        variable_tables: Sequence[VariableTableConfig] = (),
    ) -> None:
        self._tables = tuple(tables)
        self._variable_tables = check_variable_tables(self._tables, variable_tables)
        self._data_spec = data_spec
        self._store = store
        self._port = port
        self._timeout = checkpoint_timeout
        self.metadata = StoreMetadata.for_tables(
            self._tables[0], data_spec, self._tables[1:], self._variable_tables
        )
        self._server: reverb.Server | None = None
        self._client: reverb.Client | None = None
        self._checkpoints = CheckpointSchedule(
            store, self.metadata, log=_log, thread_name="replay-checkpoints"
        )
        self._stopped = False
        self._dropped = 0
        self.restored_from: Checkpoint | None = None

    # ------------------------------------------------------------------------------ start

    @classmethod
    def create(
        cls,
        tables: Sequence[TableConfig],
        data_spec: Any,
        store: CheckpointStore,
        *,
        port: int | None = None,
        checkpoint_timeout: float | None = 600.0,
        overwrite: bool = False,
        variable_tables: Sequence[VariableTableConfig] = (),
    ) -> CheckpointedServer:
        """Starts a new, empty buffer in `store`.

        Args:
          tables: Table configurations, the primary table first.
          data_spec: Per-step data spec.
          store: The checkpoint directory.
          port: Port to listen on; None picks one.
          checkpoint_timeout: Seconds one checkpoint may take.
          overwrite: Delete the store's existing checkpoints instead of refusing (files that
            are not replay_service's are never deleted).
          variable_tables: Variable-container tables served beside `tables`.

        Returns:
          The running server.

        Raises:
          CheckpointExistsError: If checkpoints exist and `overwrite` is False.
          CheckpointError: If the directory is foreign, in use or not writable.
          PortInUseError, ServerError: If the server cannot start.
        """
        owner = cls(
            tables, data_spec, store, port, checkpoint_timeout, variable_tables=variable_tables
        )
        store.check_new(overwrite)
        # A server that started but never answered stops before the unlock.
        with store.serving(on_error=owner._discard):
            store.prepare_new(owner.metadata, overwrite=overwrite)
            owner._start(None)
        return owner

    @classmethod
    def restore(
        cls,
        tables: Sequence[TableConfig],
        data_spec: Any,
        store: CheckpointStore,
        *,
        port: int | None = None,
        checkpoint_timeout: float | None = 600.0,
        variable_tables: Sequence[VariableTableConfig] = (),
    ) -> CheckpointedServer:
        """Starts a server restored from the newest checkpoint that verifies and loads.

        See the module docstring for the checks and what happens to a checkpoint that fails.
        Arguments as `create`; the stored variable tables (and their specs) must be those of
        `variable_tables`, and their items are restored with the rest.

        Returns:
          The running server; `restored_from` is the checkpoint it loaded.

        Raises:
          NoCheckpointError: If the directory is missing or empty, or no checkpoint is left
            that verifies and loads (the message names those moved to `corrupt/`).
          SpecMismatchError: If the stored tables or data spec differ from the configured ones.
          CheckpointError: If the directory is foreign, in use or cannot be read or written.
          PortInUseError, ServerError: If the server cannot start.
        """
        owner = cls(
            tables, data_spec, store, port, checkpoint_timeout, variable_tables=variable_tables
        )
        store.read_metadata().check_matches(owner.metadata, store.store_file)
        # A server that started but never answered stops before the unlock.
        with store.serving(on_error=owner._discard):
            reverb_internals.require_supported_reverb()
            owner.restored_from = store.restore_latest(
                owner.metadata, owner._load, owner._discard, backend="reverb"
            )
        return owner

    def _load(self, checkpoint: Checkpoint) -> None:
        checkpoint.metadata.check_matches(self.metadata, checkpoint.path)
        self._verify(checkpoint)
        self._start(checkpoint)
        self._check_restored_count(checkpoint)

    def _discard(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = self._client = None

    def _verify(self, checkpoint: Checkpoint) -> None:
        if checkpoint.files is not None:
            check_recorded_files(checkpoint.path, checkpoint.files, reverb_internals.DATA_FILES)
            return
        # Written before digests were recorded: read every file back in full instead.
        num_items, _ = reverb_internals.verify_files(checkpoint.path)
        if checkpoint.num_items is not None and num_items != checkpoint.num_items:
            raise CheckpointError(
                f"{checkpoint.path!r} holds {num_items} items, but {checkpoint.num_items} were "
                "recorded when it was taken"
            )

    def _check_restored_count(self, checkpoint: Checkpoint) -> None:
        recorded = checkpoint.num_items
        if recorded is None:
            return
        infos = server_info(self.client, INFO_TIMEOUT_S)
        names = [t.name for t in (*self._tables, *self._variable_tables)]
        restored = sum(int(infos[name].current_size) for name in names if name in infos)
        if restored != recorded - self._dropped:
            dropped = (
                f" ({self._dropped} left out as sampled max_times_sampled times)"
                if self._dropped
                else ""
            )
            raise CheckpointError(
                f"restoring {checkpoint.path!r} gave {restored} items, but {recorded} were "
                f"recorded when it was taken{dropped}"
            )

    def _start(self, restore: Checkpoint | None, *, starts: int = FIRST_CONTACT_STARTS) -> None:
        """Starts the server (restoring `restore`, if given) and waits for its first answer.

        A server on a port this owner picked that answers neither first call is stopped and
        started again on a new port, up to `starts` starts in all.

        Raises:
          PortInUseError, ServerError: If the server cannot start.
          CheckpointError: If Reverb cannot load `restore`.
          ServerUnavailableError: If no start answered.
        """
        port = self._port if self._port is not None else pick_free_port()
        check_port_free(port)
        tables = make_replay_tables(self._tables, self._data_spec)
        tables += [make_variable_table(v) for v in self._variable_tables]
        store = self._store
        view, self._dropped = (
            reverb_internals.restore_view(restore.path, tables, store.restore_dir)
            if restore
            else (None, 0)
        )
        checkpointer = reverb.checkpointers.DefaultCheckpointer(
            store.reverb_root, fallback_checkpoint_path=view
        )
        try:
            self._server = reverb.Server(tables, port=port, checkpointer=checkpointer)
        except (RuntimeError, ValueError) as e:
            if restore is not None:
                raise CheckpointError(f"Reverb cannot load {restore.path!r}: {e}") from e
            raise ServerError(f"cannot start a Reverb server on port {port}: {e}") from e
        finally:
            if view is not None:
                remove_path(view)
        try:
            self._first_contact()
        except ServerUnavailableError as e:
            if self._port is not None or starts <= 1:
                raise
            _log.warning(
                "the new server on port %d never answered (%s); starting it again", port, e
            )
            self._discard()
            self._start(restore, starts=starts - 1)
            return
        _log.info("Reverb server listening on port %d (all interfaces)", port)

    def _first_contact(self) -> None:
        """Waits for the new server's first answer to a client in this process.

        Raises:
          ServerUnavailableError: If no client gets an answer within twice `INFO_TIMEOUT_S`.
        """
        self._client = first_answer(self._require_server().localhost_client, 2 * INFO_TIMEOUT_S)

    # -------------------------------------------------------------------------- running

    @property
    def port(self) -> int:
        """The port the server listens on."""
        return self._require_server().port

    @property
    def server(self) -> reverb.Server:
        """The running `reverb.Server`."""
        return self._require_server()

    @property
    def client(self) -> reverb.Client:
        """A client of the server in this process."""
        self._require_server()
        assert self._client is not None
        return self._client

    @property
    def store(self) -> CheckpointStore:
        """The checkpoint directory."""
        return self._store

    @property
    def last_checkpoint(self) -> Checkpoint | None:
        """The last checkpoint taken or adopted, or None."""
        return self._checkpoints.last_checkpoint

    @property
    def last_checkpoint_duration_s(self) -> float | None:
        """Seconds `last_checkpoint` took (None for an adopted client checkpoint)."""
        return self._checkpoints.last_checkpoint_duration_s

    @property
    def last_error(self) -> str | None:
        """The last periodic checkpoint's failure, until a checkpoint succeeds."""
        return self._checkpoints.last_error

    def checkpoint(self) -> Checkpoint:
        """Takes a checkpoint now, verifies it and returns it.

        A checkpoint that fails (a full disk, a write error, a file that does not read back)
        leaves nothing behind in the directory and raises; the items stay in the server.

        Raises:
          CheckpointError: If it fails or takes longer than `checkpoint_timeout`; the message
            names the path.
        """
        return self._checkpoints.checkpoint(self._writer())

    def snapshot(self, read: Callable[[str], _T]) -> _T:
        """Reads a checkpoint taken now that is deleted afterwards, never adopted: it does not
        count towards `keep_checkpoints` nor become the newest checkpoint. It is read from its
        own directory under `.snapshots/` (`CheckpointStore.snapshot`), so checkpoints (this
        owner's and clients' `py_client.checkpoint()`) go on while it is read.

        Args:
          read: Reads the checkpoint directory.

        Returns:
          What `read` returns.

        Raises:
          CheckpointError: If the checkpoint cannot be written; whatever `read` raises.
        """
        return self._checkpoints.snapshot(self._writer(), read)

    def _writer(self) -> WriteCheckpoint:
        """Writes a Reverb checkpoint of the server into the staging root."""
        client = self.client  # a stopped server fails here, before the directory is touched

        def write(staging_root: str) -> tuple[str, None]:
            del staging_root  # Reverb's checkpointer writes there
            path = reverb_internals.retry_concurrent_save(
                lambda: call_with_timeout(client.checkpoint, self._timeout, "checkpoint")
            )
            return path, None

        return write

    def adopt_staged(self) -> list[Checkpoint]:
        """Adopts complete checkpoints that clients requested (`py_client.checkpoint()`)."""
        return self._checkpoints.adopt_staged()

    def start_schedule(self, interval_s: float | None) -> None:
        """Starts a thread that checkpoints every `interval_s` seconds and adopts checkpoints
        that clients request. Failures are logged and retried at the next interval.

        Checkpoints start `interval_s` apart (or back to back if one takes longer), so a crash
        loses at most the items of one interval plus one checkpoint's duration.

        Args:
          interval_s: Seconds between checkpoint starts; None or 0 only adopts.
        """
        self._checkpoints.start(self.checkpoint, interval_s, adopt=True)

    def stop(self, final_checkpoint: bool = False) -> Checkpoint | None:
        """Stops the schedule and the server and releases the directory. Idempotent.

        Args:
          final_checkpoint: First stop confirming writes (remote writers' unconfirmed items
            fail), then take a last checkpoint, which therefore holds every confirmed item.

        Returns:
          The final checkpoint, if one was taken.

        Raises:
          CheckpointError: If the final checkpoint fails; the server is stopped anyway.
        """
        if self._stopped:
            return None
        self._stopped = True
        self._checkpoints.stop(self._timeout)
        try:
            if final_checkpoint and self._server is not None:
                self._refuse_writes()
                return self.checkpoint()
            return None
        finally:
            if self._server is not None:
                self._server.stop()
            self._store.unlock()
            self._server = self._client = None

    def _refuse_writes(self) -> None:
        client = self.client
        server_info(client, INFO_TIMEOUT_S)  # make sure its own connection is open
        port = self.port
        try:
            closed = reverb_internals.close_foreign_connections(
                port, reverb_internals.own_client_ports(port)
            )
        except ReplayServiceError as e:
            _log.warning("cannot stop confirming writes before the final checkpoint: %s", e)
            return
        _log.info("stopped accepting writes (%d connections closed)", closed)

    def _require_server(self) -> reverb.Server:
        if self._server is None:
            raise ServerError("the server is not running (stopped, or never started)")
        return self._server


def serve_config(
    config: ServiceConfig,
    data_spec: Any,
    *,
    restore: bool | None,
    overwrite: bool = False,
    checkpoint_timeout: float | None = 600.0,
) -> CheckpointedServer:
    """Starts the server a `replay-server` config describes, with its checkpoint schedule.

    Args:
      config: Server settings and tables (variable tables included).
      data_spec: The per-step data spec, `config.data_spec` built.
      restore: True restores the newest checkpoint; False starts a new buffer; None restores
        when the directory holds any checkpoint (damaged ones included: then it refuses rather
        than start empty) and starts a new buffer otherwise.
      overwrite: For a new buffer, delete existing checkpoints instead of refusing.
      checkpoint_timeout: Seconds one checkpoint may take.

    Returns:
      The running server.

    Raises:
      As `CheckpointedServer.create` and `CheckpointedServer.restore`.
    """
    store = CheckpointStore(config.server.checkpoint_dir, keep=config.server.keep_checkpoints)
    if restore is None:
        restore = store.has_checkpoints()
    if restore and not config.layout_given:
        # A config that names no layout restores the buffer in the layout it was stored in
        # (a manager's new buffer is packed); a new server's tables are nested.
        stored = store.stored_layout()
        if stored is not None:
            config = config.with_layout(stored)
            if stored != NESTED:
                _log.warning(
                    "restoring %s in the %r layout its store recorded (the config names no "
                    "layout): write with replay_service's observers and writers or a "
                    "ReplayBufferManager's py_client; TF-Agents' observers on a plain "
                    "reverb.Client write nested items, which this table cannot read",
                    store.root,
                    stored,
                )
    common = {
        "port": config.server.port,
        "checkpoint_timeout": checkpoint_timeout,
        "variable_tables": config.variable_tables,
    }
    owner = (
        CheckpointedServer.restore(config.tables, data_spec, store, **common)
        if restore
        else CheckpointedServer.create(
            config.tables, data_spec, store, overwrite=overwrite, **common
        )
    )
    owner.start_schedule(config.server.checkpoint_interval_s)
    return owner

"""`ReplayServer`: a standalone Reverb server process with periodic and on-stop checkpoints."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import reverb

from replay_service.checkpoints import Checkpoint, CheckpointStore, StoreMetadata
from replay_service.config import TableConfig
from replay_service.config_file import ServiceConfig
from replay_service.errors import CheckpointError, SpecMismatchError
from replay_service.server import start_from_latest, start_server, take_checkpoint
from replay_service.tables import make_replay_tables

_log = logging.getLogger(__name__)

# How often the background thread adopts checkpoints that remote clients requested.
ADOPT_POLL_S = 1.0


def table_metadata(
    table: TableConfig, data_spec: Any, extra_tables: Sequence[TableConfig] = ()
) -> StoreMetadata:
    """The metadata recorded for `table` (and `extra_tables`) holding `data_spec` steps."""
    return StoreMetadata.for_tables(table, data_spec, extra_tables)


class ReplayServer:
    """Owns one Reverb server, its checkpoint directory and its checkpoint schedule.

    Args:
      config: Server, tables (the primary one and any extra ones) and data-spec configuration.
      checkpoint_timeout: Seconds a checkpoint may take.

    Raises:
      ConfigError: If the data spec cannot be built.
    """

    def __init__(self, config: ServiceConfig, checkpoint_timeout: float | None = 600.0) -> None:
        self._config = config
        self._data_spec = config.data_spec.build()
        self._metadata = table_metadata(config.table, self._data_spec, config.extra_tables)
        self._store = CheckpointStore(
            config.server.checkpoint_dir, keep=config.server.keep_checkpoints
        )
        self._timeout = checkpoint_timeout
        self._server: reverb.Server | None = None
        self._client: reverb.Client | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.restored_from: Checkpoint | None = None
        self.last_checkpoint: Checkpoint | None = None

    @property
    def port(self) -> int:
        """The port the server listens on."""
        assert self._server is not None, "server not started"
        return self._server.port

    def start(self, restore: bool = False, overwrite: bool = False) -> None:
        """Starts serving, empty or restored, and the checkpoint thread.

        Args:
          restore: Load the newest complete checkpoint (a corrupt one is moved aside and the
            previous one loaded).
          overwrite: Without `restore`, delete existing checkpoints instead of refusing.

        Raises:
          CheckpointExistsError: If not restoring, checkpoints exist and `overwrite` is False.
          NoCheckpointError: If restoring and no checkpoint loads.
          SpecMismatchError: If the stored table differs from the configured one.
          PortInUseError: If the port is taken.
        """
        store = self._store
        tables = make_replay_tables(
            [self._config.table, *self._config.extra_tables], self._data_spec
        )
        port = self._config.server.port
        if restore:
            self._check_store(store.read_metadata(), store.store_file)
        else:
            store.check_new(overwrite)
        store.lock()
        try:
            if restore:
                store.ensure_dirs()
                store.clean_staging(store.read_metadata())
                self._server, self.restored_from = start_from_latest(
                    tables, store, port, check=lambda c: self._check_store(c.metadata, c.path)
                )
            else:
                store.prepare_new(self._metadata, overwrite=overwrite)
                self._server = start_server(tables, store, port)
        except BaseException:
            store.unlock()
            raise
        self._client = self._server.localhost_client()
        self._thread = threading.Thread(target=self._loop, name="replay-checkpoints", daemon=True)
        self._thread.start()

    def checkpoint(self) -> Checkpoint:
        """Takes a checkpoint now and returns it.

        Raises:
          CheckpointError: If it fails.
        """
        assert self._client is not None, "server not started"
        with self._lock:
            self.last_checkpoint = take_checkpoint(
                self._client, self._store, self._metadata, self._timeout
            )
        _log.info(
            "checkpoint %s (%s items)",
            self.last_checkpoint.path,
            self.last_checkpoint.info.get("num_items"),
        )
        return self.last_checkpoint

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until `request_stop` is called; returns whether it was."""
        return self._stop.wait(timeout)

    def request_stop(self) -> None:
        """Asks `wait` to return (safe from signal handlers)."""
        self._stop.set()

    def stop(self, final_checkpoint: bool = True) -> Checkpoint | None:
        """Stops the checkpoint thread, takes a last checkpoint and stops the server.

        Returns:
          The final checkpoint, if one was taken.
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._timeout)
        final = None
        try:
            if final_checkpoint and self._client is not None:
                final = self.checkpoint()
        finally:
            if self._server is not None:
                self._server.stop()
            self._store.unlock()
            self._server = self._client = None
        return final

    def _loop(self) -> None:
        interval = self._config.server.checkpoint_interval_s
        waited = 0.0
        while not self._stop.wait(ADOPT_POLL_S):
            waited += ADOPT_POLL_S
            try:
                if interval and waited >= interval:
                    waited = 0.0
                    self.checkpoint()
                else:
                    with self._lock:
                        for adopted in self._store.adopt_staged(self._metadata):
                            self.last_checkpoint = adopted
                            _log.info("adopted client checkpoint %s", adopted.path)
            except CheckpointError as e:
                _log.error("periodic checkpoint failed: %s", e)

    def _check_store(self, stored: StoreMetadata, where: str) -> None:
        problems = stored.differences(self._metadata)
        if problems:
            raise SpecMismatchError(
                f"{where} does not match the configured table: " + "; ".join(problems)
            )

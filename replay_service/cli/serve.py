"""replay-server: a standalone Reverb buffer server, and `replay-server status`.

Serve (restoring the newest checkpoint):
  replay-server --config=configs/default.toml --restore
Restore if there is a checkpoint, else start empty (supervised servers, containers):
  replay-server --config=configs/default.toml --restore_if_exists
Serve a new, empty buffer (refuses a directory with checkpoints unless --overwrite):
  replay-server --config=configs/default.toml --port=8000 --checkpoint_dir=/data/replay
Inspect a running server:
  replay-server status --address=localhost:8000 [--checkpoint_dir=/data/replay]

SIGTERM and SIGINT stop the server from confirming writes, then take a final checkpoint that
holds every confirmed item, and exit 0; if that checkpoint fails the exit status is 1. Repeated
signals are ignored while it runs. Reverb's gRPC listens on all interfaces WITHOUT
authentication: keep the port on a trusted network.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from absl import app, flags, logging

from replay_service.cli.parsing import flags_parser, show_flags_in_help, usage_error
from replay_service.cli.stack import require_reverb_imports
from replay_service.config.files import ServiceConfig, load_config
from replay_service.errors import ConfigError, ReplayServiceError, ServerUnavailableError

_CONFIG = flags.DEFINE_string("config", None, "TOML config file (see configs/). Default: built-in.")
_PORT = flags.DEFINE_integer("port", None, "Port to listen on; overrides server.port.")
_CHECKPOINT_DIR = flags.DEFINE_string(
    "checkpoint_dir", None, "Checkpoint directory; overrides server.checkpoint_dir."
)
_INTERVAL = flags.DEFINE_float(
    "checkpoint_interval_s", None, "Seconds between checkpoints (0: only on stop)."
)
_KEEP = flags.DEFINE_integer("keep_checkpoints", None, "Complete checkpoints to retain.")
_RESTORE = flags.DEFINE_boolean(
    "restore", False, "Restore the newest complete checkpoint of the checkpoint directory."
)
_RESTORE_IF_EXISTS = flags.DEFINE_boolean(
    "restore_if_exists",
    False,
    "Restore when the checkpoint directory holds a checkpoint, else start empty (for supervised "
    "servers and containers that restart).",
)
_OVERWRITE = flags.DEFINE_boolean(
    "overwrite", False, "Without --restore: delete existing checkpoints instead of refusing."
)
_ADDRESS = flags.DEFINE_string("address", None, "status: host:port of the server to inspect.")
_TIMEOUT = flags.DEFINE_float("timeout", 10.0, "status: seconds to wait for the server.")
# Stats: `status --json`.
_JSON = flags.DEFINE_boolean(
    "json",
    False,
    "status: print stats as JSON (sizes, inserts/s, samples/s, rate limiter blocking, last "
    "checkpoint) instead of text.",
)
_RATE_SPAN = flags.DEFINE_float(
    "rate_span_s", 1.0, "status --json: seconds between the two readings that give the rates."
)
# Stats: TensorBoard scalars and Prometheus metrics of the running server.
_TENSORBOARD_DIR = flags.DEFINE_string(
    "tensorboard_dir",
    None,
    "Write the server's stats as TensorBoard scalars into this directory (see "
    "docs/operations.md, Stats).",
)
_SUMMARY_INTERVAL = flags.DEFINE_float(
    "summary_interval_s", 30.0, "Seconds between TensorBoard stats writes."
)
_METRICS_PORT = flags.DEFINE_integer(
    "metrics_port",
    None,
    "Serve Prometheus metrics of the server's stats on this port (needs the 'metrics' extra).",
)
_METRICS_ADDRESS = flags.DEFINE_string(
    "metrics_address",
    "127.0.0.1",
    "Interface the metrics endpoint binds; it has no authentication (0.0.0.0: every interface).",
)
# How often the main thread looks at the stop flag.
_POLL_S = 0.2


class _StopFlag:
    """Set by SIGTERM/SIGINT. The handler only sets an attribute: no lock, no logging, so a
    second signal while the first is handled (e.g. `timeout` signalling the process group)
    cannot deadlock."""

    def __init__(self) -> None:
        self.signals = 0

    def __call__(self, signum: int, _: Any) -> None:
        self.signals += 1
        if self.signals > 1:
            os.write(2, b"replay-server: already stopping (final checkpoint in progress)\n")


class _LateStats:
    """The stats reader of the metrics endpoint, which starts before the server it reports on.

    Binding the metrics port first makes a taken port or a bad address fail before the server
    touches the checkpoint directory (with --overwrite: deletes its checkpoints). Until `read`
    is set, a scrape reports `replay_up 0`.
    """

    def __init__(self) -> None:
        self.read: Callable[[], Any] | None = None

    def __call__(self) -> Any:
        if self.read is None:
            raise ServerUnavailableError("replay-server is still starting")
        return self.read()


def _check_exporter_flags() -> None:
    """Refuses bad stats-exporter flags, writing nothing.

    Raises:
      ConfigError: If --summary_interval_s is not a positive number of seconds, or
        --tensorboard_dir is not (and cannot be created as) a writable directory.
    """
    from replay_service.config.options import require_number
    from replay_service.monitoring.summaries import check_logdir

    require_number("--summary_interval_s", _SUMMARY_INTERVAL.value, 0, positive=True)
    if _TENSORBOARD_DIR.value:
        check_logdir(_TENSORBOARD_DIR.value, "--tensorboard_dir")


def _serve() -> int:
    config = load_config(
        _CONFIG.value,
        server__port=_PORT.value,
        server__checkpoint_dir=_CHECKPOINT_DIR.value,
        server__checkpoint_interval_s=_INTERVAL.value,
        server__keep_checkpoints=_KEEP.value,
    )
    restore = True if _RESTORE.value else (None if _RESTORE_IF_EXISTS.value else False)
    # Every flag is checked, and the metrics port bound, before the checkpoint directory is
    # touched: a bad flag must not cost the checkpoints that --overwrite deletes. What needs no
    # Reverb is refused before TensorFlow loads, in a fraction of a second.
    _check_exporter_flags()
    if _METRICS_PORT.value is not None and _METRICS_PORT.value == config.server.port:
        raise ConfigError(
            f"--metrics_port={_METRICS_PORT.value} is the server's port too; choose another "
            "--metrics_port"
        )
    stats = _LateStats()
    metrics = _start_metrics(stats)
    try:
        _check_before_imports(config, restore)
        require_reverb_imports("replay-server")
        from replay_service.backends.reverb.server import serve_config
        from replay_service.starter.envs import load_env

        data_spec = config.data_spec.build(load_env)
    except BaseException:
        if metrics is not None:
            metrics.close()
        raise
    stop = _StopFlag()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        server = serve_config(config, data_spec, restore=restore, overwrite=_OVERWRITE.value)
    except BaseException:
        if metrics is not None:
            metrics.close()
        raise
    restored = server.restored_from
    logging.warning(
        "replay-server: %s listening on port %d (all interfaces, no authentication); "
        "checkpoints in %s; %s",
        ", ".join(
            [
                f"table {t.name!r} (capacity {t.capacity}, sequence_length {t.sequence_length})"
                for t in config.tables
            ]
            + [f"variable table {v.name!r}" for v in config.variable_tables]
        ),
        server.port,
        config.server.checkpoint_dir,
        f"restored {restored.path}" if restored else "started empty",
    )
    exporters = _start_exporters(server, stats, metrics)
    print(f"replay-server listening on port {server.port}", flush=True)
    if metrics is not None:
        print(
            f"replay-server metrics on http://{_METRICS_ADDRESS.value}:{_METRICS_PORT.value}"
            "/metrics",
            flush=True,
        )
    try:
        while not stop.signals:
            time.sleep(_POLL_S)
        for close in reversed(exporters):
            close()
        print("replay-server: stopping: no more writes are confirmed; final checkpoint", flush=True)
        try:
            final = server.stop(final_checkpoint=True)
        except ReplayServiceError as e:
            print(
                f"replay-server: error: final checkpoint failed: {e}", file=sys.stderr, flush=True
            )
            return 1
        print(
            f"replay-server stopped; final checkpoint {final.path if final else 'none'}",
            flush=True,
        )
        return 0
    finally:
        _ignore_stop_signals()


def _check_before_imports(config: ServiceConfig, restore: bool | None) -> None:
    """Refuses, before the Reverb stack loads, what `serve_config` would refuse without it: a
    busy --port; for a new buffer, a checkpoint directory that holds checkpoints (without
    --overwrite) or that is not replay_service's; for a restore, one that holds no store.
    `serve_config` checks them again.

    Args:
      config: The server's config.
      restore: As `serve_config`'s.

    Raises:
      PortInUseError: If the port is taken.
      CheckpointExistsError, CheckpointError: As `CheckpointStore.check_new`.
      NoCheckpointError, CheckpointError: As `CheckpointStore.read_metadata`.
    """
    from replay_service.backends.reverb.connection import check_port_free
    from replay_service.storage.store import CheckpointStore

    if config.server.port is not None:
        check_port_free(config.server.port)
    store = CheckpointStore(config.server.checkpoint_dir, keep=config.server.keep_checkpoints)
    if restore is False or (restore is None and not store.has_checkpoints()):
        store.check_new(_OVERWRITE.value)
    else:  # a directory that is missing, empty, foreign or not one: refused as a restore does
        store.read_metadata()


def _ignore_stop_signals() -> None:
    """Makes the kernel drop SIGTERM and SIGINT for the rest of the process's life.

    After `main` returns, the interpreter's shutdown (TensorFlow's and Reverb's teardown) takes
    a while, and Python puts the default action back in place of a Python handler while it
    finalizes: a signal then killed the process with 143 after its final checkpoint. An
    ignored signal stays ignored.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start_metrics(stats: _LateStats) -> Any:
    """Serves --metrics_port (when given) with `stats`; returns the endpoint or None.

    Raises:
      ConfigError: If the port is out of range or prometheus-client is missing.
      PortInUseError: If the port is taken.
      ServerError: If the address cannot be bound.
    """
    if _METRICS_PORT.value is None:
        return None
    from replay_service.monitoring.metrics import start_metrics_server

    return start_metrics_server(stats, _METRICS_PORT.value, _METRICS_ADDRESS.value)


def _start_exporters(server: Any, stats: _LateStats, metrics: Any) -> list[Any]:
    """Points the metrics endpoint at the server and starts the TensorBoard writer.

    Args:
      server: The running server.
      stats: The metrics endpoint's reader, pointed at the server's stats here.
      metrics: The metrics endpoint already started (`_start_metrics`), or None.

    Returns:
      Close functions, in the order the exporters started (the metrics endpoint first).

    Raises:
      ReplayServiceError: If an exporter cannot start; the exporters and the server are
        stopped first.
    """
    from replay_service.monitoring.stats import StatsTracker, checkpoint_stats

    closers: list[Any] = [] if metrics is None else [metrics.close]
    try:
        tracker = StatsTracker(server.client, timeout=_TIMEOUT.value)
        tracker.read(wait_for_rates=False)  # the start of the first rate window

        def read_stats() -> Any:
            return tracker.read(
                checkpoint_stats(server.last_checkpoint, server.last_checkpoint_duration_s)
            )

        stats.read = read_stats
        if _TENSORBOARD_DIR.value:
            from replay_service.monitoring.summaries import StatsSummaryWriter

            writer = StatsSummaryWriter(
                read_stats, _TENSORBOARD_DIR.value, interval_s=_SUMMARY_INTERVAL.value
            )
            writer.start()
            closers.append(writer.close)
    except BaseException:
        for close in reversed(closers):
            close()
        server.stop()
        raise
    return closers


def _status() -> int:
    from replay_service.monitoring.report import format_status, server_status

    if not _ADDRESS.value:
        raise usage_error("replay-server", "status needs --address=host:port")
    require_reverb_imports("replay-server")
    if _JSON.value:
        return _status_json(_ADDRESS.value)
    tables = server_status(_ADDRESS.value, _TIMEOUT.value)
    print(format_status(_ADDRESS.value, tables, _CHECKPOINT_DIR.value))
    return 0


def _status_json(address: str) -> int:
    import json

    from replay_service.monitoring.stats import checkpoint_stats, server_stats
    from replay_service.storage.store import CheckpointStore

    checkpoint = None
    if _CHECKPOINT_DIR.value:
        checkpoint = checkpoint_stats(CheckpointStore(_CHECKPOINT_DIR.value).latest())
    stats = server_stats(address, _TIMEOUT.value, span_s=_RATE_SPAN.value, checkpoint=checkpoint)
    print(json.dumps(stats.to_json(), indent=2, sort_keys=True))
    return 0


def main(argv: list[str]) -> int:
    """Serves, or with the `status` command reports on a running server."""
    if not flags.FLAGS["verbosity"].present:  # absl INFO lines only when asked for
        logging.set_verbosity(logging.WARNING)
    command = argv[1:]
    if command not in ([], ["status"]):
        raise usage_error(
            "replay-server", f"unknown command {' '.join(command)!r}; use no command or 'status'"
        )
    try:
        return _status() if command == ["status"] else _serve()
    except ReplayServiceError as e:
        raise usage_error("replay-server", str(e)) from None


def run() -> None:
    """Console-script entry point."""
    show_flags_in_help(__doc__, _CONFIG)
    app.run(main, flags_parser=flags_parser("replay-server"))


if __name__ == "__main__":
    run()

"""Starting and reaching Reverb servers, with every wait bounded."""

from __future__ import annotations

import errno
import logging
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import reverb

from replay_service.checkpoints import Checkpoint, CheckpointStore, StoreMetadata, remove_path
from replay_service.errors import (
    CheckpointError,
    ConfigError,
    NoCheckpointError,
    PortInUseError,
    ServerError,
    ServerUnavailableError,
)
from replay_service.restore import restore_view

_T = TypeVar("_T")
_log = logging.getLogger(__name__)


def check_port_free(port: int) -> None:
    """Raises `PortInUseError` if something already listens on `port`.

    gRPC binds with SO_REUSEPORT, so a second Reverb server on a busy port starts without error
    and shares the port; this check binds without that option first to catch it.

    Raises:
      ConfigError: If `port` is not in 1..65535.
      PortInUseError: If the port is taken.
    """
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ConfigError(f"port must be an integer in 1..65535, got {port!r}")
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
                return
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise PortInUseError(
                        f"port {port} is already in use; choose another port or omit it to "
                        "pick a free one"
                    ) from None
                if e.errno != errno.EAFNOSUPPORT:
                    raise ServerError(f"cannot bind port {port}: {e}") from e


def pick_free_port() -> int:
    """Returns a port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def start_server(
    tables: Sequence[reverb.Table],
    store: CheckpointStore,
    port: int | None = None,
    restore: Checkpoint | None = None,
) -> reverb.Server:
    """Starts an in-process Reverb server that checkpoints into `store`.

    Args:
      tables: Tables to serve.
      store: Checkpoint directory; Reverb writes into its `.reverb/` root, which must hold no
        complete checkpoint (see `CheckpointStore.clean_staging`).
      port: Port to listen on (all interfaces); None picks a free one.
      restore: Checkpoint to load at start; None starts empty. Its tables take the options
        of `tables` (sampler, remover, rate limiter) with rebased limiter counters; items,
        priorities and capacity are restored as stored (see `restore.py`).

    Returns:
      The running server.

    Raises:
      PortInUseError: If `port` is taken.
      CheckpointError: If `restore` cannot be loaded (e.g. it is corrupt).
      ServerError: If the server fails to start for another reason.
    """
    if port is None:
        port = pick_free_port()
    check_port_free(port)
    view = restore_view(restore.path, tables, store.restore_dir) if restore else None
    checkpointer = reverb.checkpointers.DefaultCheckpointer(
        store.reverb_root, fallback_checkpoint_path=view
    )
    try:
        server = reverb.Server(list(tables), port=port, checkpointer=checkpointer)
    except (RuntimeError, ValueError) as e:
        if restore is not None:
            raise CheckpointError(f"cannot restore checkpoint {restore.path!r}: {e}") from e
        raise ServerError(f"cannot start a Reverb server on port {port}: {e}") from e
    finally:
        if view is not None:
            remove_path(view)
    _log.info("Reverb server listening on port %d (all interfaces)", port)
    return server


def start_from_latest(
    tables: Sequence[reverb.Table],
    store: CheckpointStore,
    port: int | None,
    check: Callable[[Checkpoint], None],
) -> tuple[reverb.Server, Checkpoint]:
    """Starts a server restored from the newest checkpoint that loads.

    A checkpoint that Reverb cannot load (corrupt files despite `DONE`) is moved to
    `<checkpoint_dir>/corrupt/` with a warning and the previous one is tried, so a bad
    checkpoint cannot make a supervised server crash-loop.

    Args:
      tables: Tables to serve; a restored checkpoint takes their options (see `start_server`).
      store: The checkpoint directory.
      port: Port to listen on; None picks one.
      check: Called with each candidate before it is loaded; raises to refuse it (e.g. a
        spec mismatch), which stops the search.

    Returns:
      The running server and the checkpoint it restored.

    Raises:
      NoCheckpointError: If no checkpoint (or none that loads) is left.
      PortInUseError: If `port` is taken.
    """
    while (latest := store.latest()) is not None:
        check(latest)
        try:
            return start_server(tables, store, port, restore=latest), latest
        except CheckpointError as e:
            moved = store.quarantine(latest)
            _log.warning("checkpoint %s does not load (%s); moved it to %s", latest.path, e, moved)
    raise NoCheckpointError(
        f"checkpoint_dir {store.root!r} holds no complete checkpoint that loads; start a new "
        "buffer (create_replay_buffer(overwrite=True), or replay-server --overwrite)"
    )


def take_checkpoint(
    client: reverb.Client,
    store: CheckpointStore,
    metadata: StoreMetadata,
    timeout: float | None,
) -> Checkpoint:
    """Checkpoints the server behind `client` into `store` and returns the complete checkpoint.

    Raises:
      CheckpointError: If Reverb fails or takes longer than `timeout` seconds.
    """
    store.clean_staging(metadata)
    try:
        path = call_with_timeout(client.checkpoint, timeout, "checkpoint")
    except (TimeoutError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint of {client.server_address!r} failed: {e}") from e
    return store.adopt(path, metadata)


def server_info(client: reverb.Client, timeout: float | None) -> dict[str, Any]:
    """`client.server_info()` bounded by `timeout` seconds (Reverb takes whole seconds).

    Raises:
      ServerUnavailableError: If the server does not answer in time.
    """
    try:
        return client.server_info(timeout=max(1, round(timeout)) if timeout else None)
    except Exception as e:  # Reverb raises RuntimeError or DeadlineExceededError.
        raise ServerUnavailableError(
            f"no Reverb server answered at {client.server_address!r} within {timeout} s ({e}); "
            "is the server running and the port reachable?"
        ) from e


def connect(address: str, timeout: float | None) -> reverb.Client:
    """Returns a client after the server at `address` has answered.

    Args:
      address: "host:port" of a running Reverb server.
      timeout: Seconds to wait for its first answer.

    Raises:
      ConfigError: If `address` is not "host:port".
      ServerUnavailableError: If no server answers within `timeout`.
    """
    host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not host or not port.isdigit():
        raise ConfigError(f"server_address must look like 'host:port', got {address!r}")
    client = reverb.Client(address)
    server_info(client, timeout)
    return client


def call_with_timeout(fn: Callable[[], _T], timeout: float | None, what: str) -> _T:
    """Runs a blocking call that has no timeout of its own, waiting at most `timeout` seconds.

    On timeout the call keeps running in a daemon thread; its result is discarded.

    Raises:
      TimeoutError: If `fn` does not return in time.
      Exception: Whatever `fn` raised.
    """
    result: list[_T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # re-raised in the caller's thread
            error.append(e)

    thread = threading.Thread(target=target, name=f"replay_service:{what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not finish within {timeout} s")
    if error:
        raise error[0]
    return result[0]

"""Where items live: one package per backend, behind one interface (`base.Backend`).

`reverb/`: a Reverb server, embedded in this process or reached by address.
`local/`: tables in this process, for platforms without Reverb (no TensorFlow).

`backend_class` picks the implementation for a manager's `backend=` and `server_address`; it
imports only the module it returns, so the local backend never imports Reverb or TensorFlow.
Importing this package registers every backend's checkpoint files (`storage.checkpoint_format`),
which the checkpoint store verifies and names checkpoints by, local first; neither format imports
Reverb or TensorFlow.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Mapping
from typing import Any

from replay_service.backends.base import Backend, BackendOptions, Capability
from replay_service.backends.local.checkpoint import CHECKPOINT_FORMAT as LOCAL_FORMAT
from replay_service.backends.reverb.internals import CHECKPOINT_FORMAT as REVERB_FORMAT
from replay_service.errors import ConfigError
from replay_service.storage import checkpoint_format

__all__ = [
    "BACKENDS",
    "Backend",
    "BackendOptions",
    "Capability",
    "backend_class",
    "choose_backend",
    "resolve_auto",
    "resolve_auto_layout",
    "reverb_importable",
]

BACKENDS = ("auto", "reverb", "local")
# The implementation of each resolved kind, by mode: (module, class).
_IMPLEMENTATIONS = {
    ("reverb", "embedded"): ("replay_service.backends.reverb.embedded", "EmbeddedBackend"),
    ("reverb", "remote"): ("replay_service.backends.reverb.remote", "RemoteBackend"),
    ("local", "embedded"): ("replay_service.backends.local.backend", "LocalBackend"),
}
# What `backend="auto"` chose in this process, said once.
_announced: set[str] = set()

_log = logging.getLogger(__name__)

checkpoint_format.register(LOCAL_FORMAT)
checkpoint_format.register(REVERB_FORMAT)


def reverb_importable() -> tuple[bool, str]:
    """Whether dm-reverb, TensorFlow and TF-Agents import here; else why not.

    Returns:
      `(True, "")`, or `(False, the import error)`.
    """
    try:
        import reverb  # noqa: F401
        import tensorflow  # noqa: F401
        import tf_agents  # noqa: F401
    except ImportError as e:
        return False, f"{type(e).__name__}: {e}"
    return True, ""


def choose_backend(backend: str, server_address: str | None = None) -> str:
    """Resolves `backend` ("auto", "reverb" or "local") to "reverb" or "local".

    "auto" is Reverb when dm-reverb, TensorFlow and TF-Agents import, else local; the choice is
    logged once per process.

    Raises:
      ConfigError: If `backend` is unknown, "reverb" is asked for where it does not import, or
        `server_address` (remote mode, Reverb-only) is given with the local backend.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "local":
        if server_address is not None:
            raise ConfigError(
                f"server_address={server_address!r}: remote mode needs backend='reverb'; the "
                "local backend keeps its tables in this process"
            )
        return "local"
    ok, why = reverb_importable()
    if backend == "reverb" or server_address is not None:
        if not ok:
            raise ConfigError(
                "backend='reverb' (and remote mode) need dm-reverb 0.13, TensorFlow 2.14 and "
                f"TF-Agents 0.18, which do not import here ({why}); dm-reverb has wheels only "
                "for Linux x86_64 and Python <= 3.11. Use backend='local' elsewhere"
            )
        return "reverb"
    chosen = "reverb" if ok else "local"
    if chosen not in _announced:
        _announced.add(chosen)
        if ok:
            _log.info("backend='auto': using Reverb")
        else:
            _log.warning(
                "backend='auto': dm-reverb does not import (%s); using the local backend", why
            )
    return chosen


def resolve_auto(
    backend: str,
    *,
    checkpoint_dir: str | os.PathLike[str] | None,
    server_address: str | None = None,
    single_process: bool = False,
    options: Mapping[str, Any] | None = None,
) -> str:
    """What `backend="auto"` means for a manager, before `choose_backend` resolves the rest.

    An existing buffer restores on the backend that wrote it: "auto" follows the newest
    checkpoint in `checkpoint_dir` (a local one is read by the local backend, a Reverb one by
    Reverb where it imports). A new buffer gets the entry point's default: `from_spaces`
    (`single_process`, the one-process PyTorch door) the local backend, whose tables live in
    the process with no server, gRPC or tf.data threads competing with torch's for the cores
    (a CleanRL-style DQN runs about as fast as with a numpy ring buffer, where an embedded
    Reverb server costs 1.5-4x on a small machine), unless `options` set one the local backend
    does not take (`Backend.refused_options`: `port`, `layout="packed"`);
    `ReplayBufferManager(data_spec, ...)`, the TF-Agents door, Reverb where it imports.

    Args:
      backend: The `backend=` argument; anything but "auto" is returned unchanged, and so is
        "auto" with a `server_address` (remote mode is Reverb's).
      checkpoint_dir: The checkpoint directory, only read (its newest checkpoint's backend).
      server_address: The remote server's address, or None.
      single_process: Whether the entry point is the single-process door (`from_spaces`).
      options: The caller's other manager options, by name (only read).

    Returns:
      "local", "reverb", or "auto" (for `choose_backend`: Reverb where it imports).
    """
    if backend != "auto" or server_address is not None:
        return backend
    written_by = _newest_checkpoint_backend(checkpoint_dir)
    if written_by == "local":
        return "local"
    if written_by == "reverb" or not single_process:
        return "auto"
    return "auto" if backend_class("local").refused_options(options or {}) else "local"


def resolve_auto_layout(
    layout: str,
    *,
    kind: str,
    checkpoint_dir: str | os.PathLike[str] | None,
    server_address: str | None,
) -> str:
    """What `layout="auto"` (the manager's default) means, before any server is contacted.

    A local backend has its own storage: "nested". A remote server's tables already have a
    layout, which the backend takes once it connects (`BackendOptions.layout_from_server`): "nested"
    until then. An embedded Reverb server keeps the layout the directory's store recorded
    (an old nested buffer stays nested), and a new buffer gets "packed": one `uint8` row per
    step, several times less server memory and faster inserts and sampling, which every
    reader unpacks, and TF-Agents' own observers write through `py_client` (a
    `PackingClient`).

    Args:
      layout: The `layout=` argument: "auto", "nested" or "packed" (the last two are
        returned unchanged).
      kind: The backend's kind, "reverb" or "local".
      checkpoint_dir: The checkpoint directory, only read.
      server_address: The remote server's address, or None.

    Returns:
      "nested" or "packed".

    Raises:
      ConfigError: If `layout` is none of those names.
    """
    from replay_service.specs.layouts import AUTO, LAYOUTS, NESTED, PACKED

    if layout not in (AUTO, *LAYOUTS) or not isinstance(layout, str):
        raise ConfigError(f"layout must be one of {[AUTO, *LAYOUTS]}, got {layout!r}")
    if layout != AUTO:
        return layout
    if kind != "reverb" or server_address is not None:
        return NESTED
    if checkpoint_dir is not None:
        from replay_service.storage.store import CheckpointStore

        try:
            stored = CheckpointStore(checkpoint_dir).stored_layout()
        except Exception:  # the manager's own load reports an unusable directory
            stored = None
        if stored is not None:
            return stored
    return PACKED


def _newest_checkpoint_backend(checkpoint_dir: str | os.PathLike[str] | None) -> str | None:
    """The backend that wrote `checkpoint_dir`'s newest checkpoint; None when there is none or
    it cannot be read (the load that follows names what is wrong with the directory)."""
    if checkpoint_dir is None:
        return None
    from replay_service.storage.store import CheckpointStore

    try:
        latest = CheckpointStore(checkpoint_dir).latest()
    except Exception:  # the manager's own load reports a damaged directory
        return None
    return None if latest is None else latest.backend


def backend_class(backend: str, server_address: str | None = None) -> type[Backend]:
    """The `Backend` implementation for a manager's `backend=` and `server_address`.

    Args:
      backend: "auto", "reverb" or "local" (see `choose_backend`).
      server_address: "host:port" of a running server (remote mode), or None.

    Returns:
      The class (imported now, and only it).

    Raises:
      ConfigError: As `choose_backend`.
    """
    kind = choose_backend(backend, server_address)
    mode = "embedded" if server_address is None else "remote"
    module, name = _IMPLEMENTATIONS[(kind, mode)]
    cls: type[Backend] = getattr(importlib.import_module(module), name)
    return cls

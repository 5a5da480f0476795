"""Where items live: one package per backend, behind one interface (`base.Backend`).

`reverb/`: a Reverb server, embedded in this process or reached by address.
`local/`: tables in this process, for platforms without Reverb (no TensorFlow).

`backend_class` picks the implementation for a manager's `backend=` and `server_address`; it
imports only the module it returns, so the local backend never imports Reverb or TensorFlow.
"""

from __future__ import annotations

import importlib
import logging

from replay_service.backends.base import Backend, BackendOptions, Capability
from replay_service.errors import ConfigError

__all__ = [
    "BACKENDS",
    "Backend",
    "BackendOptions",
    "Capability",
    "backend_class",
    "choose_backend",
    "reverb_importable",
]

BACKENDS = ("auto", "reverb", "local")
# The implementation of each resolved kind, by mode: (module, class).
_IMPLEMENTATIONS = {
    ("reverb", "embedded"): ("replay_service.backends.reverb.backend", "EmbeddedBackend"),
    ("reverb", "remote"): ("replay_service.backends.reverb.backend", "RemoteBackend"),
    ("local", "embedded"): ("replay_service.backends.local.backend", "LocalBackend"),
}
# What `backend="auto"` chose in this process, said once.
_announced: set[str] = set()

_log = logging.getLogger(__name__)


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

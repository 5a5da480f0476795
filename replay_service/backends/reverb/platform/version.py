"""The Reverb releases whose private formats and behaviour this package was verified on."""

from __future__ import annotations

import importlib.metadata

from replay_service.errors import ServerError

# The Reverb releases whose checkpoint layout, table protos and server sockets this module was
# verified against.
SUPPORTED_REVERB = ("0.13.", "0.14.")


def require_supported_reverb() -> None:
    """Raises `ServerError` if the installed dm-reverb is not one this module was verified on."""
    try:
        version = importlib.metadata.version("dm-reverb")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    if not version.startswith(SUPPORTED_REVERB):
        raise ServerError(
            f"dm-reverb {version} is installed, but replay_service reads Reverb checkpoints and "
            f"server sockets as dm-reverb {' / '.join(v + 'x' for v in SUPPORTED_REVERB)} "
            "write them; install dm-reverb==0.13.0"
        )

"""Reverb's saves and the cleanup that follows them: when a checkpoint may be moved, and races.

After `DONE`, a save lists the root and deletes every older entry (it keeps only the newest): a
directory moved away in that moment makes the save fail with "<path> not found", and two saves at
once can delete each other's directory. The store therefore waits `SAVE_SETTLE_S` after `DONE`
before a checkpoint that a client requested may be moved (`storage.files.is_settled`), and
`is_concurrent_save_error` recognizes the failure so that a client can ask again
(`retry_concurrent_save`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

_log = logging.getLogger(__name__)

# Seconds after `DONE` until a save that a client requested is surely past its cleanup (a listing
# and deletes that take milliseconds; seconds on a machine stalled by load).
SAVE_SETTLE_S = 2.0


def retry_concurrent_save(save: Callable[[], str]) -> str:
    """Runs `save` (a `Client.checkpoint()` call) and, if it lost a race with another save or an
    adoption (`is_concurrent_save_error`), runs it once more.

    Returns:
      What `save` returned: where Reverb wrote the checkpoint.

    Raises:
      Whatever the last call raised.
    """
    try:
        return save()
    except RuntimeError as e:
        if not is_concurrent_save_error(e):
            raise
        _log.warning("checkpoint raced with another save (%s); asking again", e)
        return save()


def is_concurrent_save_error(error: BaseException) -> bool:
    """Whether a failed `Client.checkpoint()` lost a race with another save or an adoption: a
    directory of the root vanished between Reverb listing it and deleting it. Asking again
    succeeds unless it races again."""
    return isinstance(error, RuntimeError) and str(error).rstrip().endswith(" not found")

"""Reverb's writers: a destructor that waits without a timeout for its pending items."""

from __future__ import annotations

import ctypes
from typing import Any


def abandon_writer(writer: Any) -> None:
    """Keeps a Reverb writer alive until the process exits, so its destructor never runs.

    Reverb's writer destructor waits, without a timeout, until every pending item is confirmed
    (reverb#4, #144); when the server died (or restarted on the same port) that wait never ends
    and whatever drops the last reference hangs. A writer that failed to flush within the write
    timeout is therefore leaked on purpose: its pending items are lost either way. A writer
    that keeps a `_closed` mark (the packed writers, Reverb's legacy `Writer`) is marked
    closed, so nothing waits for those items again (the packed writers' flush at exit).
    """
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(writer))
    if hasattr(writer, "_closed"):
        writer._closed = True

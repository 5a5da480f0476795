"""`BufferLifecycle`: where a manager's buffer is (none yet, open, closed), checked by every call.

`ReplayBufferManager` asks it first in each call: `client()` and `replay_buffer()` raise before
`create_replay_buffer`/`load_replay_buffer` and after `close()`, `require_none()` once a buffer
is open. `close()` stops the replay buffer's streams and the backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from replay_service.backends.base import Backend
from replay_service.errors import BufferStateError, ManagerClosedError


class BufferLifecycle:
    """The client and replay buffer a backend opened for one manager, and whether it is closed.

    Args:
      backend: The manager's backend.
    """

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self.closed = False
        self._client: Any = None
        self._users_client: Any = None
        self._replay_buffer: Any = None

    def open(self, client: Any, clear: Callable[[], None]) -> Any:
        """Opens the replay buffer behind `client` (what `Backend.create`/`load` returned) and
        returns it (`Backend.open_buffer`, given the manager's `clear`).

        Raises:
          SpecMismatchError: If a table does not hold what the buffer stores.
        """
        self._replay_buffer = self._backend.open_buffer(client, clear)
        self._client = client
        return self._replay_buffer

    def require_none(self) -> None:
        """Refuses a second buffer.

        Raises:
          ManagerClosedError: If the manager is closed.
          BufferStateError: If a buffer was created or loaded.
        """
        self._check_open()
        if self._client is not None:
            raise BufferStateError(
                "this manager already has a buffer; use get_replay_buffer_and_observer(), "
                "clear() to empty it, or close() and a new manager to start another"
            )

    def client(self) -> Any:
        """The client `Backend.create`/`load` returned.

        Raises:
          ManagerClosedError: If the manager is closed.
          BufferStateError: If no buffer was created or loaded.
        """
        self._check_open()
        if self._client is None:
            raise BufferStateError(
                "no buffer yet: call create_replay_buffer() or load_replay_buffer() first"
            )
        return self._client

    def users_client(self) -> Any:
        """The client handed to users (`Backend.users_client`), made once.

        Raises:
          ManagerClosedError, BufferStateError: As `client`.
        """
        client = self.client()
        if self._users_client is None:
            self._users_client = self._backend.users_client(client)
        return self._users_client

    def replay_buffer(self) -> Any:
        """The replay buffer `open` returned.

        Raises:
          ManagerClosedError, BufferStateError: As `client`.
        """
        self.client()
        assert self._replay_buffer is not None
        return self._replay_buffer

    def close(self) -> None:
        """Stops the replay buffer's datasets and streams (they fail instead of blocking), then
        the backend, and forgets the client and the buffer; `closed` is set already."""
        if self._replay_buffer is not None:
            self._replay_buffer.stop_sampling()
        self._backend.close()
        self._client = self._users_client = self._replay_buffer = None

    def _check_open(self) -> None:
        if self.closed:
            raise ManagerClosedError("this ReplayBufferManager is closed; create a new one")

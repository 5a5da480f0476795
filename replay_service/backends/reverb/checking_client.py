"""`CheckingClient`: the `reverb.Client` a Reverb buffer hands its users, whose
`mutate_priorities` checks a whole batch before the server applies any of it.

Reverb 0.13's `Client.mutate_priorities` applies updates key by key: a NaN or negative priority
raises `ValueError` only after the updates before it were applied and the bad value was stored
on its item (`info.priority` then reads NaN or the negative number), and +inf is accepted and
breaks the prioritized table's sampling (`info.probability` NaN, the other items never drawn
again). `ReplayBufferManager.py_client` is a `CheckingClient` (a `PackingClient` on a packed
buffer is one too), so a refused batch changes nothing, and both backends accept and refuse the
same updates (`replay_service.sample.priorities.check_updates`; the table in
docs/guide/sampling.md). Everything else is the plain client's.
"""

from __future__ import annotations

from typing import Any

import reverb

from replay_service.errors import ConfigError
from replay_service.sample.priorities import check_updates, describe_bad_priorities


def _reconnect(address: str) -> CheckingClient:
    return CheckingClient(reverb.Client(address))


class CheckingClient(reverb.Client):
    """A `reverb.Client` sharing `client`'s connection whose `mutate_priorities` checks first.

    Args:
      client: The plain client of the server.
    """

    def __init__(self, client: reverb.Client) -> None:
        # The connection and the signature cache are the plain client's (no second channel).
        self._server_address = client.server_address
        self._client = client._client
        self._signature_cache = client._signature_cache

    def __reduce__(self) -> Any:
        return _reconnect, (self._server_address,)

    def insert(self, data: Any, priorities: dict[str, float]) -> None:
        """Reverb's `insert`, with the priorities checked first (Reverb's blocks forever on a
        negative one and stores +inf).

        Raises:
          ConfigError: If a priority is NaN, infinite, negative or not a real number.
        """
        bad = describe_bad_priorities(priorities, label="table")
        if bad:
            raise ConfigError(f"priorities must be finite real numbers >= 0, got {bad}")
        super().insert(data, priorities)

    def mutate_priorities(
        self,
        table: str,
        updates: dict[int, float] | None = None,
        deletes: list[int] | None = None,
    ) -> None:
        """Reverb's `mutate_priorities`, with every update checked before any is sent.

        Args:
          table: Name of the table.
          updates: Item key -> new priority; keys not in the table are ignored.
          deletes: Keys of items to delete; keys not in the table are ignored.

        Raises:
          SpecMismatchError: If a key of `updates` is not an integer in [0, 2**64).
          ConfigError: If a priority is NaN, infinite, negative or not a real number.
        """
        super().mutate_priorities(table, updates=check_updates(updates), deletes=deletes)

"""Which servers hold a sharded buffer's shards: the `[sharding]` section of a TOML file."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from replay_service.config.files import read_toml
from replay_service.errors import (
    ConfigError,
)

SECTION = "sharding"
KNOWN_KEYS = frozenset({"addresses"})
MAX_PORT = 65535


def validate_address(address: object) -> str:
    """Checks one "host:port" server address.

    Args:
      address: The candidate, e.g. "localhost:8000", "10.0.0.7:8000" or "[::1]:8000".

    Returns:
      The address, unchanged.

    Raises:
      ConfigError: If it is not a string "host:port" with a port in 1..65535.
    """
    host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    ok = bool(host) and not any(c.isspace() for c in host) and port.isdigit()
    if not ok or not 0 < int(port) <= MAX_PORT:
        raise ConfigError(
            f"{SECTION}.addresses: {address!r} is not a server address 'host:port' with a port "
            f"in 1..{MAX_PORT}"
        )
    return address  # type: ignore[return-value]


def _normalized(address: str) -> str:
    host, _, port = address.rpartition(":")
    return f"{host.lower()}:{int(port)}"


@dataclasses.dataclass(frozen=True)
class ShardedConfig:
    """The servers of a sharded buffer, in shard order.

    Attributes:
      addresses: "host:port" of every shard's `replay-server`; at least one, no duplicates
        (compared case-insensitively, so "localhost:8000" twice is refused, but
        "localhost:8000" and "127.0.0.1:8000" cannot be told apart and are not). Collector
        `i` writes to shard `i % len(addresses)`: keep the order stable across restarts.
    """

    addresses: tuple[str, ...]

    def __post_init__(self) -> None:
        addresses = self.addresses
        if isinstance(addresses, str) or not isinstance(addresses, Sequence):
            raise ConfigError(
                f"{SECTION}.addresses must be a list of 'host:port' strings, got {addresses!r}"
            )
        if not addresses:
            raise ConfigError(f"{SECTION}.addresses must name at least one server, got []")
        seen: dict[str, int] = {}
        for index, address in enumerate(addresses):
            key = _normalized(validate_address(address))
            if key in seen:
                raise ConfigError(
                    f"{SECTION}.addresses lists {address!r} twice (shards {seen[key]} and "
                    f"{index}); every shard needs its own server"
                )
            seen[key] = index
        object.__setattr__(self, "addresses", tuple(addresses))

    @property
    def num_shards(self) -> int:
        """Number of shards."""
        return len(self.addresses)

    def shard_index(self, collector_id: int) -> int:
        """Returns the shard collector `collector_id` writes to: `collector_id % num_shards`.

        Raises:
          ConfigError: If `collector_id` is not an integer >= 0.
        """
        if not isinstance(collector_id, int) or isinstance(collector_id, bool) or collector_id < 0:
            raise ConfigError(f"collector_id must be an integer >= 0, got {collector_id!r}")
        return collector_id % self.num_shards

    def address_for(self, collector_id: int) -> str:
        """Returns the address of the shard collector `collector_id` writes to."""
        return self.addresses[self.shard_index(collector_id)]

    @classmethod
    def from_dict(cls, section: Mapping[str, Any], source: str = SECTION) -> ShardedConfig:
        """Builds a config from the contents of a `[sharding]` table.

        Args:
          section: The table, e.g. `{"addresses": ["localhost:8000", "localhost:8001"]}`.
          source: Where it came from, for error messages.

        Returns:
          The validated configuration.

        Raises:
          ConfigError: If a key is unknown or missing, or a value is invalid.
        """
        if not isinstance(section, Mapping):
            raise ConfigError(f"{source}: [{SECTION}] must be a table, got {section!r}")
        unknown = sorted(set(section) - KNOWN_KEYS)
        if unknown:
            raise ConfigError(
                f"{source}: unknown key {SECTION}.{unknown[0]!r} (value "
                f"{section[unknown[0]]!r}); known keys of {SECTION}: {sorted(KNOWN_KEYS)}"
            )
        if "addresses" not in section:
            raise ConfigError(f'{source}: [{SECTION}] needs addresses = ["host:port", ...]')
        addresses = section["addresses"]
        if not isinstance(addresses, list | tuple):
            raise ConfigError(
                f"{source}: {SECTION}.addresses must be a list of 'host:port' strings, got "
                f"{addresses!r}"
            )
        try:
            return cls(addresses=tuple(addresses))
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from e


def load_sharded_config(path: str | os.PathLike[str]) -> ShardedConfig:
    """Reads the `[sharding]` table of a TOML file (other tables are ignored).

    Args:
      path: A TOML file such as `configs/sharded.toml`.

    Returns:
      The validated configuration.

    Raises:
      ConfigError: If the file is missing or not TOML, has no `[sharding]` table, or the table
        has an unknown key or an invalid value (named with the file).
    """
    source = os.fspath(path)
    data = read_toml(source)
    if SECTION not in data:
        raise ConfigError(f"{source}: no [{SECTION}] table; tables found: {sorted(data)}")
    return ShardedConfig.from_dict(data[SECTION], source)

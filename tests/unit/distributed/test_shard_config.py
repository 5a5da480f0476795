"""`ShardedConfig`: the `[sharding]` addresses of a sharded buffer, checked one by one, and the
shard every collector writes to."""

from __future__ import annotations

from pathlib import Path

import pytest

from replay_service.distributed.shard_config import (
    ShardedConfig,
    load_sharded_config,
    validate_address,
)
from replay_service.errors import ConfigError


@pytest.mark.parametrize("address", ["localhost:8000", "10.0.0.7:1", "[::1]:65535"])
def test_a_host_and_port_address_is_returned_unchanged(address: str) -> None:
    assert validate_address(address) == address


@pytest.mark.parametrize(
    "address",
    ["localhost", ":8000", "localhost:0", "localhost:65536", "local host:80", "host:8o", 8000],
)
def test_an_address_without_host_or_valid_port_is_refused_naming_it(address: object) -> None:
    with pytest.raises(ConfigError, match=r"sharding\.addresses: .* 1\.\.65535") as error:
        validate_address(address)
    assert repr(address) in str(error.value)


def test_collectors_go_round_robin_over_the_shards_in_order() -> None:
    config = ShardedConfig(addresses=["a:1", "b:2", "c:3"])  # type: ignore[arg-type]
    assert config.addresses == ("a:1", "b:2", "c:3")
    assert config.num_shards == 3
    assert [config.shard_index(i) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert config.address_for(4) == "b:2"


@pytest.mark.parametrize("collector_id", [-1, 1.0, True, "0"])
def test_a_collector_id_that_is_not_an_integer_from_zero_is_refused(collector_id: object) -> None:
    config = ShardedConfig(addresses=("a:1",))
    with pytest.raises(ConfigError, match=rf"collector_id .* got {collector_id!r}"):
        config.shard_index(collector_id)  # type: ignore[arg-type]


def test_the_same_server_twice_is_refused_naming_both_shards() -> None:
    with pytest.raises(ConfigError, match=r"lists 'LocalHost:08000' twice \(shards 0 and 2\)"):
        ShardedConfig(addresses=("localhost:8000", "other:1", "LocalHost:08000"))


@pytest.mark.parametrize(
    ("addresses", "match"),
    [("a:1", "must be a list"), ((), "at least one server"), (("a:1", "a"), "'a' is not")],
)
def test_addresses_that_are_no_list_of_servers_are_refused(addresses: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ShardedConfig(addresses=addresses)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"addresses": ["a:1"], "port": 3}, r"src: unknown key sharding\.'port' \(value 3\)"),
        ({}, r"src: \[sharding\] needs addresses"),
        ({"addresses": "a:1"}, r"src: sharding\.addresses must be a list .* got 'a:1'"),
        ({"addresses": ["a:1", "a:99999"]}, r"^src: sharding\.addresses: 'a:99999'"),
        (["a:1"], r"src: \[sharding\] must be a table"),
    ],
)
def test_from_dict_names_the_source_and_the_bad_key_or_value(section: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ShardedConfig.from_dict(section, "src")  # type: ignore[arg-type]


def test_load_reads_the_sharding_table_and_ignores_the_others(tmp_path: Path) -> None:
    path = tmp_path / "sharded.toml"
    path.write_text('[table]\nname = "x"\n[sharding]\naddresses = ["h:1", "h:2"]\n')
    assert load_sharded_config(path) == ShardedConfig(addresses=("h:1", "h:2"))


def test_load_without_a_sharding_table_lists_the_tables_found(tmp_path: Path) -> None:
    path = tmp_path / "plain.toml"
    path.write_text("[table]\n[server]\n")
    with pytest.raises(ConfigError, match=rf"{path}: no \[sharding\] table.*\['server', 'table'\]"):
        load_sharded_config(path)

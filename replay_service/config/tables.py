"""Checks of a buffer's set of tables: extra and variable-length tables beside the primary one,
finding a table by name, and the weights of a mix of tables (pure, no backend)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from replay_service.config.options import TableConfig, VariableTableConfig
from replay_service.errors import ConfigError


def check_extra_tables(primary: TableConfig, extra: Sequence[Any]) -> tuple[TableConfig, ...]:
    """Validates the tables served next to `primary` on the same server.

    Args:
      primary: The manager's (or server's) main table.
      extra: Further tables; each a `TableConfig` with a name of its own.

    Returns:
      `extra` as a tuple.

    Raises:
      ConfigError: If `extra` is not a sequence, an entry is not a `TableConfig`, two tables
        (the primary included) share a name, or their padding differs (padded tables must also
        share one sequence length).
    """
    if isinstance(extra, str | bytes | TableConfig) or not isinstance(extra, Sequence):
        raise ConfigError(f"extra_tables must be a sequence of TableConfig, got {extra!r}")
    for index, config in enumerate(extra):
        if not isinstance(config, TableConfig):
            raise ConfigError(
                f"extra_tables[{index}] must be a TableConfig, got {type(config).__name__} "
                f"{config!r}"
            )
    names = [primary.name, *(c.name for c in extra)]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(
            f"table names must be unique on one server, got duplicates {duplicates} "
            f"(tables: {names})"
        )
    for config in extra:
        if config.layout != primary.layout:
            raise ConfigError(
                f"table {config.name!r} has layout={config.layout!r}, the primary table "
                f"{primary.name!r} {primary.layout!r}: one writer feeds every table, so they "
                "must all have one layout"
            )
        if config.pad_end_of_episode != primary.pad_end_of_episode:
            raise ConfigError(
                f"table {config.name!r} has pad_end_of_episode={config.pad_end_of_episode}, the "
                f"primary table {primary.name!r} {primary.pad_end_of_episode}: one writer feeds "
                "every table, so they must all be padded or none"
            )
        if config.pad_end_of_episode and config.sequence_length != primary.sequence_length:
            raise ConfigError(
                f"padded table {config.name!r} has sequence_length {config.sequence_length}, "
                f"the primary table {primary.name!r} {primary.sequence_length}: padded tables "
                "on one server must share one sequence length (the padding is written once)"
            )
    return tuple(extra)


def check_variable_tables(
    tables: Sequence[TableConfig], variable_tables: Sequence[Any]
) -> tuple[VariableTableConfig, ...]:
    """Validates the variable-container tables served next to `tables`.

    Args:
      tables: The replay tables of the server.
      variable_tables: Each a `VariableTableConfig` with a name of its own.

    Returns:
      `variable_tables` as a tuple.

    Raises:
      ConfigError: If `variable_tables` is not a sequence, an entry is not a
        `VariableTableConfig`, or a name is used twice (by any table of the server).
    """
    if isinstance(variable_tables, str | bytes | VariableTableConfig) or not isinstance(
        variable_tables, Sequence
    ):
        raise ConfigError(
            f"variable_tables must be a sequence of VariableTableConfig, got {variable_tables!r}"
        )
    for index, config in enumerate(variable_tables):
        if not isinstance(config, VariableTableConfig):
            raise ConfigError(
                f"variable_tables[{index}] must be a VariableTableConfig, got "
                f"{type(config).__name__} {config!r}"
            )
    replay = [t.name for t in tables]
    seen = set(replay)
    for config in variable_tables:
        if config.name in seen:
            kind = "replay" if config.name in replay else "variable"
            raise ConfigError(
                f"variable table name {config.name!r} is already the name of a {kind} table "
                f"(tables: {replay + [v.name for v in variable_tables]}); table names must be "
                "unique on one server"
            )
        seen.add(config.name)
    return tuple(variable_tables)


def find_table(tables: Sequence[TableConfig], name: str | None) -> TableConfig:
    """Returns the table called `name`; None means the first (primary) one.

    Raises:
      ConfigError: If no table has that name (the message lists the tables).
    """
    if name is None:
        return tables[0]
    for config in tables:
        if config.name == name:
            return config
    raise ConfigError(
        f"unknown table {name!r}; this buffer's tables are {[t.name for t in tables]}"
    )


def check_mix_weights(
    tables: Sequence[TableConfig], weights: Mapping[str, float]
) -> dict[str, float]:
    """Validates the weights of a mix of tables and returns them normalized to sum to 1.

    Args:
      tables: Every table of the buffer.
      weights: Table name -> weight; each finite and >= 0, with a positive sum.

    Returns:
      Table name -> probability, in the order of `weights`, tables of weight 0 left out.

    Raises:
      ConfigError: If `weights` is empty or not a mapping, names an unknown table, holds a
        weight that is not a finite number >= 0, sums to 0, or mixes tables whose
        sequence lengths differ.
    """
    if not isinstance(weights, Mapping) or not weights:
        raise ConfigError(
            f"weights must be a non-empty mapping table name -> weight, got {weights!r}"
        )
    lengths = {}
    for name, weight in weights.items():
        lengths[name] = find_table(tables, name).sequence_length
        if (
            not isinstance(weight, numbers.Real)
            or isinstance(weight, bool)
            or not math.isfinite(weight)
            or weight < 0
        ):
            raise ConfigError(
                f"weight of table {name!r} must be a finite number >= 0, got {weight!r}"
            )
    total = float(sum(weights.values()))
    if not 0 < total < math.inf:
        raise ConfigError(
            f"weights must have a positive, finite sum, got {dict(weights)!r} (sum {total!r})"
        )
    if len(set(lengths.values())) > 1:
        raise ConfigError(
            "a mix needs tables of one sequence_length (items are batched together), got "
            f"{lengths!r}"
        )
    return {name: float(w) / total for name, w in weights.items() if w > 0}

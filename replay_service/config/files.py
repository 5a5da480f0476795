"""Server configuration files (TOML) loaded into frozen, validated dataclasses.

    [server]                      # everything optional
    port = 8000
    checkpoint_dir = "replay_checkpoints"
    checkpoint_interval_s = 600   # 0 disables periodic checkpoints
    keep_checkpoints = 3

    [table]
    name = "uniform_table"
    capacity = 50000
    sequence_length = 2
    layout = "nested"             # optional: "nested" or "packed" (replay_service.specs.packed);
                                  # unset: a restore keeps the stored layout, a new buffer is
                                  # nested; extra tables take this one

    [table.sampling]              # see SamplingConfig
    sampler = "uniform"

    [[extra_tables]]              # optional, repeatable: more tables on the same server,
    name = "prioritized_table"    # same keys as [table]; one observer feeds them all
    capacity = 50000
    sequence_length = 2
    [extra_tables.sampling]
    sampler = "prioritized"

    [data_spec]                   # either an environment to take the spec from ...
    env = "building"              # "building" or a gym id such as "CartPole-v0"
    # ... or explicit fields (paths "a/b" nest):
    # structure = "trajectory"
    # fields.observation = { dtype = "float32", shape = [4] }
    # fields.action = { dtype = "int64", shape = [] }

    [[variable_tables]]           # optional, repeatable: a TF-Agents variable container
    name = "variables"            # (ReverbVariableContainer); default "variables"
    [variable_tables.spec]        # its signature: a nest of { dtype, shape } leaves,
    policy_variables = [          # tables nest as dicts, arrays as tuples
      { dtype = "float32", shape = [3, 256] },
      { dtype = "float32", shape = [256] },
    ]
    train_step = { dtype = "int64", shape = [] }

Every unknown key and every bad value is reported with its dotted key path and the file.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from collections.abc import Callable
from typing import Any

from replay_service.config.options import (
    DEFAULT_KEEP,
    INT32_MAX,
    SamplingConfig,
    TableConfig,
    VariableTableConfig,
    require_int,
)
from replay_service.config.tables import check_extra_tables, check_variable_tables
from replay_service.errors import ConfigError, SpecMismatchError
from replay_service.specs import nests as specs

DEFAULT_PORT = 8000


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """The standalone server process.

    Attributes:
      port: TCP port; Reverb listens on all interfaces.
      checkpoint_dir: Checkpoint directory (layout in `replay_service.storage.directory`).
      checkpoint_interval_s: Seconds between periodic checkpoints; 0 disables them.
      keep_checkpoints: Complete checkpoints retained.
    """

    port: int = DEFAULT_PORT
    checkpoint_dir: str = "replay_checkpoints"
    checkpoint_interval_s: float = 600.0
    keep_checkpoints: int = DEFAULT_KEEP

    def __post_init__(self) -> None:
        require_int("server.port", self.port, 1, 65535, what="an integer in 1..65535")
        if not isinstance(self.checkpoint_dir, str) or not self.checkpoint_dir:
            raise ConfigError(f"server.checkpoint_dir must be a path, got {self.checkpoint_dir!r}")
        interval = self.checkpoint_interval_s
        if (
            not isinstance(interval, int | float)
            or isinstance(interval, bool)
            or not math.isfinite(interval)
            or interval < 0
        ):
            raise ConfigError(
                "server.checkpoint_interval_s must be a number >= 0 and finite (0 disables "
                f"periodic checkpoints), got {interval!r}"
            )
        require_int("server.keep_checkpoints", self.keep_checkpoints, 1)


@dataclasses.dataclass(frozen=True)
class DataSpecConfig:
    """Where the table signature comes from: an environment, or explicit fields.

    Attributes:
      env: "building" or a gym id; the spec is the environment's `Trajectory` spec.
      structure: "trajectory" or "dict", for explicit `fields`.
      fields: `{"path", "dtype", "shape"}` descriptions.
    """

    env: str | None = "building"
    structure: str = "trajectory"
    fields: tuple[tuple[str, str, tuple[int, ...]], ...] = ()

    def __post_init__(self) -> None:
        if (self.env is None) == (not self.fields):
            raise ConfigError(
                "data_spec needs exactly one of 'env' or 'fields', got "
                f"env={self.env!r} and {len(self.fields)} field(s)"
            )

    def build(self, load_env: Callable[..., Any] | None = None) -> Any:
        """Returns the per-step data spec.

        Args:
          load_env: For a spec named by `env`: loads an environment by name (called as
            `load_env(name, seed=0)`, e.g. `replay_service.starter.envs.load_env`).

        Raises:
          ConfigError: If the environment is unknown or no loader is given for it, or a field
            is invalid.
        """
        if self.fields:
            described = [{"path": p, "dtype": d, "shape": list(s)} for p, d, s in self.fields]
            try:
                return specs.spec_from_description(described, self.structure)
            except SpecMismatchError as e:
                raise ConfigError(f"data_spec: {e}") from e
        if load_env is None:
            raise ConfigError(
                f"data_spec.env={self.env!r} needs an environment loader to build its spec "
                "(e.g. replay_service.starter.envs.load_env)"
            )
        try:
            env = load_env(str(self.env), seed=0)
        except ValueError as e:
            raise ConfigError(f"data_spec.env: {e}") from e
        return specs.trajectory_spec(env)


@dataclasses.dataclass(frozen=True)
class ServiceConfig:
    """A whole server: process settings, its tables and their data spec.

    Attributes:
      server: Process settings.
      table: The primary table (what clients address by default).
      data_spec: Where the table signature comes from (shared by every replay table).
      extra_tables: More tables on the same server, each with its own name.
      variable_tables: TF-Agents variable-container tables on the same server, each with its
        own name and spec.
      layout_given: Whether `[table]` named its layout; if not, a restore takes the layout
        of the checkpoint it restores (`with_layout`), and a new buffer is nested.
    """

    server: ServerConfig = dataclasses.field(default_factory=ServerConfig)
    table: TableConfig = dataclasses.field(default_factory=TableConfig)
    data_spec: DataSpecConfig = dataclasses.field(default_factory=DataSpecConfig)
    extra_tables: tuple[TableConfig, ...] = ()
    variable_tables: tuple[VariableTableConfig, ...] = ()
    layout_given: bool = True

    def __post_init__(self) -> None:
        check_extra_tables(self.table, self.extra_tables)
        check_variable_tables(self.tables, self.variable_tables)

    def with_layout(self, layout: str) -> ServiceConfig:
        """This configuration with every replay table in `layout`.

        Raises:
          ConfigError: If `layout` is not a layout name.
        """
        return dataclasses.replace(
            self,
            table=dataclasses.replace(self.table, layout=layout),
            extra_tables=tuple(dataclasses.replace(t, layout=layout) for t in self.extra_tables),
            layout_given=True,
        )

    @property
    def tables(self) -> tuple[TableConfig, ...]:
        """Every table, the primary one first."""
        return (self.table, *self.extra_tables)


_SECTIONS = {"server", "table", "data_spec", "extra_tables", "variable_tables"}


def load_config(path: str | os.PathLike[str] | None = None, **overrides: Any) -> ServiceConfig:
    """Reads a TOML config (or the defaults) and applies flag overrides.

    Args:
      path: TOML file; None uses the defaults (the seed's uniform table).
      **overrides: Dotted keys with "__" for ".", e.g. `server__port=9000`; None values are
        ignored.

    Returns:
      The validated configuration.

    Raises:
      ConfigError: If the file is missing or malformed, a key is unknown or a value invalid.
    """
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = os.fspath(path)
        data = read_toml(source)
    for key, value in overrides.items():
        if value is not None:
            section, _, name = key.partition("__")
            data.setdefault(section, {})[name] = value
    try:
        return _parse(data)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from e


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Reads a TOML file.

    Raises:
      ConfigError: If the file is missing, unreadable or not valid TOML (naming the file).
    """
    source = os.fspath(path)
    try:
        with open(source, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {source!r} does not exist") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {source!r} is not valid UTF-8 (TOML files must be): byte "
            f"{e.object[e.start : e.start + 1]!r} at offset {e.start}"
        ) from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"config file {source!r} is not valid TOML: {e}") from e


def _parse(data: dict[str, Any]) -> ServiceConfig:
    _reject_unknown("", data, _SECTIONS)
    server = _section(data, "server")
    _reject_unknown("server", server, _field_names(ServerConfig))
    extra = _array_of_tables(data, "extra_tables")
    variables = _array_of_tables(data, "variable_tables")
    spec = dict(_section(data, "data_spec"))
    _reject_unknown("data_spec", spec, _field_names(DataSpecConfig))
    fields = spec.pop("fields", {})
    if not isinstance(fields, dict):
        raise ConfigError(f"data_spec.fields must be a table, got {fields!r}")
    parsed_fields = tuple(_parse_field(path, value) for path, value in fields.items())
    if parsed_fields and "env" not in spec:
        spec["env"] = None
    table_section = _section(data, "table")
    table = _parse_table("table", table_section)
    # One writer feeds every table: extra tables take the primary's layout unless they name one.
    extra = [{"layout": table.layout, **t} if isinstance(t, dict) else t for t in extra]
    return ServiceConfig(
        server=ServerConfig(**server),
        table=table,
        data_spec=DataSpecConfig(**spec, fields=parsed_fields),
        extra_tables=tuple(
            _parse_table(f"extra_tables[{i}]", table) for i, table in enumerate(extra)
        ),
        variable_tables=tuple(
            _parse_variable_table(f"variable_tables[{i}]", table)
            for i, table in enumerate(variables)
        ),
        layout_given="layout" in table_section,
    )


def _array_of_tables(data: dict[str, Any], name: str) -> list[dict[str, Any]]:
    value = data.get(name, [])
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise ConfigError(f"{name} must be an array of tables ([[{name}]] sections), got {value!r}")
    return value


def _parse_variable_table(where: str, data: dict[str, Any]) -> VariableTableConfig:
    _reject_unknown(where, data, _field_names(VariableTableConfig))
    if "spec" not in data:
        raise ConfigError(
            f"{where} needs a spec ([variable_tables.spec] of {{ dtype = ..., shape = [...] }} "
            f"leaves), got keys {sorted(data)}"
        )
    name = data.get("name", VariableTableConfig.name)
    spec = data["spec"]
    if not isinstance(spec, dict) or not spec:
        raise ConfigError(f"{where}.spec must be a non-empty table, got {spec!r}")
    try:
        return VariableTableConfig(spec=_parse_spec_nest(f"{where}.spec", spec), name=name)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from e


def _parse_spec_nest(key: str, value: Any) -> Any:
    """A TOML nest of `{ dtype, shape }` leaves as `tf.TensorSpec`s: tables are dicts, arrays
    tuples."""
    if isinstance(value, dict) and ("dtype" in value or "shape" in value):
        dtype, shape = _parse_leaf(key, value)
        import tensorflow as tf

        try:
            return tf.TensorSpec(shape, tf.as_dtype(dtype))
        except TypeError as e:
            raise ConfigError(f"{key}.dtype must be a TensorFlow dtype name, got {dtype!r}") from e
    if isinstance(value, dict) and value:
        return {name: _parse_spec_nest(f"{key}.{name}", leaf) for name, leaf in value.items()}
    if isinstance(value, list) and value:
        return tuple(_parse_spec_nest(f"{key}[{i}]", leaf) for i, leaf in enumerate(value))
    raise ConfigError(
        f"{key} must be {{ dtype = ..., shape = [...] }}, a table or an array of them, "
        f"got {value!r}"
    )


def _parse_table(where: str, data: dict[str, Any]) -> TableConfig:
    table = dict(data)
    sampling = _section(table, "sampling", prefix=f"{where}.")
    table.pop("sampling", None)
    _reject_unknown(where, table, _field_names(TableConfig) - {"sampling"})
    _reject_unknown(f"{where}.sampling", sampling, _field_names(SamplingConfig))
    try:
        return TableConfig(**table, sampling=SamplingConfig(**sampling))
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from e


def _parse_field(path: str, value: Any) -> tuple[str, str, tuple[int, ...]]:
    return (path, *_parse_leaf(f"data_spec.fields.{path}", value))


def _parse_leaf(key: str, value: Any) -> tuple[str, tuple[int, ...]]:
    if not isinstance(value, dict) or set(value) != {"dtype", "shape"}:
        raise ConfigError(f"{key} must be {{ dtype = ..., shape = [...] }}, got {value!r}")
    shape = value["shape"]
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= INT32_MAX for d in shape
    ):
        raise ConfigError(
            f"{key}.shape must be a list of integers in 0..{INT32_MAX}, got {shape!r}"
        )
    return str(value["dtype"]), tuple(shape)


def _section(data: dict[str, Any], name: str, prefix: str = "") -> dict[str, Any]:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise ConfigError(f"[{prefix}{name}] must be a table, got {value!r}")
    return value


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _reject_unknown(where: str, data: dict[str, Any], known: set[str]) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        place = f"{where}." if where else ""
        raise ConfigError(
            f"unknown key {place}{unknown[0]!r} (value {data[unknown[0]]!r}); "
            f"known keys{' of ' + where if where else ''}: {sorted(known)}"
        )

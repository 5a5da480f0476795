"""`config.files`: TOML server configurations read into validated configs, every key checked.

`tests/integration/test_bad_inputs.py` checks many bad values through `load_config`; here the
parsing rules themselves: overrides, defaults, layouts, variable tables and each error's key.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from replay_service.config.files import (
    DEFAULT_PORT,
    DataSpecConfig,
    ServerConfig,
    ServiceConfig,
    load_config,
    read_toml,
)
from replay_service.config.options import TableConfig
from replay_service.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]


def toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "server.toml"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def test_no_file_gives_the_defaults_and_overrides_replace_keys_none_ignored():
    config = load_config()
    assert config == ServiceConfig(layout_given=False)
    assert config.server.port == DEFAULT_PORT and config.data_spec.env == "building"
    changed = load_config(
        server__port=9000, server__checkpoint_dir=None, server__keep_checkpoints=5
    )
    assert changed.server == ServerConfig(port=9000, keep_checkpoints=5)


def test_an_override_wins_over_the_file_and_its_error_names_the_file(tmp_path):
    path = toml(tmp_path, "[server]\nport = 7000\ncheckpoint_interval_s = 5\n")
    assert load_config(path).server.port == 7000
    assert load_config(path, server__port=7001).server.port == 7001
    with pytest.raises(ConfigError) as raised:
        load_config(path, server__port=0)
    assert str(raised.value) == f"{path}: server.port must be an integer in 1..65535, got 0"
    with pytest.raises(ConfigError, match=r"^defaults: server\.port must be"):
        load_config(server__port=70000)


def test_every_server_config_of_the_repository_loads():
    servers = [p for p in sorted((REPO / "configs").glob("*.toml")) if p.name != "sharded.toml"]
    assert len(servers) >= 5
    for path in servers:
        config = load_config(path)
        assert config.tables[0] is config.table, path


def test_extra_tables_take_the_primarys_layout_and_may_name_no_other(tmp_path):
    path = toml(
        tmp_path,
        """
        [table]
        layout = "packed"
        [[extra_tables]]
        name = "same"
        [[extra_tables]]
        name = "own"
        layout = "packed"
        """,
    )
    config = load_config(path)
    assert config.layout_given
    assert [t.layout for t in config.tables] == ["packed", "packed", "packed"]
    assert [t.name for t in config.tables] == ["uniform_table", "same", "own"]
    other = toml(
        tmp_path, '[table]\nlayout = "packed"\n[[extra_tables]]\nname = "b"\nlayout = "nested"\n'
    )
    with pytest.raises(ConfigError, match="table 'b' has layout='nested', the primary table"):
        load_config(other)


def test_a_config_without_a_layout_takes_one_later_with_layout(tmp_path):
    config = load_config(toml(tmp_path, '[[extra_tables]]\nname = "second"\n'))
    assert not config.layout_given
    assert [t.layout for t in config.tables] == ["nested", "nested"]
    packed = config.with_layout("packed")
    assert packed.layout_given and [t.layout for t in packed.tables] == ["packed", "packed"]
    assert config.table.layout == "nested"  # frozen: a new config
    with pytest.raises(ConfigError, match="layout must be 'nested' or 'packed', got 'auto'"):
        config.with_layout("auto")


def test_fields_build_a_spec_and_need_no_environment(tmp_path):
    path = toml(
        tmp_path,
        """
        [data_spec]
        fields.observation = { dtype = "float32", shape = [4] }
        fields."policy_info/log_prob" = { dtype = "float32", shape = [] }
        fields.action = { dtype = "int64", shape = [] }
        """,
    )
    config = load_config(path).data_spec
    assert config.env is None and config.structure == "trajectory"
    assert config.fields[0] == ("observation", "float32", (4,))
    spec = config.build()
    assert spec.observation == tf.TensorSpec([4], tf.float32, "observation")
    assert spec.policy_info == {"log_prob": tf.TensorSpec([], tf.float32, "log_prob")}
    assert spec.reward.dtype == tf.float32


def test_a_bad_field_is_a_config_error_naming_the_data_spec(tmp_path):
    config = DataSpecConfig(env=None, fields=(("state", "float32", (2,)),))
    with pytest.raises(
        ConfigError, match=r"^data_spec: a trajectory data spec needs 'observation'"
    ):
        config.build()


def test_an_env_needs_a_loader_and_its_errors_name_the_key():
    config = DataSpecConfig(env="CartPole-v9")
    with pytest.raises(
        ConfigError, match=r"data_spec\.env='CartPole-v9' needs an environment loader"
    ):
        config.build()

    def refuse(name, seed):
        raise ValueError(f"unknown environment {name!r}")

    with pytest.raises(ConfigError, match=r"^data_spec\.env: unknown environment 'CartPole-v9'$"):
        config.build(refuse)
    calls = []

    class Env:
        def time_step_spec(self):
            from tf_agents.specs import tensor_spec
            from tf_agents.trajectories import time_step

            return time_step.time_step_spec(tensor_spec.TensorSpec([2], tf.float32, "obs"))

        def action_spec(self):
            return tf.TensorSpec([], tf.int64, "action")

    def load(name, seed):
        calls.append((name, seed))
        return Env()

    spec = config.build(load)
    assert calls == [("CartPole-v9", 0)]
    assert spec.observation.shape == [2] and spec.action.dtype == tf.int64


@pytest.mark.parametrize(
    ("env", "fields"),
    [(None, ()), ("building", (("observation", "float32", (1,)),))],
)
def test_data_spec_needs_exactly_one_source(env, fields):
    with pytest.raises(ConfigError, match=f"exactly one of 'env' or 'fields', got env={env!r}"):
        DataSpecConfig(env=env, fields=fields)


def test_variable_tables_are_nests_of_tensor_specs(tmp_path):
    path = toml(
        tmp_path,
        """
        [[variable_tables]]
        [variable_tables.spec]
        policy = [ { dtype = "float32", shape = [3, 2] }, { dtype = "float32", shape = [2] } ]
        train_step = { dtype = "int64", shape = [] }
        [[variable_tables]]
        name = "other"
        spec = { w = { dtype = "float64", shape = [1] } }
        """,
    )
    first, other = load_config(path).variable_tables
    assert first.name == "variables" and other.name == "other"
    assert first.spec == {
        "policy": (tf.TensorSpec([3, 2], tf.float32), tf.TensorSpec([2], tf.float32)),
        "train_step": tf.TensorSpec([], tf.int64),
    }
    assert other.spec["w"].dtype == tf.float64


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[variable_tables]]\nname = "v"\n', "variable_tables[0] needs a spec"),
        ("[[variable_tables]]\nspec = {}\n", "variable_tables[0].spec must be a non-empty table"),
        (
            "[[variable_tables]]\nspec = { w = [] }\n",
            "variable_tables[0].spec.w must be { dtype = ..., shape = [...] }, a table or an "
            "array of them, got []",
        ),
        (
            '[[variable_tables]]\nspec = { w = { dtype = "floaty", shape = [1] } }\n',
            "variable_tables[0].spec.w.dtype must be a TensorFlow dtype name, got 'floaty'",
        ),
        (
            '[[variable_tables]]\nspec = { w = [{ dtype = "float32" }] }\n',
            "variable_tables[0].spec.w[0] must be { dtype = ..., shape = [...] }",
        ),
        ("[[variable_tables]]\nbogus = 1\nspec = {}\n", "unknown key variable_tables[0].'bogus'"),
        ("variable_tables = 3\n", "variable_tables must be an array of tables"),
        ("extra_tables = [1]\n", "extra_tables must be an array of tables ([[extra_tables]]"),
        ("[table]\nsampling = 2\n", "[table.sampling] must be a table, got 2"),
        ("[table.sampling]\nsampler = 'random'\n", "table: sampler must be one of"),
        ("[[extra_tables]]\ncapacity = 0\n", "extra_tables[0]: capacity must be a positive"),
        ("[data_spec]\nfields = 3\n", "data_spec.fields must be a table, got 3"),
        (
            '[data_spec]\nfields.x = { dtype = "float32", shape = [2], name = "x" }\n',
            "data_spec.fields.x must be { dtype = ..., shape = [...] }",
        ),
        (
            '[data_spec]\nfields.x = { dtype = "float32", shape = [2147483648] }\n',
            "data_spec.fields.x.shape must be a list of integers in 0..2147483647",
        ),
    ],
)
def test_each_bad_key_is_named_with_its_path_and_the_file(tmp_path, text, message):
    path = toml(tmp_path, text)
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    assert str(raised.value).startswith(f"{path}: ")
    assert message in str(raised.value)


def test_an_unknown_key_lists_the_known_ones(tmp_path):
    with pytest.raises(ConfigError) as raised:
        load_config(toml(tmp_path, "[server]\nprot = 8000\n"))
    assert str(raised.value).endswith(
        "unknown key server.'prot' (value 8000); known keys of server: ['checkpoint_dir', "
        "'checkpoint_interval_s', 'keep_checkpoints', 'port']"
    )
    with pytest.raises(ConfigError, match=r"unknown key 'servers' \(value \{\}\); known keys: \["):
        load_config(toml(tmp_path, "[servers]\n"))


def test_read_toml_names_a_missing_or_malformed_file(tmp_path):
    with pytest.raises(ConfigError, match=r"^config file '.*nope\.toml' does not exist$"):
        read_toml(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[server\n")
    with pytest.raises(ConfigError, match=r"^config file '.*bad\.toml' is not valid TOML: "):
        read_toml(bad)
    with pytest.raises(ConfigError, match="is not valid TOML"):
        read_toml(tmp_path)  # a directory
    assert read_toml(toml(tmp_path, "a = 1\n")) == {"a": 1}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"checkpoint_dir": 3}, "server.checkpoint_dir must be a path, got 3"),
        ({"checkpoint_interval_s": True}, "checkpoint_interval_s must be a number >= 0"),
        ({"checkpoint_interval_s": "600"}, "got '600'"),
    ],
)
def test_server_config_names_the_bad_value(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ServerConfig(**kwargs)
    assert ServerConfig(checkpoint_interval_s=0).checkpoint_interval_s == 0


def test_service_config_checks_its_tables_together():
    with pytest.raises(ConfigError, match="uniform_table"):
        ServiceConfig(extra_tables=(TableConfig(),))
    config = ServiceConfig(extra_tables=(TableConfig(name="b", capacity=np.int64(5).item()),))
    assert [t.name for t in config.tables] == ["uniform_table", "b"]

"""`config.options`: the integer, number, seed, name and path checks, and the frozen configs."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from replay_service.config.options import (
    INT32_MAX,
    MAX_TABLE_NAME_BYTES,
    MAX_TIMEOUT_S,
    SamplingConfig,
    TableConfig,
    Timeouts,
    VariableTableConfig,
    require_int,
    require_number,
    require_positive_int,
    require_seed,
    to_ms,
    validate_manager_options,
    validate_path,
    validate_table_name,
)
from replay_service.errors import ConfigError
from replay_service.specs.arrays import ArraySpec


@pytest.mark.parametrize("value", [0, -3, True, False, 2.5, "4", None])
def test_require_positive_int_names_the_option_and_the_value(value):
    with pytest.raises(ConfigError) as raised:
        require_positive_int("batch_size", value)
    assert str(raised.value) == f"batch_size must be a positive integer, got {value!r}"


def test_require_positive_int_caps_at_int32_unless_told_otherwise():
    assert require_positive_int("capacity", INT32_MAX) == INT32_MAX
    with pytest.raises(ConfigError, match=r"capacity must be an integer in 1\.\.2147483647"):
        require_positive_int("capacity", INT32_MAX + 1)
    assert require_positive_int("batch_size", 2**40, maximum=None) == 2**40
    assert require_int("prefetch", 0, 0, maximum=None) == 0
    with pytest.raises(ConfigError, match="prefetch must be an integer >= 0, got -1"):
        require_int("prefetch", -1, 0, maximum=None)


def test_require_int_takes_numpy_integers_as_python_ints():
    value = require_int("count", np.int64(7), 1)
    assert value == 7 and type(value) is int
    with pytest.raises(ConfigError, match=r"count must be an integer >= 1, got 7\.0$"):
        require_int("count", np.float64(7.0), 1)


def test_require_int_names_a_custom_range_and_only_int32_mentions_reverb():
    with pytest.raises(ConfigError) as raised:
        require_int("port", 70000, 1, 65535, what="an integer in 1..65535")
    assert str(raised.value) == "port must be an integer in 1..65535, got 70000"
    assert "32 bits" not in str(raised.value)
    with pytest.raises(ConfigError, match=r"in 1\.\.2147483647 \(Reverb stores it in 32 bits\)"):
        require_int("capacity", INT32_MAX + 1, 1)
    assert require_int("port", 65535, 1, 65535) == 65535


@pytest.mark.parametrize("value", [None, 0, 12, np.uint32(5)])
def test_require_seed_takes_none_and_non_negative_integers_unchanged(value):
    assert require_seed("seed", value) is value


@pytest.mark.parametrize("value", [-1, True, 1.0, "3"])
def test_require_seed_refuses_anything_else_naming_it(value):
    with pytest.raises(ConfigError) as raised:
        require_seed("seed", value)
    assert str(raised.value) == f"seed must be a non-negative integer or None, got {value!r}"


def test_require_number_bounds_inclusive_exclusive_and_maximum():
    assert require_number("rate", 0, 0) == 0
    assert require_number("rate", 0.5, 0, maximum=0.5) == 0.5
    assert require_number("rate", np.float32(0.25), 0) == np.float32(0.25)
    with pytest.raises(ConfigError, match=r"rate must be a finite number > 0, got 0$"):
        require_number("rate", 0, 0, positive=True)
    with pytest.raises(ConfigError, match=r"rate must be a finite number >= 0 and <= 1, got 1\.5"):
        require_number("rate", 1.5, 0, maximum=1)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, True, "1", None])
def test_require_number_refuses_non_finite_bools_and_non_numbers(value):
    with pytest.raises(ConfigError, match=f"interval must be a finite number >= 0, got {value!r}"):
        require_number("interval", value, 0)


def test_manager_options_accept_a_free_port_and_name_each_bad_argument():
    validate_manager_options(port=None, stride_length=1, keep_checkpoints=1)
    validate_manager_options(port=65535, stride_length=INT32_MAX, keep_checkpoints=3)
    with pytest.raises(ConfigError, match="port must be an integer in 1..65535, got 0"):
        validate_manager_options(port=0, stride_length=1, keep_checkpoints=1)
    with pytest.raises(ConfigError, match="stride_length must be an integer >= 1, got 0"):
        validate_manager_options(port=None, stride_length=0, keep_checkpoints=1)
    with pytest.raises(ConfigError, match="keep_checkpoints must be an integer >= 1, got 1.0"):
        validate_manager_options(port=None, stride_length=1, keep_checkpoints=1.0)


@pytest.mark.parametrize("name", ["t", "uniform_table", "a-b.c_1", "...", "é", "x" * 255])
def test_table_names_of_file_name_characters_are_kept(name):
    assert validate_table_name(name) == name


@pytest.mark.parametrize("name", ["", "a/b", "a b", "t\0", None, 3, b"table"])
def test_table_names_with_other_characters_are_refused_naming_them(name):
    with pytest.raises(ConfigError) as raised:
        validate_table_name(name)
    assert str(raised.value) == (
        f"table name must be a non-empty string of [A-Za-z0-9_.-], got {name!r}"
    )


@pytest.mark.parametrize("name", [".", ".."])
def test_a_table_name_that_names_a_directory_is_refused(name):
    with pytest.raises(ConfigError, match=f"table name must not be {name!r}: "):
        validate_table_name(name)


def test_a_table_name_is_limited_in_utf8_bytes_not_characters():
    assert validate_table_name("é" * (MAX_TABLE_NAME_BYTES // 2)) == "é" * 127
    too_long = "é" * 128  # 128 characters, 256 bytes
    with pytest.raises(ConfigError, match="at most 255 bytes long .*got 256 bytes: 'éééé"):
        validate_table_name(too_long)


def test_validate_path_gives_a_str_for_str_pathlike_and_bytes(tmp_path):
    assert validate_path(str(tmp_path), "checkpoint_dir") == str(tmp_path)
    assert validate_path(Path(tmp_path), "checkpoint_dir") == str(tmp_path)
    assert validate_path(b"/data/\xff", "checkpoint_dir") == "/data/\udcff"


@pytest.mark.parametrize("path", ["/data/a\0b", b"/data\0"])
def test_validate_path_refuses_a_nul_naming_the_path_and_what_it_is(path):
    with pytest.raises(ConfigError, match=r"^export_dir '/data.*' holds a NUL character"):
        validate_path(path, "export_dir")


def test_validate_path_refuses_what_is_not_a_path():
    with pytest.raises(ConfigError) as raised:
        validate_path(42, "checkpoint_dir")  # type: ignore[arg-type]
    assert str(raised.value) == "checkpoint_dir must be a path (a str or os.PathLike), got 42 (int)"


def test_sampling_config_error_buffer_floor_follows_samples_per_insert():
    assert SamplingConfig(error_buffer=1.0).error_buffer == 1.0
    assert SamplingConfig(samples_per_insert=4.0, error_buffer=4.0).error_buffer == 4.0
    with pytest.raises(ConfigError, match=r"error_buffer must be .* = 4\.0 .*got 3\.9"):
        SamplingConfig(samples_per_insert=4.0, error_buffer=3.9)
    with pytest.raises(ConfigError, match=r"= 1\.0 .*got 0\.5"):
        SamplingConfig(samples_per_insert=0.5, error_buffer=0.5)


def test_effective_error_buffer_defaults_to_what_cannot_block_itself():
    assert SamplingConfig(samples_per_insert=0.5).effective_error_buffer() == 2.0
    assert SamplingConfig(samples_per_insert=4.0).effective_error_buffer() == 8.0
    wide = SamplingConfig(samples_per_insert=2.0, min_size_to_sample=1000)
    assert wide.effective_error_buffer() == 200.0  # 10% of the samples of min_size_to_sample
    given = SamplingConfig(samples_per_insert=2.0, error_buffer=3)
    assert given.effective_error_buffer() == 3.0 and type(given.effective_error_buffer()) is float
    with pytest.raises(ConfigError, match="needs samples_per_insert to be set"):
        SamplingConfig().effective_error_buffer()


@pytest.mark.parametrize(
    ("kwargs", "independent"),
    [
        ({}, True),
        ({"sampler": "prioritized"}, False),
        ({"max_times_sampled": 1}, False),
        ({"samples_per_insert": 1.0}, False),
    ],
)
def test_independent_draws_only_for_unlimited_uniform_sampling(kwargs, independent):
    assert SamplingConfig(**kwargs).independent_draws is independent


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sampling": {"sampler": "uniform"}}, "sampling must be a SamplingConfig, got dict"),
        ({"pad_end_of_episode": 1}, "pad_end_of_episode must be True or False, got 1"),
        ({"layout": "columnar"}, "layout must be 'nested' or 'packed', got 'columnar'"),
        ({"name": ".."}, "table name must not be '..'"),
    ],
)
def test_table_config_names_the_bad_field(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        TableConfig(**kwargs)


def test_table_config_may_start_sampling_when_full():
    table = TableConfig(capacity=5, sampling=SamplingConfig(min_size_to_sample=5))
    assert table.sampling.min_size_to_sample == table.capacity
    with pytest.raises(
        ConfigError, match=r"min_size_to_sample \(6\) must not exceed capacity \(5\)"
    ):
        TableConfig(capacity=5, sampling=SamplingConfig(min_size_to_sample=6))


def test_variable_table_config_normalizes_its_spec_and_names_a_bad_one():
    config = VariableTableConfig(
        spec={"w": ArraySpec((3,), "float64", "w"), "step": ArraySpec((), "int64")}
    )
    assert config.name == "variables"
    assert config.spec == {"w": ArraySpec((3,), np.float64, "w"), "step": ArraySpec((), np.int64)}
    with pytest.raises(ConfigError, match=r"variable table 'vars': spec: data_spec has no tensors"):
        VariableTableConfig(spec={}, name="vars")
    with pytest.raises(ConfigError, match=r"variable table 'variables': spec: .*'w'.* 3"):
        VariableTableConfig(spec={"w": 3})
    with pytest.raises(ConfigError, match="table name must be"):
        VariableTableConfig(spec={"w": ArraySpec((), "int64")}, name="a/b")


def test_timeouts_take_none_and_the_longest_finite_timeout_reverb_stores():
    timeouts = Timeouts(connect=None, write=MAX_TIMEOUT_S, sample=0.001, checkpoint=1)
    assert timeouts.connect is None and timeouts.write == MAX_TIMEOUT_S
    with pytest.raises(ConfigError, match=r"timeouts\.write must be .*at most 2\.14748e\+06"):
        Timeouts(write=MAX_TIMEOUT_S + 1)
    with pytest.raises(ConfigError, match=r"timeouts\.checkpoint .* got True"):
        Timeouts(checkpoint=True)


def test_to_ms_rounds_down_to_at_least_one_millisecond():
    assert to_ms(None) is None
    assert to_ms(1.5) == 1500
    assert to_ms(0.0001) == 1
    assert to_ms(MAX_TIMEOUT_S) == INT32_MAX

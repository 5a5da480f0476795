"""`starter.options`: `PopulateConfig`'s checks and derived sizes, and the capacity rules that
keep a starter buffer from evicting what it is being filled with."""

from __future__ import annotations

import numpy as np
import pytest

from replay_service.errors import ConfigError
from replay_service.starter.options import (
    DEFAULT_CAPACITY,
    DEFAULT_ENV,
    DEFAULT_OUTPUT_DIR,
    SEED_RANGE,
    PopulateConfig,
    check_capacity,
    max_new_items,
)


def test_defaults_leave_the_sizes_to_populate():
    config = PopulateConfig("b")
    assert (config.output_dir, config.env, config.policy) == (
        DEFAULT_OUTPUT_DIR,
        DEFAULT_ENV,
        "schedule",
    )
    assert config.capacity is None and config.sequence_length is None and config.seed is None
    assert config.total_steps <= DEFAULT_CAPACITY


def test_total_steps_multiplies_runs_envs_and_steps():
    assert PopulateConfig("b", steps_per_run=7, num_runs=3, num_envs=2).total_steps == 42


def test_seed_range_edges():
    assert PopulateConfig("b", seed=0).seed == 0
    assert PopulateConfig("b", seed=SEED_RANGE - 1).seed == SEED_RANGE - 1
    for bad in (SEED_RANGE, True, 1.0, np.int64(3), "3"):
        with pytest.raises(
            ConfigError, match=r"seed must be an integer in \[0, 2147483648\)"
        ) as raised:
            PopulateConfig("b", seed=bad)
        assert repr(bad) in str(raised.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"env": ""}, "env must be a non-empty string, got ''"),
        ({"policy": None}, "policy must be a non-empty string, got None"),
        ({"output_dir": 3}, "output_dir must be a non-empty string, got 3"),
        ({"steps_per_run": True}, "steps_per_run must be a positive integer, got True"),
        ({"num_runs": 1.5}, "num_runs must be a positive integer, got 1.5"),
        ({"sequence_length": "2"}, "sequence_length must be a positive integer, got '2'"),
        ({"buffer_name": "a/b"}, "buffer name 'a/b' must be a single directory name"),
    ],
)
def test_bad_values_are_refused_naming_the_option_and_value(kwargs, message):
    kwargs.setdefault("buffer_name", "b")
    with pytest.raises(ConfigError) as raised:
        PopulateConfig(**kwargs)
    assert message in str(raised.value)


def test_steps_per_run_has_no_int32_ceiling_but_capacity_has():
    assert PopulateConfig("b", steps_per_run=2**31).total_steps == 2**31
    with pytest.raises(ConfigError, match="capacity must be an integer in 1..2147483647"):
        PopulateConfig("b", capacity=2**31)


def test_overwrite_and_append_exclude_each_other_naming_the_buffer():
    with pytest.raises(ConfigError, match="overwrite and append exclude each other .buffer 'b'."):
        PopulateConfig("b", overwrite=True, append=True)


def test_item_bounds_and_the_capacity_check():
    assert max_new_items(60, 2) == 60
    assert max_new_items(60, 5) == 60
    assert max_new_items(60, 1) == 120
    check_capacity(100, 40, 60, "what")
    with pytest.raises(ConfigError) as raised:
        check_capacity(100, 41, 60, "1 env(s) x 2 run(s) x 30 steps")
    assert str(raised.value).startswith(
        "capacity 100 is too small: 41 items already stored + 1 env(s) x 2 run(s) x 30 steps can "
        "write up to 60 items, 101 in all"
    )


def test_a_capacity_check_of_an_empty_buffer_names_no_stored_items():
    check_capacity(60, 0, 60, "what")  # exactly full is enough
    with pytest.raises(ConfigError) as raised:
        check_capacity(59, 0, 60, "1 env(s) x 1 run(s) x 60 steps")
    message = str(raised.value)
    assert message.startswith(
        "capacity 59 is too small: 1 env(s) x 1 run(s) x 60 steps can write up to 60 items. "
    )
    assert "already stored" not in message and "at least 60" in message

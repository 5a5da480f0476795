"""Starter buffer names: a single visible directory name, and the paths derived from it."""

from __future__ import annotations

import os

import pytest

from replay_service.errors import ConfigError
from replay_service.starter.naming import (
    MAX_BUFFER_NAME_LENGTH,
    SUMMARY_PLOT_SUFFIX,
    starter_buffer_path,
    summary_plot_path,
    validate_buffer_name,
)


@pytest.mark.parametrize("name", ["my-starter-buffer", "week_01", "v1.2", "a..b"])
def test_valid_buffer_names(name, tmp_path):
    assert validate_buffer_name(name) == name
    assert starter_buffer_path(tmp_path, name) == str(tmp_path / name)
    assert summary_plot_path(tmp_path, name) == str(tmp_path / name) + SUMMARY_PLOT_SUFFIX


@pytest.mark.parametrize(
    "name",
    ["", ".", "..", ".x", "a/b", "/abs", "a\\b", "a\0b", "b.summary.png", 3, None],
)
def test_invalid_buffer_names(name):
    with pytest.raises(ConfigError, match="buffer name") as raised:
        validate_buffer_name(name)
    assert repr(name) in str(raised.value)


def test_an_overlong_buffer_name_is_refused_with_its_length():
    with pytest.raises(ConfigError, match="'xxxxxxxxxxxxxxxxxxxx'... is 201 characters long"):
        validate_buffer_name("x" * 201)


def test_the_longest_allowed_name_passes():
    name = "x" * MAX_BUFFER_NAME_LENGTH
    assert validate_buffer_name(name) == name


def test_a_name_holding_the_plot_suffix_elsewhere_is_allowed():
    assert validate_buffer_name("a.summary.png.v2") == "a.summary.png.v2"


def test_paths_are_absolute_for_a_relative_output_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert starter_buffer_path("buffers", "b") == os.path.join(str(tmp_path), "buffers", "b")
    assert summary_plot_path("buffers", "b").endswith(os.path.join("buffers", "b.summary.png"))


def test_paths_refuse_a_bad_name_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"buffer name '\.\./x' must be a single directory"):
        starter_buffer_path(tmp_path, "../x")
    with pytest.raises(ConfigError, match="buffer name '.hidden' must not start with '.'"):
        summary_plot_path(tmp_path, ".hidden")

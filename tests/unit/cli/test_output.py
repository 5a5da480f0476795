"""`cli.output`: which processes are command-line tools, when verbose output is asked for, and
what quieting changes (in this process, with the module's state restored).

`tests/system/cli/test_cli_output.py` checks what the tools print as processes.
"""

from __future__ import annotations

import logging
import os

import pytest

from replay_service.cli import output
from replay_service.cli.output import (
    VERBOSE_ENV,
    after_imports,
    configure,
    is_cli_process,
    is_quiet,
    silence_clog,
    verbose_requested,
)


@pytest.mark.parametrize(
    ("argv", "orig_argv", "cli"),
    [
        (["/venv/bin/replay-server"], [], True),
        (["replay-populate", "--x"], [], True),
        (["scripts/populate_starter_buffer.py"], [], True),
        (["x.py"], ["python", "-m", "replay_service.cli.demo", "--steps=3"], True),
        (["x.py"], ["python", "-m", "replay_service.cli.serve"], True),
        (["x.py"], ["python", "-m", "pytest", "-m", "replay_service.cli.serve"], False),
        (["train.py"], ["python", "train.py"], False),
        (["replay-server-wrapper"], ["python", "-m"], False),
        ([], [], False),
    ],
)
def test_is_cli_process_knows_the_tools_by_script_or_module(argv, orig_argv, cli):
    assert is_cli_process(argv, orig_argv) is cli


@pytest.mark.parametrize(
    ("argv", "verbose"),
    [
        (["tool"], False),
        (["tool", "--verbosity=0"], True),
        (["tool", "-v", "1"], True),
        (["tool", "--v=-1"], False),
        (["tool", "--verbosity=0x1"], True),
        (["tool", "--verbosity=0o7"], True),
        (["tool", "--verbosity=abc"], False),
        (["tool", "--verbosity"], False),  # no value: absl reports it
        (["tool", "--", "--verbosity=1"], False),
        (["tool", "--verbose=1"], False),
        (["-v", "1"], False),  # the program name is never a flag
    ],
)
def test_verbose_is_a_verbosity_of_zero_or_more_before_a_double_dash(argv, verbose):
    assert verbose_requested(argv, {}) is verbose


@pytest.mark.parametrize(
    ("value", "verbose"), [("1", True), (" Yes ", True), ("on", True), ("0", False)]
)
def test_the_environment_asks_for_verbose_output(value, verbose):
    assert verbose_requested(["tool"], {VERBOSE_ENV: value}) is verbose


@pytest.fixture()
def fresh(monkeypatch):
    """The module as in a new process, with the settings it changes restored afterwards."""
    monkeypatch.setattr(output, "_quiet", False)
    monkeypatch.setattr(output, "_clog_silenced", False)
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    tf_logger = logging.getLogger("tensorflow")
    level = tf_logger.level
    monkeypatch.setattr(output, "_drop_gym_notice", lambda: None)
    yield
    tf_logger.setLevel(level)


def test_configure_leaves_a_library_users_process_alone(fresh, monkeypatch):
    monkeypatch.setattr(output.sys, "orig_argv", ["python", "train.py"])
    assert configure(["train.py"]) is False
    assert not is_quiet() and "TF_CPP_MIN_LOG_LEVEL" not in os.environ


def test_configure_quiets_a_tool_unless_verbose_and_keeps_explicit_settings(fresh, monkeypatch):
    assert configure(["replay-server", "--verbosity=0"]) is False
    assert not is_quiet()
    monkeypatch.setenv("GRPC_VERBOSITY", "DEBUG")
    assert configure(["replay-server"]) is True
    assert is_quiet()
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "3"
    assert os.environ["GRPC_VERBOSITY"] == "DEBUG"
    assert logging.getLogger("tensorflow").level == logging.ERROR
    assert configure(["train.py"]) is True  # once quiet, later calls change nothing


def test_after_imports_silences_clog_once_and_only_when_quiet(fresh, monkeypatch):
    calls = []
    monkeypatch.setattr(output, "silence_clog", lambda: calls.append(1) or True)
    after_imports()
    assert calls == []
    monkeypatch.setattr(output, "_quiet", True)
    after_imports()
    after_imports()
    assert calls == [1]


def test_silence_clog_sets_and_clears_the_streams_state():
    # Reverb (C++ with <iostream>) is loaded in this process, so std::clog exists.
    assert silence_clog(True) is True
    assert silence_clog(False) is True


def test_gyms_banner_is_dropped_from_its_notices():
    notices = pytest.importorskip("gym_notices.notices")
    saved = dict(notices.notices)
    try:
        notices.notices["0.23.1"] = "a banner"
        output._drop_gym_notice()
        assert notices.notices == {}
    finally:
        notices.notices.update(saved)

"""`cli.parsing`: help spellings, the one-line usage error and absl flag parsing that exits 2
for a bad flag and 0 for help."""

from __future__ import annotations

import sys
import types

import pytest
from absl import app, flags

from replay_service.cli.parsing import (
    EXIT_USAGE,
    asks_for_help,
    flags_parser,
    show_flags_in_help,
    usage_error,
)

_FLAG = flags.DEFINE_string("cli_parsing_test_flag", "x", "A flag of this test module.")


@pytest.fixture()
def unparsed():
    """absl's global flags as this process had them: unparsed again afterwards."""
    was_parsed = flags.FLAGS.is_parsed()
    yield
    if not was_parsed:
        flags.FLAGS.unparse_flags()


@pytest.mark.parametrize(
    ("argv", "helping"),
    [
        (["tool", "-h"], True),
        (["tool", "--port=1", "--helpfull"], True),
        (["tool", "-?"], True),
        (["tool", "--", "--help"], False),
        (["tool", "status", "--", "-h"], False),
        (["--help"], False),  # the program name is never an argument
        (["tool", "--helpxml"], False),
    ],
)
def test_asks_for_help_before_a_double_dash(argv, helping):
    assert asks_for_help(argv) is helping


def test_usage_error_is_one_line_on_stderr_and_the_exit_to_raise(capsys):
    exit_ = usage_error("replay-server", "bad value\n  for --port:\t-3 ")
    assert isinstance(exit_, SystemExit) and exit_.code == EXIT_USAGE == 2
    captured = capsys.readouterr()
    assert captured.err == "replay-server: error: bad value for --port: -3\n"
    assert captured.out == ""


def test_a_bad_flag_is_one_line_and_exit_2(unparsed, capsys):
    parse = flags_parser("replay-demo")
    with pytest.raises(SystemExit) as raised:
        parse(["replay-demo", "--no_such_flag_here=1"])
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("replay-demo: error: ") and "no_such_flag_here" in err
    assert err.endswith(" (see --help)\n")


def test_flags_are_parsed_and_the_arguments_left_returned(unparsed):
    parse = flags_parser("tool")
    assert parse(["tool", "--cli_parsing_test_flag=y", "status", "--", "-h"]) == [
        "tool",
        "status",
        "-h",
    ]
    assert _FLAG.value == "y"


@pytest.mark.parametrize("spelling", ["-h", "-?", "--help", "--helpshort"])
def test_help_prints_the_usage_on_stdout_and_exits_0(unparsed, capsys, spelling):
    app.define_help_flags()  # as app.run does
    with pytest.raises(SystemExit) as raised:
        flags_parser("tool")(["tool", spelling])
    assert raised.value.code == 0
    assert capsys.readouterr().out.strip()


def test_show_flags_in_help_makes_the_tools_flags_key_flags_of_the_program(monkeypatch):
    main = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", main)
    show_flags_in_help("usage: tool [flags]", _FLAG, program="tool-program")
    key_flags = flags.FLAGS.get_key_flags_for_module("tool-program")
    assert "cli_parsing_test_flag" in [flag.name for flag in key_flags]
    assert main.__doc__ == "usage: tool [flags]"
    documented = types.ModuleType("__main__", "its own usage")
    monkeypatch.setitem(sys.modules, "__main__", documented)
    show_flags_in_help("other usage", _FLAG, program="tool-program")
    assert documented.__doc__ == "its own usage"

"""What the command-line tools share: the usage-error exit, help spellings, and absl flag
parsing that prints one line for a bad flag and lists a tool's own flags in `--help`."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

EXIT_USAGE = 2
"""Exit status of a tool given a bad flag, a bad value or an unknown command (as argparse)."""

HELP_ARGS = frozenset(
    {"-h", "-?", "-help", "--help", "-helpshort", "--helpshort", "-helpfull", "--helpfull"}
)
"""Arguments that ask a tool for its usage: printed on stdout, exit status 0."""
_ABSL_HELP_ARGS = HELP_ARGS | {"-helpxml", "--helpxml"}
# What absl does not know: `-h` and `-?` are its `--help`.
_HELP_SPELLINGS = {"-h": "--help", "-?": "--help"}


def asks_for_help(argv: Sequence[str], spellings: frozenset[str] = HELP_ARGS) -> bool:
    """Whether the command line (program name first) asks for the usage before any `--`."""
    args = list(argv[1:])
    return bool(spellings.intersection(args[: args.index("--")] if "--" in args else args))


def usage_error(tool: str, message: str) -> SystemExit:
    """Prints `tool: error: message` as one line on stderr; returns the exit to raise.

    Args:
      tool: The command's name, e.g. `replay-server`.
      message: What is wrong, naming the value.

    Returns:
      `SystemExit(EXIT_USAGE)`, for the caller to raise.
    """
    text = " ".join(message.split())
    sys.stderr.write(f"{tool}: error: {text}\n")
    return SystemExit(EXIT_USAGE)


def flags_parser(tool: str) -> Callable[[Sequence[str]], list[str]]:
    """An absl `app.run` flags parser that reports a bad flag as one line and exits 2, and
    prints the usage on stdout and exits 0 for `--help`, `-h`, `--helpshort` and `--helpfull`.

    absl's own parser prints `FATAL Flags parsing error: ...` and a second line, and exits 1,
    the status of a crash; its help flags print the usage and exit 1 too (absl's convention),
    and it does not know `-h`. Every installed command answers `--help` and `-h` alike: usage
    on stdout, exit status 0, as `replay-populate` and argparse do.

    Args:
      tool: The command's name, printed before the error.

    Returns:
      A function taking the command line (program name first) and returning the arguments left.
    """

    def parse(argv: Sequence[str]) -> list[str]:
        from absl import flags

        args = list(argv)
        helping = asks_for_help(args, _ABSL_HELP_ARGS)
        if helping:
            end = args.index("--") if "--" in args else len(args)
            args = [args[0], *(_HELP_SPELLINGS.get(a, a) for a in args[1:end]), *args[end:]]
        try:
            return flags.FLAGS(args)
        except flags.Error as e:
            raise usage_error(tool, f"{e} (see --help)") from None
        except SystemExit as e:
            if helping and e.code == 1:  # absl's help flags: the usage is printed
                sys.stdout.flush()
                raise SystemExit(0) from None
            raise

    return parse


def show_flags_in_help(doc: str | None, flag: Any, program: str | None = None) -> None:
    """Makes `--help` list a tool module's flags.

    absl's `--help` lists the key flags of the module it takes for the main one, named by
    `sys.argv[0]`; for a console script that is the script, which defines no flags, so `--help`
    showed only a usage line. Registering the tool module's flags as key flags of the program
    fixes that (under `python -m`, `sys.argv[0]` is the module's file and they already are).

    Args:
      doc: The usage text absl prints above the flags (the tool module's docstring).
      flag: A `FlagHolder` of one of the tool's flags, to find the module defining them.
      program: The main module's name as absl sees it; default `sys.argv[0]`.
    """
    from absl import flags

    program = program or sys.argv[0]
    main_module = sys.modules.get("__main__")
    if main_module is not None and not main_module.__doc__:
        main_module.__doc__ = doc
    module = flags.FLAGS.find_module_defining_flag(flag.name)
    for key_flag in flags.FLAGS.get_key_flags_for_module(module):
        flags.FLAGS.register_key_flag_for_module(program, key_flag)

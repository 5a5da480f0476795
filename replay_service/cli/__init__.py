"""The command-line faces of replay_service, and their entry points.

One module per tool, each an absl program with a `run()`: `serve` (`replay-server`),
`populate` (`replay-populate`) and `demo` (`replay-demo`). The entry points below, named after
the tools (`run_server`, `run_populate`, `run_demo`), first say what to install where Reverb is
missing, then import the tool's module. No function here shares a name with a module of this
package, so `replay_service.cli.populate` is always the module, whatever was imported before.

`replay-server`, `replay-populate` and `replay-demo` run Reverb servers and TF-Agents policies,
which exist only on Linux x86_64 with Python <= 3.11. Elsewhere (the local backend's platforms)
the tool prints one line naming what it needs instead of an import traceback.
"""

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


def _require_reverb(tool: str) -> None:
    from replay_service.backends import reverb_importable

    ok, why = reverb_importable()
    if not ok:
        sys.exit(
            f"{tool} needs dm-reverb 0.13, TensorFlow 2.14 and TF-Agents 0.18 (Linux x86_64, "
            f"Python <= 3.11), which do not import here: {why}. On this platform use "
            "ReplayBufferManager(..., backend='local') from Python."
        )


def run_server() -> None:
    """`replay-server`."""
    _require_reverb("replay-server")
    from replay_service.cli import serve

    serve.run()


def run_populate() -> None:
    """`replay-populate`."""
    _require_reverb("replay-populate")
    from replay_service.cli import populate

    populate.run()


def run_demo() -> None:
    """`replay-demo`."""
    _require_reverb("replay-demo")
    from replay_service.cli import demo

    demo.run()

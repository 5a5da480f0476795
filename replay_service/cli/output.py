"""Keeps the command-line tools' output to their own lines unless verbose output is asked for.

`replay-server`, `replay-populate` and `replay-demo` print a few lines of
their own. Without care they are buried in what the libraries below print on their own:

- TensorFlow's C++ logs (cuDNN/cuFFT/cuBLAS registration errors, CPU feature notes), which
  honour `TF_CPP_MIN_LOG_LEVEL` only if it is set before TensorFlow is imported;
- Reverb's C++ logs: Reverb 0.13's default platform logger writes every message, whatever its
  severity, to `std::clog` (`[reverb/cc/...:line] ...`), with no level and no setting;
- gym 0.23's deprecation banner, printed on `import gym` from the `gym_notices` table;
- TensorFlow's Python deprecation warnings (e.g. `parallel_interleave`);
- gRPC's C-core log lines (e.g. `Failed accept4` when `replay-server` closes its listening
  socket to stop confirming writes), which honour `GRPC_VERBOSITY`.

`configure()` runs from `replay_service/__init__.py`, before TensorFlow, Reverb or gym is
imported, and `after_imports()` once they are (a tool's `cli.require_reverb_imports` imports
them once its flags are parsed; `replay_service` calls it again whenever it imports one of its
modules). In a command-line tool's process, and unless
`REPLAY_SERVICE_VERBOSE=1` or a `--verbosity` (`-v`) of 0 or more is on the command line, they
set `TF_CPP_MIN_LOG_LEVEL=3` and `GRPC_VERBOSITY=NONE` (explicit settings in the environment
win), drop gym's banner, set the `tensorflow` Python logger to ERROR, and put `std::clog` into
its failed state so that Reverb's log lines are discarded. Only `std::clog` is affected: file
descriptor 2, `std::cerr` (Reverb's fatal check failures), Python's `sys.stderr` and every error
this project reports stay as they are. A library user's process (anything but the tools) is
never changed.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Mapping, Sequence

VERBOSE_ENV = "REPLAY_SERVICE_VERBOSE"
"""Set to 1 (or true/yes/on) to see every library's log lines in the command-line tools."""

CLI_MODULES = frozenset(
    {
        "replay_service.cli.serve",
        "replay_service.cli.populate",
        "replay_service.cli.demo",
    }
)
"""Modules run with `python -m` that are command-line tools."""

CLI_SCRIPTS = frozenset(
    {"replay-server", "replay-populate", "replay-demo", "populate_starter_buffer.py"}
)
"""Program names (`sys.argv[0]`'s base name) of the command-line tools."""

_TRUE = frozenset({"1", "true", "yes", "on"})
_VERBOSITY_FLAGS = ("--verbosity", "-verbosity", "--v", "-v")
# libstdc++ symbols: the `std::clog` object and `std::basic_ios<char>::clear(iostate)`.
_CLOG_SYMBOL = "_ZSt4clog"
_CLEAR_SYMBOL = "_ZNSt9basic_iosIcSt11char_traitsIcEE5clearESt12_Ios_Iostate"
_BADBIT = 1
# In the Itanium C++ ABI the offset of a virtual base (basic_ios in basic_ostream) is stored
# three words before the address the object's vtable pointer points to.
_VBASE_OFFSET_SLOT = 3

_quiet = False
_clog_silenced = False


def is_cli_process(
    argv: Sequence[str] | None = None, orig_argv: Sequence[str] | None = None
) -> bool:
    """Whether this process runs one of the command-line tools.

    Args:
      argv: `sys.argv` (default).
      orig_argv: The interpreter's own command line, `sys.orig_argv` (default).

    Returns:
      True for `replay-server`, `replay-populate`, `replay-demo`,
      `scripts/populate_starter_buffer.py` and `python -m replay_service.cli.{serve,populate,demo}`.
    """
    argv = sys.argv if argv is None else argv
    orig_argv = getattr(sys, "orig_argv", []) if orig_argv is None else orig_argv
    if argv and os.path.basename(argv[0]) in CLI_SCRIPTS:
        return True
    for index, arg in enumerate(orig_argv[:-1]):
        if arg == "-m":
            return orig_argv[index + 1] in CLI_MODULES
    return False


def verbose_requested(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> bool:
    """Whether the user asked for every library's log lines.

    Args:
      argv: The command line (default `sys.argv`); `--verbosity=N` or `-v N` with N >= 0 asks;
        a value that is not an integer does not (the tool refuses it).
      environ: The environment (default `os.environ`); `REPLAY_SERVICE_VERBOSE=1` asks.

    Returns:
      True if verbose output was asked for.
    """
    argv = sys.argv if argv is None else argv
    environ = os.environ if environ is None else environ
    if environ.get(VERBOSE_ENV, "").strip().lower() in _TRUE:
        return True
    args = list(argv[1:])
    for index, arg in enumerate(args):
        if arg == "--":
            break
        name, has_value, value = arg.partition("=")
        if name not in _VERBOSITY_FLAGS:
            continue
        if not has_value:
            if index + 1 == len(args):
                return False  # a flag without its value: absl reports it
            value = args[index + 1]
        level = _parse_level(value)
        return level is not None and level >= 0
    return False


def _parse_level(value: str) -> int | None:
    """`value` as absl's integer flags read it (`0x` and `0o` prefixes too), or None.

    A value absl refuses asks for nothing: the tool then reports the bad flag as its one line
    of output, which library banners printed before it would bury.
    """
    base = 10
    if len(value) > 2 and value[0] == "0" and value[1] in "ox":
        base = 8 if value[1] == "o" else 16
    try:
        return int(value, base)
    except ValueError:
        return None


def configure(argv: Sequence[str] | None = None) -> bool:
    """Quiets the libraries' own output in a command-line tool's process (see module docs).

    Call it before TensorFlow, Reverb or gym is imported; later calls do nothing more.

    Args:
      argv: The command line (default `sys.argv`).

    Returns:
      Whether the output is quiet.
    """
    global _quiet
    if _quiet:
        return True
    if not is_cli_process(argv) or verbose_requested(argv):
        return False
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    _drop_gym_notice()
    logging.getLogger("tensorflow").setLevel(logging.ERROR)
    _quiet = True
    return True


def after_imports() -> None:
    """Completes `configure` once TensorFlow and Reverb are loaded: silences `std::clog`.

    libstdc++ (before GCC 13) constructs its standard streams only when the first C++ library
    that includes <iostream> is loaded, and a stream's state set before that is overwritten.
    It may be called any number of times (`replay_service` calls it whenever it imports one of
    its modules); once `std::clog` is silenced, later calls do nothing.
    """
    global _clog_silenced
    if _quiet and not _clog_silenced:
        _clog_silenced = silence_clog()


def is_quiet() -> bool:
    """Whether `configure` quieted this process."""
    return _quiet


def silence_clog(silent: bool = True) -> bool:
    """Discards (or again writes) what C++ code writes to `std::clog`: Reverb's log lines.

    It sets (or clears) the stream's badbit, so every later `std::clog << ...` writes nothing;
    `std::cerr`, `std::cout` and file descriptor 2 are untouched.

    Args:
      silent: True to discard, False to write again.

    Returns:
      Whether it could be done (False where libstdc++ cannot be loaded).
    """
    try:
        library = ctypes.CDLL("libstdc++.so.6")
        clog = ctypes.addressof(ctypes.c_char.in_dll(library, _CLOG_SYMBOL))
        clear = library[_CLEAR_SYMBOL]
    except (OSError, ValueError, AttributeError):
        return False
    clear.argtypes = [ctypes.c_void_p, ctypes.c_int]
    clear.restype = None
    vtable = ctypes.c_void_p.from_address(clog).value
    if not vtable:  # not constructed yet: no C++ library with <iostream> was loaded
        return False
    slot = vtable - _VBASE_OFFSET_SLOT * ctypes.sizeof(ctypes.c_ssize_t)
    offset = ctypes.c_ssize_t.from_address(slot).value
    clear(clog + offset, _BADBIT if silent else 0)
    return True


def _drop_gym_notice() -> None:
    """Removes the banner gym prints on import from its notices table."""
    try:
        from gym_notices import notices
    except ImportError:
        return
    notices.notices.clear()

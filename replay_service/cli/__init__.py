"""The command-line faces of replay_service, and their entry points.

One module per tool, each an absl program with a `run()`: `serve` (`replay-server`),
`populate` (`replay-populate`) and `demo` (`replay-demo`). The entry points below, named after
the tools (`run_server`, `run_populate`, `run_demo`), first say what to install where Reverb is
missing, then import the tool's module; TensorFlow is imported only once the flags are
parsed, so `--help` and a bad flag answer in a fraction of a second. No function here shares a
name with a module of this package, so `replay_service.cli.populate` is always the module,
whatever was imported before.

`replay-server`, `replay-populate` and `replay-demo` run Reverb servers and TF-Agents policies,
which exist only on Linux x86_64 with Python <= 3.11. Elsewhere (the local backend's platforms)
the tool prints one line naming what it needs instead of an import traceback.
"""

from __future__ import annotations

import sys
from importlib.util import find_spec


def _require_reverb(tool: str) -> None:
    """Exits with one line naming what `tool` needs where dm-reverb, TensorFlow or TF-Agents is
    not installed: found without importing them, so `--help` and a bad flag answer at once
    (`require_reverb_imports` imports them once the flags are good)."""
    missing = [m for m in ("reverb", "tensorflow", "tf_agents") if find_spec(m) is None]
    if missing:
        _exit_without_reverb(tool, f"ModuleNotFoundError: No module named {missing[0]!r}")


def require_reverb_imports(tool: str) -> None:
    """Exits with one line naming what `tool` needs where dm-reverb, TensorFlow or TF-Agents is
    installed but does not import (a wrong version beside it, say), and quiets their output
    once they are loaded (`output.after_imports`); the tools' `main` calls it before their
    work.

    Args:
      tool: The command's name, for the message.
    """
    from replay_service.backends import reverb_importable
    from replay_service.cli import output

    ok, why = reverb_importable()
    if not ok:
        _exit_without_reverb(tool, why)
    # Reverb's C++ log lines are discarded once it is loaded (`output.after_imports`).
    output.after_imports()


def _exit_without_reverb(tool: str, why: str) -> None:
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

"""Whether the tools' Reverb stack (dm-reverb, TensorFlow, TF-Agents) is here: one line naming
what a tool needs where it is not, instead of an import traceback."""

from __future__ import annotations

import sys
from importlib.util import find_spec

from replay_service.cli.output import after_imports


def require_reverb_installed(tool: str) -> None:
    """Exits with one line naming what `tool` needs where dm-reverb, TensorFlow or TF-Agents is
    not installed: found without importing them, so `--help` and a bad flag answer at once
    (`require_reverb_imports` imports them once the flags are good).

    Args:
      tool: The command's name, for the message.
    """
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

    ok, why = reverb_importable()
    if not ok:
        _exit_without_reverb(tool, why)
    # Reverb's C++ log lines are discarded once it is loaded (`output.after_imports`).
    after_imports()


def _exit_without_reverb(tool: str, why: str) -> None:
    sys.exit(
        f"{tool} needs dm-reverb 0.13, TensorFlow 2.14 and TF-Agents 0.18 (Linux x86_64, "
        f"Python <= 3.11), which do not import here: {why}. On this platform use "
        "ReplayBufferManager(..., backend='local') from Python."
    )

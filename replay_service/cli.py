"""Entry points of the command-line tools: each says what to install where Reverb is missing.

`replay-server`, `replay-populate` and `replay-demo` run Reverb servers and TF-Agents policies,
which exist only on Linux x86_64 with Python <= 3.11. Elsewhere (the local backend's platforms)
the tool prints one line naming what it needs instead of an import traceback.
"""

from __future__ import annotations

import sys


def _require_reverb(tool: str) -> None:
    from replay_service.manager import reverb_importable

    ok, why = reverb_importable()
    if not ok:
        sys.exit(
            f"{tool} needs dm-reverb 0.13, TensorFlow 2.14 and TF-Agents 0.18 (Linux x86_64, "
            f"Python <= 3.11), which do not import here: {why}. On this platform use "
            "ReplayBufferManager(..., backend='local') from Python."
        )


def server() -> None:
    """`replay-server`."""
    _require_reverb("replay-server")
    from replay_service import serve

    serve.run()


def populate() -> None:
    """`replay-populate`."""
    _require_reverb("replay-populate")
    from replay_service import populate as populate_cli

    populate_cli.run()


def demo() -> None:
    """`replay-demo`."""
    _require_reverb("replay-demo")
    from replay_service import demo as demo_cli

    demo_cli.run()

"""The command-line faces of replay_service, and their entry points.

One module per tool, each an absl program with a `run()`: `serve` (`replay-server`),
`populate` (`replay-populate`) and `demo` (`replay-demo`). The entry points below, named after
the tools (`run_server`, `run_populate`, `run_demo`), first say what to install where Reverb is
missing, then import the tool's module, which loads no TensorFlow, TF-Agents or Reverb: `--help`,
a bad flag and every refusal that needs no TensorFlow answer in a fraction of a second. The
stack is imported once the flags are checked (`stack.require_reverb_imports`, one line where it
does not import); `replay-populate` and `replay-demo` import it, and the modules that do their
work (`demo_work.py`), before absl's `app.run` starts their `main`, as TensorFlow needs. No
function here shares a name with a module of this package, so `replay_service.cli.populate` is
always the module, whatever was imported before.

`replay-server`, `replay-populate` and `replay-demo` run Reverb servers and TF-Agents policies,
which exist only on Linux x86_64 with Python <= 3.11. Elsewhere (the local backend's platforms)
the tool prints one line naming what it needs instead of an import traceback.
"""

from __future__ import annotations

from replay_service.cli.stack import require_reverb_installed


def run_server() -> None:
    """`replay-server`."""
    require_reverb_installed("replay-server")
    from replay_service.cli import serve

    serve.run()


def run_populate() -> None:
    """`replay-populate`."""
    require_reverb_installed("replay-populate")
    from replay_service.cli import populate

    populate.run()


def run_demo() -> None:
    """`replay-demo`."""
    require_reverb_installed("replay-demo")
    from replay_service.cli import demo

    demo.run()

"""Runs scripts that never import replay_service (TF-Agents' own examples) with the `inspect`
patch that lets TF-Agents' `PolicySaver` save policies with the pinned stack:
`python -m replay_service.integrations.tf_compat SCRIPT [ARGS...]` (or `-m MODULE [ARGS...]`).

The patch itself, what it fixes and how to turn it off: `backends/reverb/platform/inspect_patch.py`.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

from replay_service.backends.reverb.platform.inspect_patch import PATCH_ENV, patch_inspect

USAGE = (
    "usage: python -m replay_service.integrations.tf_compat SCRIPT [ARGS...]\n"
    "       python -m replay_service.integrations.tf_compat -m MODULE [ARGS...]\n"
    "Runs a Python script or module (e.g. TF-Agents' sac_train.py) with the patch that lets\n"
    f"TF-Agents' PolicySaver save policies ({PATCH_ENV}=0 turns it off)."
)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs a script or module as `__main__` with the patch applied (see module docs).

    Meant for `python -m replay_service.integrations.tf_compat`: a script gets the `sys.argv`
    and the first `sys.path` entry that `python SCRIPT` would give it, a module those of
    `python -m MODULE`.

    Args:
      argv: `[SCRIPT, ARGS...]` or `["-m", MODULE, ARGS...]` (default `sys.argv[1:]`).

    Returns:
      0 after the script returns, 2 for a bad command line (a script's own `sys.exit` passes
      through).

    Raises:
      ConfigError: If `REPLAY_SERVICE_PATCH_INSPECT` holds an unknown value.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not args else sys.stdout)
        return 2 if not args else 0
    as_module = args[0] == "-m"
    if as_module and len(args) < 2:
        print(f"-m needs a module name\n{USAGE}", file=sys.stderr)
        return 2
    target = args[1] if as_module else args[0]
    if not as_module and not os.path.isfile(target):
        print(f"no such script: {target!r}\n{USAGE}", file=sys.stderr)
        return 2
    patch_inspect()
    if as_module:
        sys.argv = [target, *args[2:]]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *args[1:]]
        # As `python SCRIPT` has it: the script's folder first on the path, not the current
        # directory that `python -m` put there (a checkout's own packages would shadow the
        # installed ones).
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")
    return 0


if __name__ == "__main__":
    # The package's copy of this module, so that the patch is the one replay_service checks.
    from replay_service.integrations.tf_compat import main as _main

    sys.exit(_main())

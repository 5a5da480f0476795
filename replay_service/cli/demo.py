"""End-to-end demo: collect CartPole into a fresh buffer, sample, checkpoint, restore.

replay-demo [--steps=500] [--checkpoint_dir=DIR]   (also python -m replay_service.cli.demo)
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from absl import app, flags, logging

from replay_service.cli.parsing import flags_parser, show_flags_in_help, usage_error
from replay_service.cli.stack import require_reverb_imports
from replay_service.errors import ReplayServiceError

WORK_MODULE = "replay_service.cli.demo_work"
"""The module that does the demo's work, importing TensorFlow and TF-Agents as it loads."""

_STEPS = flags.DEFINE_integer("steps", 500, "Environment steps to collect.", lower_bound=1)
_CAPACITY = flags.DEFINE_integer("capacity", 50_000, "Buffer capacity in items.", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch_size", 64, "Sampled batch size.", lower_bound=1)
_CHECKPOINT_DIR = flags.DEFINE_string(
    "checkpoint_dir", None, "Checkpoint directory (default: a new temporary directory)."
)
_ENV = flags.DEFINE_string("env", "CartPole-v0", "A gym environment id for suite_gym.")


def check_flags(argv: Sequence[str]) -> None:
    """Refuses, without TensorFlow, unexpected arguments and an --env gym's registry lacks.

    Args:
      argv: The arguments left after parsing the flags, program name first.

    Raises:
      SystemExit: Exit status 2, after one line on stderr naming the value (`usage_error`).
    """
    if len(argv) > 1:
        raise usage_error("replay-demo", f"unexpected arguments {list(argv[1:])!r}; see --help")
    import gym

    try:
        gym.spec(_ENV.value)  # what suite_gym.load looks up first
    except Exception as e:  # gym raises several kinds for an unknown or broken id
        message = f"--env={_ENV.value!r} cannot be loaded: {e}"
        raise usage_error("replay-demo", message) from None


def main(argv: list[str]) -> None:
    """Runs the demo (`run` has checked the flags and imported the stack); a refused buffer is
    one line on stderr and exit 2."""
    from replay_service.cli.demo_work import run_demo

    try:
        run_demo(
            env_id=_ENV.value,
            steps=_STEPS.value,
            capacity=_CAPACITY.value,
            batch_size=_BATCH.value,
            checkpoint_dir=_CHECKPOINT_DIR.value,
        )
    except ReplayServiceError as e:
        raise usage_error("replay-demo", str(e)) from None


def run() -> None:
    """Console-script entry point.

    The flags are parsed and checked first, without TensorFlow: `--help` and a bad flag or
    value answer at once. TensorFlow and TF-Agents (`WORK_MODULE`) are then imported before
    absl's `app.run` starts `main`: imported inside it, the demo's tf.data dataset would
    compare tensors as TF1 does and fail.
    """
    logging.set_verbosity(logging.WARNING)
    show_flags_in_help(__doc__, _STEPS)
    app.define_help_flags()  # `--help` and its spellings, as `app.run` defines them
    remaining = flags_parser("replay-demo")(sys.argv)
    check_flags(remaining)
    require_reverb_imports("replay-demo")
    importlib.import_module(WORK_MODULE)
    app.run(main, flags_parser=lambda _argv: remaining)


if __name__ == "__main__":
    run()

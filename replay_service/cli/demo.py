"""End-to-end demo: collect CartPole into a fresh buffer, sample, checkpoint, restore.

replay-demo [--steps=500] [--checkpoint_dir=DIR]   (also python -m replay_service.cli.demo)
"""

from __future__ import annotations

import tempfile
import time

import tensorflow as tf
from absl import app, flags, logging
from tf_agents.environments import suite_gym
from tf_agents.policies import random_py_policy
from tf_agents.train import actor
from tf_agents.train.utils import train_utils

from replay_service.cli.parsing import flags_parser, show_flags_in_help, usage_error
from replay_service.cli.stack import require_reverb_imports
from replay_service.errors import ConfigError, ReplayServiceError
from replay_service.manager import ReplayBufferManager
from replay_service.specs.nests import collect_data_spec

_STEPS = flags.DEFINE_integer("steps", 500, "Environment steps to collect.", lower_bound=1)
_CAPACITY = flags.DEFINE_integer("capacity", 50_000, "Buffer capacity in items.", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch_size", 64, "Sampled batch size.", lower_bound=1)
_CHECKPOINT_DIR = flags.DEFINE_string(
    "checkpoint_dir", None, "Checkpoint directory (default: a new temporary directory)."
)
_ENV = flags.DEFINE_string("env", "CartPole-v0", "A gym environment id for suite_gym.")


def main(argv: list[str]) -> None:
    """Runs the demo; a bad value or a refused buffer is one line on stderr and exit 2."""
    if len(argv) > 1:
        raise usage_error("replay-demo", f"unexpected arguments {argv[1:]!r}; see --help")
    require_reverb_imports("replay-demo")
    try:
        _demo()
    except ReplayServiceError as e:
        raise usage_error("replay-demo", str(e)) from None


def _demo() -> None:
    checkpoint_dir = _CHECKPOINT_DIR.value or tempfile.mkdtemp(prefix="replay_service_demo_")
    try:
        env = suite_gym.load(_ENV.value)
    except Exception as e:  # gym raises several kinds for an unknown or broken id
        raise ConfigError(f"--env={_ENV.value!r} cannot be loaded: {e}") from e
    policy = random_py_policy.RandomPyPolicy(env.time_step_spec(), env.action_spec())
    data_spec = collect_data_spec(env, policy)

    with ReplayBufferManager(data_spec, _CAPACITY.value, checkpoint_dir, 2) as manager:
        _, observer = manager.create_replay_buffer()
        collect_actor = actor.Actor(
            env,
            policy,
            train_utils.create_train_step(),
            steps_per_run=_STEPS.value,
            observers=[observer],
        )
        start = time.perf_counter()
        collect_actor.run()
        observer.flush()
        elapsed = time.perf_counter() - start
        frames = manager.num_frames()
        print(
            f"collected  {_STEPS.value} {_ENV.value} steps -> {frames} items "
            f"(2-step windows) in {elapsed:.2f} s"
        )

        dataset = manager.get_dataset(batch_size=_BATCH.value, num_steps=2)
        batch, _ = next(iter(dataset))
        print(
            f"sampled    a batch of {_BATCH.value}: observation {batch.observation.shape}, "
            f"mean reward {float(tf.reduce_mean(batch.reward)):.2f}"
        )
        path = manager.checkpoint()
        print(f"saved      checkpoint {path}")

    with ReplayBufferManager(data_spec, _CAPACITY.value, checkpoint_dir, 2) as restored:
        restored.load_replay_buffer()
        count = restored.num_frames()
        same = "same" if count == frames else "DIFFERENT"
        print(f"restored   {count} items into a new manager ({same} count)")
        if count != frames:
            raise SystemExit(f"restore mismatch: wrote {frames} items, restored {count}")
    print(f"done       buffer kept in {checkpoint_dir}")


def run() -> None:
    """Console-script entry point."""
    logging.set_verbosity(logging.WARNING)
    show_flags_in_help(__doc__, _STEPS)
    app.run(main, flags_parser=flags_parser("replay-demo"))


if __name__ == "__main__":
    run()

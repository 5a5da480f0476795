"""The demo's work, with TensorFlow and TF-Agents imported as it loads.

It collects, samples, checkpoints and restores; `replay-demo` (`cli/demo.py`) imports it once
its flags are checked, before absl's `app.run` starts its `main`.
"""

from __future__ import annotations

import tempfile
import time

import tensorflow as tf
from tf_agents.environments import suite_gym
from tf_agents.policies import random_py_policy
from tf_agents.train import actor
from tf_agents.train.utils import train_utils

from replay_service.errors import ConfigError
from replay_service.manager import ReplayBufferManager
from replay_service.specs.nests import collect_data_spec


def run_demo(
    *, env_id: str, steps: int, capacity: int, batch_size: int, checkpoint_dir: str | None
) -> None:
    """Collects `steps` steps of `env_id` under a random policy into a fresh buffer, samples a
    batch, checkpoints it and restores the checkpoint into a new manager, printing a line each.

    Args:
      env_id: A gym id for `suite_gym`.
      steps: Environment steps to collect.
      capacity: The buffer's capacity in items.
      batch_size: The sampled batch size.
      checkpoint_dir: Where to checkpoint; None: a new temporary directory.

    Raises:
      ConfigError: If the environment cannot be loaded.
      ReplayServiceError: If the buffer refuses a value or fails.
      SystemExit: If the restored buffer holds another number of items.
    """
    checkpoint_dir = checkpoint_dir or tempfile.mkdtemp(prefix="replay_service_demo_")
    try:
        env = suite_gym.load(env_id)
    except Exception as e:  # gym raises several kinds for an unknown or broken id
        raise ConfigError(f"--env={env_id!r} cannot be loaded: {e}") from e
    policy = random_py_policy.RandomPyPolicy(env.time_step_spec(), env.action_spec())
    data_spec = collect_data_spec(env, policy)

    with ReplayBufferManager(data_spec, capacity, checkpoint_dir, 2) as manager:
        _, observer = manager.create_replay_buffer()
        collect_actor = actor.Actor(
            env,
            policy,
            train_utils.create_train_step(),
            steps_per_run=steps,
            observers=[observer],
        )
        start = time.perf_counter()
        collect_actor.run()
        observer.flush()
        elapsed = time.perf_counter() - start
        frames = manager.num_frames()
        print(
            f"collected  {steps} {env_id} steps -> {frames} items "
            f"(2-step windows) in {elapsed:.2f} s"
        )

        dataset = manager.get_dataset(batch_size=batch_size, num_steps=2)
        batch, _ = next(iter(dataset))
        print(
            f"sampled    a batch of {batch_size}: observation {batch.observation.shape}, "
            f"mean reward {float(tf.reduce_mean(batch.reward)):.2f}"
        )
        path = manager.checkpoint()
        print(f"saved      checkpoint {path}")

    with ReplayBufferManager(data_spec, capacity, checkpoint_dir, 2) as restored:
        restored.load_replay_buffer()
        count = restored.num_frames()
        same = "same" if count == frames else "DIFFERENT"
        print(f"restored   {count} items into a new manager ({same} count)")
        if count != frames:
            raise SystemExit(f"restore mismatch: wrote {frames} items, restored {count}")
    print(f"done       buffer kept in {checkpoint_dir}")

"""Starter buffers written the way google/sbsim writes them, for the adoption tests.

sbsim cannot be installed here, and its code is not copied into this project. This module makes
the same Reverb and TF-Agents calls, with the same arguments, as sbsim's `ReplayBufferManager`
(google/sbsim, `smart_control/reinforcement_learning/replay_buffer/replay_buffer.py` at commit
1712eb0d5b00a7258607b5e4af90a9b0ef2fef13) and its starter-buffer script
(`smart_control/reinforcement_learning/scripts/populate_starter_buffer.py`):

- a table `uniform_table`: `max_size=capacity`, `Uniform` sampler, `Fifo` remover,
  `MinSize(1)` rate limiter and NO signature;
- `reverb.platform.checkpointers_lib.DefaultCheckpointer(path=checkpoint_dir)`, and
  `reverb.Server([table], port=None, checkpointer=...)`, which loads the root's newest
  complete checkpoint if there is one (sbsim's `load_replay_buffer()`, same calls);
- TF-Agents' `ReverbReplayBuffer(data_spec, sequence_length=..., table_name=...,
  local_server=server)` and `ReverbAddTrajectoryObserver(replay_buffer.py_client, table_name,
  sequence_length=..., stride_length=1)`;
- `replay_buffer.py_client.checkpoint()` after every collection run and once more at the end.
"""

from __future__ import annotations

import os
from typing import Any

import reverb
from tf_agents.drivers import py_driver
from tf_agents.replay_buffers import reverb_replay_buffer, reverb_utils

SBSIM_TABLE = "uniform_table"


class SbsimStyleManager:
    """sbsim's `ReplayBufferManager` API (the parts a starter buffer needs), same Reverb calls.

    Args:
      data_spec: The per-step `Trajectory` spec (sbsim: built from the env's and the schedule
        policy's specs).
      capacity: The table's `max_size`.
      checkpoint_dir: The bare Reverb checkpoint root.
      sequence_length: Steps per item.
    """

    def __init__(
        self, data_spec: Any, capacity: int, checkpoint_dir: str, sequence_length: int = 2
    ) -> None:
        self.data_spec = data_spec
        self.capacity = capacity
        self.checkpoint_dir = checkpoint_dir
        self.sequence_length = sequence_length
        self.table_name = SBSIM_TABLE
        self.server: reverb.Server | None = None
        self.replay_buffer: Any = None
        self.observer: Any = None

    def create_replay_buffer(self) -> tuple[Any, Any]:
        """Starts the server on the root (sbsim's `create_replay_buffer`)."""
        return self._start()

    def load_replay_buffer(self) -> tuple[Any, Any]:
        """The same calls: Reverb loads the root's newest complete checkpoint."""
        return self._start()

    def _start(self) -> tuple[Any, Any]:
        table = reverb.Table(
            self.table_name,
            max_size=self.capacity,
            sampler=reverb.selectors.Uniform(),
            remover=reverb.selectors.Fifo(),
            rate_limiter=reverb.rate_limiters.MinSize(1),
        )
        checkpointer = reverb.platform.checkpointers_lib.DefaultCheckpointer(
            path=self.checkpoint_dir
        )
        self.server = reverb.Server([table], port=None, checkpointer=checkpointer)
        self.replay_buffer = reverb_replay_buffer.ReverbReplayBuffer(
            self.data_spec,
            sequence_length=self.sequence_length,
            table_name=self.table_name,
            local_server=self.server,
        )
        self.observer = reverb_utils.ReverbAddTrajectoryObserver(
            self.replay_buffer.py_client,
            self.table_name,
            sequence_length=self.sequence_length,
            stride_length=1,
        )
        return self.replay_buffer, self.observer

    def close(self) -> None:
        """Stops the server."""
        if self.server is not None:
            self.server.stop()
            self.server = None


def populate_sbsim_buffer(
    root: str | os.PathLike[str],
    env: Any,
    policy: Any,
    data_spec: Any,
    *,
    capacity: int,
    steps_per_run: int,
    num_runs: int,
    sequence_length: int = 2,
    table_name: str = SBSIM_TABLE,
) -> None:
    """Fills a starter buffer as sbsim's `populate_starter_buffer.py` does.

    Collects `num_runs` runs of `steps_per_run` steps (episodes carry on across runs), with a
    checkpoint after each run and a final one. `table_name` other than sbsim's names the table
    as other TF-Agents code does (`ReverbReplayBuffer`'s default is `experience`).
    """
    manager = SbsimStyleManager(data_spec, capacity, os.fspath(root), sequence_length)
    manager.table_name = table_name
    replay_buffer, observer = manager.create_replay_buffer()
    try:
        driver = py_driver.PyDriver(env, policy, [observer], max_steps=steps_per_run)
        time_step = env.reset()
        for _ in range(num_runs):
            time_step, _ = driver.run(time_step)
            replay_buffer.py_client.checkpoint()
        replay_buffer.py_client.checkpoint()
    finally:
        manager.close()

"""The collector subprocess of tests/system/storage/test_faults.py: the SIGTERM and kill -9
tests run this file as a script (`python tests/_collector.py collect|embedded ...`) and kill it.

`collect ADDRESS THREADS OUT_JSON` writes from several observers into a running replay-server
until it stops confirming; `embedded CHECKPOINT_DIR` collects into an embedded manager with
periodic checkpoints until killed; `unclosed ADDRESS WRITER STEPS [wait]` writes STEPS steps of
one episode with WRITER ("observer": the manager's; "tf_agents": TF-Agents'
`ReverbAddTrajectoryObserver` on `manager.py_client`) and exits without closing anything (with
`wait`: then waits for a line on stdin and writes STEPS more steps first). The tests import
`step`, `remote_manager` and the constants from here, so the subprocess and the checks agree on
them.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: conftest (FAST_TIMEOUTS) lives in tests/
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
from tf_agents.trajectories import trajectory as trajectory_lib

from conftest import FAST_TIMEOUTS
from replay_service import ReplayBufferManager
from replay_service.config.options import Timeouts

MID = 1
COLLECTOR_THREADS = 3
FLUSH_EVERY = 8
ID_SPACING = 10_000_000
EMBEDDED_INTERVAL_S = 1.0
EMBEDDED_STEPS_PER_S = 150


def step(counter: int) -> trajectory_lib.Trajectory:
    """A CartPole-shaped step whose action carries the unique id `counter` (an endless episode).

    An item (a window of two steps) is identified by the id of its last step.
    """
    return trajectory_lib.Trajectory(
        step_type=np.int32(MID),
        observation=np.full([4], counter % 1000, np.float32),
        action=np.int64(counter),
        policy_info=(),
        next_step_type=np.int32(MID),
        reward=np.float32(1.0),
        discount=np.float32(1.0),
    )


def remote_manager(data_spec: Any, address: str) -> ReplayBufferManager:
    """A manager of the CartPole config's table on a running server."""
    return ReplayBufferManager(
        data_spec,
        100_000,
        table_name="uniform_table",
        server_address=address,
        timeouts=FAST_TIMEOUTS,
    )


def _cartpole_spec() -> Any:
    from tf_agents.environments import suite_gym
    from tf_agents.policies import random_py_policy

    from replay_service.specs.nests import collect_data_spec

    env = suite_gym.load("CartPole-v0")
    return collect_data_spec(
        env, random_py_policy.RandomPyPolicy(env.time_step_spec(), env.action_spec())
    )


def _collect_remote(address: str, threads: int, out: str) -> int:
    """Writes from `threads` observers as fast as they go until the server stops confirming.

    Thread k writes steps with ids (k + 1) * ID_SPACING, +1, ...; after each successful flush it
    records the last id written as confirmed. Writes `out` (JSON) when every thread stopped.
    """
    manager = remote_manager(_cartpole_spec(), address)
    manager.load_replay_buffer()
    results: list[dict[str, Any]] = []
    lock = threading.Lock()

    def run(index: int) -> None:
        _, observer = manager.get_replay_buffer_and_observer()
        first = (index + 1) * ID_SPACING
        counter, confirmed, error = first, first, ""
        try:
            while True:
                for _ in range(FLUSH_EVERY):
                    observer(step(counter))
                    counter += 1
                observer.flush()
                confirmed = counter - 1
        except Exception as e:  # the server stopped confirming: that is the point
            error = f"{type(e).__name__}: {str(e)[:200]}"
        with lock:
            results.append(
                {"first": first, "confirmed": confirmed, "written": counter - 1, "error": error}
            )

    workers = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(threads)]
    for worker in workers:
        worker.start()
    print("collecting", flush=True)
    for worker in workers:
        worker.join()
    Path(out).write_text(json.dumps(results))
    os._exit(0)  # the observers' server is gone; do not wait on their cleanup


def _collect_embedded(checkpoint_dir: str) -> int:
    """An embedded manager with periodic checkpoints, collecting at a bounded rate until killed."""
    manager = ReplayBufferManager(
        _cartpole_spec(),
        100_000,
        checkpoint_dir,
        timeouts=FAST_TIMEOUTS,
        checkpoint_interval_s=EMBEDDED_INTERVAL_S,
    )
    _, observer = manager.create_replay_buffer()
    print("collecting", flush=True)
    counter = 0
    while True:
        observer(step(counter))
        counter += 1
        time.sleep(1.0 / EMBEDDED_STEPS_PER_S)


UNCLOSED_TIMEOUTS = Timeouts(connect=5.0, write=2.0, sample=1.0, checkpoint=60.0)


def _write_unclosed(address: str, writer: str, steps: int, wait: bool) -> int:
    """Writes `steps` steps (ids 0, 1, ...) of one episode and returns without closing the
    observer or the manager: what remains unsent is the interpreter exit's to send."""
    manager = ReplayBufferManager(
        _cartpole_spec(),
        100_000,
        table_name="uniform_table",
        server_address=address,
        timeouts=UNCLOSED_TIMEOUTS,
    )
    _, observer = manager.load_replay_buffer()
    if writer == "tf_agents":
        from tf_agents.replay_buffers.reverb_utils import ReverbAddTrajectoryObserver

        observer = ReverbAddTrajectoryObserver(
            manager.py_client, manager.table_name, manager.sequence_length
        )
    for counter in range(steps):
        observer(step(counter))
    print("written", flush=True)
    if wait:
        sys.stdin.readline()
        for counter in range(steps, 2 * steps):
            observer(step(counter))
    _KEPT.append((manager, observer))  # alive until the interpreter exits
    return 0


_KEPT: list[Any] = []


def main(argv: list[str]) -> int:
    """`collect ADDRESS THREADS OUT_JSON`, `embedded CHECKPOINT_DIR` or
    `unclosed ADDRESS WRITER STEPS [wait]`."""
    if argv[0] == "unclosed":
        return _write_unclosed(argv[1], argv[2], int(argv[3]), argv[4:] == ["wait"])
    if argv[0] == "collect":
        return _collect_remote(argv[1], int(argv[2]), argv[3])
    if argv[0] == "embedded":
        return _collect_embedded(argv[1])
    raise SystemExit(f"unknown mode {argv[0]!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""kill -9 a process while `epoch_batches` reads its items, then load the buffer again.

On embedded Reverb the pass reads a snapshot checkpoint of the table; the one left on disk by a
killed process must never be loaded as a checkpoint nor make `keep_checkpoints` prune the
user's own. The local backend copies the items in memory and must leave nothing either.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from gymnasium import spaces

from conftest import FAST_TIMEOUTS
from replay_service import CheckpointStore, ReplayBufferManager
from replay_service.storage.directory import REVERB_DIR, SNAPSHOTS_DIR

# Starts a manager, checkpoints 10 items, writes 5 more, then starts `epoch_batches`: the read
# of its items says "reading <what>" on stdout and waits for a line on stdin that never comes.
_CHILD = """
import os, sys
import numpy as np
from gymnasium import spaces
from replay_service import ReplayBufferManager, Timeouts

checkpoint_dir, backend = sys.argv[1], sys.argv[2]
manager = ReplayBufferManager.from_spaces(
    spaces.Box(-10.0, 10.0, (4,), np.float32), spaces.Discrete(2),
    checkpoint_dir=checkpoint_dir, backend=backend, capacity=500, keep_checkpoints=1,
    timeouts=Timeouts(connect=5.0, write=10.0, sample=1.0, checkpoint=60.0),
)
manager.create_replay_buffer()

def write(episodes, first):
    writer = manager.transition_writer()
    for e in range(first, first + episodes):
        for i in range(5):
            obs = np.array([e, i, 0, 0], np.float32)
            writer.add(obs, i % 2, 1.0, obs + [0, 1, 0, 0], i == 4)
    writer.flush()

write(2, 0)
print("checkpoint", manager.checkpoint(), flush=True)
write(1, 2)

def held(what, read):
    def wrapper(*args, **kwargs):
        print("reading", what(*args), flush=True)
        sys.stdin.readline()  # the test kills this process here
        return read(*args, **kwargs)
    return wrapper

if backend == "reverb":
    from replay_service.backends.reverb import transfer as export
    export.read_items = held(lambda handle, path: path, export.read_items)
else:
    from replay_service.backends.local.table import LocalTable
    LocalTable.items = held(lambda table: "memory", LocalTable.items)
manager.epoch_batches(4)
print("the pass finished", flush=True)
"""


def _readline(proc: subprocess.Popen[str], prefix: str) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith(prefix):
        proc.kill()
        _, err = proc.communicate(timeout=30)
        raise AssertionError(f"expected {prefix!r}, got {line!r}; stderr: {err[-3000:]}")
    return line[len(prefix) :].strip()


@pytest.mark.parametrize("backend", ["reverb", "local"])
def test_a_kill_while_epoch_batches_reads_leaves_the_users_checkpoint_to_load(tmp_path, backend):
    root = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(root), backend],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    try:
        mine = _readline(proc, "checkpoint ")
        reading = _readline(proc, "reading ")
        if backend == "reverb":
            # The snapshot is complete on disk while it is read, and not among the checkpoints.
            assert os.path.isfile(os.path.join(reading, "DONE")), reading
            assert f"{os.sep}{SNAPSHOTS_DIR}{os.sep}" in reading, reading
            assert os.listdir(root / REVERB_DIR) == []
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    store = CheckpointStore(root)
    assert [c.path for c in store.checkpoints()] == [mine]
    manager = ReplayBufferManager.from_spaces(
        spaces.Box(-10.0, 10.0, (4,), np.float32),
        spaces.Discrete(2),
        checkpoint_dir=str(root),
        backend=backend,
        capacity=500,
        keep_checkpoints=1,
        timeouts=FAST_TIMEOUTS,
    )
    try:
        manager.load_replay_buffer()
        assert len(manager) == 10  # the user's checkpoint, not the 15 items of the snapshot
        # keep_checkpoints=1 pruned nothing; the only checkpoint is still the user's.
        assert [c.path for c in store.checkpoints()] == [mine]
        # The snapshot the killed process left is gone, and nothing else was left behind.
        assert not os.path.exists(reading)
        snapshots = root / SNAPSHOTS_DIR
        assert not snapshots.exists() or os.listdir(snapshots) == []
        seen = sum(int(b.observation.shape[0]) for b in manager.epoch_batches(4, seed=0))
        assert seen == 10
        assert [c.path for c in store.checkpoints()] == [mine]
    finally:
        manager.close()

"""A local table too large for a real, small /dev/shm (1 MiB, as a container's tmpfs).

The child runs in its own user and mount namespaces (`unshare`) with a 1 MiB tmpfs over
/dev/shm: `data_loader(num_workers=1)` must fail with a `ConfigError` naming the bytes needed
and free, and the table must stay as it was: writes that wrap the ring, torch batches, epochs,
a checkpoint and its restore, an export and its import, every item kept. Skipped where user
namespaces are not allowed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO

pytestmark = pytest.mark.local

CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from gymnasium import spaces
    from replay_service import ConfigError, ReplayBufferManager

    root, capacity, episode = sys.argv[1], 4000, 50
    def make(name):
        return ReplayBufferManager.from_spaces(
            spaces.Box(-1e6, 1e6, (64,), np.float32), spaces.Discrete(2),
            checkpoint_dir=f"{root}/{name}", backend="local", capacity=capacity,
        )
    def write(writer, e):
        for i in range(episode):
            state = np.full(64, 0, np.float32); state[:2] = (e, i)
            after = state.copy(); after[1] += 1
            writer.add(state, [i % 2], float(i), after, i == episode - 1)
    def items(manager):
        found = []
        for batch in manager.epoch_batches(1000, transitions=True, seed=0):
            found += [tuple(int(v) for v in row[:2]) for row in batch.states.numpy()]
        return sorted(found)
    manager = make("ckpt"); manager.create_replay_buffer()
    writer = manager.transition_writer()
    write(writer, 0)
    result = {}
    try:
        manager.torch_dataset(8, transitions=True).data_loader(num_workers=1)
    except ConfigError as e:
        result["error"] = str(e)
    for e in range(1, 200):  # 10,000 transitions into 4,000 slots: the ring wraps
        write(writer, e)
    every = [(e, i) for e in range(200) for i in range(episode)]
    held = sorted(every[-capacity:])
    batch = next(iter(manager.torch_batches(4096, transitions=True)))
    result["batch"] = {tuple(int(v) for v in r[:2]) for r in batch.states.numpy()} <= set(held)
    result["epoch"] = items(manager) == held
    manager.checkpoint()
    manager.export(f"{root}/export")
    imported = make("imported"); imported.import_buffer(f"{root}/export")
    result["import"] = items(imported) == held
    imported.close(); manager.close()
    restored = make("ckpt"); restored.load_replay_buffer()
    result["restore"] = items(restored) == held
    restored.close()
    print("RESULT " + json.dumps(result))
    """
)


def _namespaces_allowed() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "true"],
        capture_output=True,
        timeout=30,
        check=False,
    )
    return probe.returncode == 0


def test_table_too_large_for_a_small_dev_shm_is_refused_and_kept(tmp_path) -> None:
    if not _namespaces_allowed():
        pytest.skip("user and mount namespaces (unshare) are not allowed here")
    script = tmp_path / "child.py"
    script.write_text(CHILD, encoding="utf-8")
    command = (
        "mount -t tmpfs -o size=1m tmpfs /dev/shm && "
        f'exec "{sys.executable}" "{script}" "{tmp_path}"'
    )
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", command],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    error = result.get("error", "")
    assert "/dev/shm has 1048576 bytes free" in error, result
    assert "needs " in error and "num_workers=0" in error and "--shm-size" in error, error
    assert result["batch"] and result["epoch"] and result["import"] and result["restore"], result

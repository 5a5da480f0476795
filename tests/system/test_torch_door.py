"""The PyTorch door on the local backend imports no TensorFlow, TF-Agents or Reverb.

A fresh interpreter (where the Reverb stack is installed too) builds a CartPole buffer with
`from_spaces(backend="local")` and `backend="auto"`, writes it through a transition writer and
`warm_up`, samples torch batches and epochs, checkpoints, exports, loads and imports it; an
audit hook names the first import of any of those modules with its stack. The child's time and
peak RSS are printed (`pytest -s`), not asserted: they depend on the machine's load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO

pytestmark = pytest.mark.local

FORBIDDEN = ("tensorflow", "tf_agents", "reverb")

CHILD = textwrap.dedent(
    """
    import json, sys, time, traceback

    FORBIDDEN = {forbidden!r}
    first_imports = {{}}

    def audit(event, args):
        if event == "import":
            top = args[0].partition(".")[0]
            if top in FORBIDDEN and top not in first_imports:
                first_imports[top] = "".join(traceback.format_stack(limit=20))

    def peak_rss_mb():
        # VmHWM is this program's own peak (ru_maxrss keeps the forking parent's after exec).
        try:
            with open("/proc/self/status") as status:
                for line in status:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) // 1024
        except OSError:  # not Linux
            pass
        return -1

    sys.addaudithook(audit)
    start = time.monotonic()

    import gymnasium as gym
    import numpy as np
    import replay_service

    root = sys.argv[1]
    observation_space, action_space = gym.spaces.Box(-1, 1, (4,)), gym.spaces.Discrete(2)

    def make(name, backend="local"):
        return replay_service.ReplayBufferManager.from_spaces(
            observation_space, action_space, capacity=50000,
            checkpoint_dir=f"{{root}}/{{name}}", backend=backend,
        )

    manager = make("ckpt")
    manager.create_replay_buffer()
    created_s = time.monotonic() - start
    created_rss_mb = peak_rss_mb()
    writer = manager.transition_writer()
    for i in range(20):
        state = np.full(4, i / 32, np.float32)
        writer.add(state, [i % 2], 1.0, state + 1 / 32, i == 19)
    writer.flush()
    manager.warm_up(gym.make("CartPole-v1"), 100, seed=0, progress=False)
    batch = next(iter(manager.torch_batches(32, transitions=True)))
    items = next(iter(manager.torch_batches(8)))
    epoch = sum(len(b.states) for b in manager.epoch_batches(16, transitions=True, seed=0))
    manager.checkpoint()
    manager.export(f"{{root}}/export")
    frames = manager.num_frames()
    manager.close()
    restored = make("ckpt", backend="auto")
    restored.load_replay_buffer()
    next(iter(restored.torch_batches(8, transitions=True)))
    imported = make("imported", backend="auto")
    imported.import_buffer(f"{{root}}/export")
    result = {{
        "backends": [restored.backend, imported.backend],
        "frames": [frames, restored.num_frames(), imported.num_frames()],
        "epoch": epoch,
        "batch": list(batch.states.shape),
        "modules": sorted({{k.partition(".")[0] for k in sys.modules}} & set(FORBIDDEN)),
        "stacks": first_imports,
        "created_s": created_s,
        "created_rss_mb": created_rss_mb,
        "total_s": time.monotonic() - start,
        "rss_mb": peak_rss_mb(),
    }}
    restored.close()
    imported.close()
    print("RESULT " + json.dumps(result))
    """
).format(forbidden=FORBIDDEN)


def test_from_spaces_local_door_imports_no_tensorflow_tf_agents_or_reverb(tmp_path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD, encoding="utf-8")
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    print(
        f"create: {result['created_s']:.2f} s, {result['created_rss_mb']} MB max RSS; "
        f"everything: {result['total_s']:.2f} s, {result['rss_mb']} MB max RSS"
    )
    assert result["modules"] == [], "\n".join(
        f"{name} first imported at:\n{stack}" for name, stack in result["stacks"].items()
    )
    assert result["backends"] == ["local", "local"], result
    frames = result["frames"]
    assert frames[0] > 100 and frames == [frames[0]] * 3, result
    assert result["epoch"] == frames[0] and result["batch"] == [32, 4], result

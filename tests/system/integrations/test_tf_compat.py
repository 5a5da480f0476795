"""TF-Agents' PolicySaver in this project's environment (`replay_service.integrations.tf_compat`).

With tensorflow 2.14, wrapt 1.14's C proxy and typing_extensions >= 4.6, `PolicySaver` fails
with `TypeError: this __dict__ descriptor does not support '_DictWrapper' objects`. A process
that uses the Reverb backend gets the patch with no call of its own; the switch turns it off; the
local backend's import path never applies it. Each case runs in a fresh interpreter, since
whether the patch is in place depends on what the process imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO
from replay_service.backends.reverb.platform import inspect_patch

SUBPROCESS_TIMEOUT_S = 240
ERROR = "this __dict__ descriptor does not support '_DictWrapper' objects"

# The README's quick start on the Reverb backend, then PolicySaver: save, load and act. It
# imports nothing from replay_service but the manager, and asks for no patch.
_QUICK_START_THEN_POLICY_SAVER = textwrap.dedent(
    """
    import inspect, json, os, sys, tempfile

    import numpy as np
    import tensorflow as tf
    from tf_agents.policies import fixed_policy, policy_saver, py_tf_eager_policy
    from tf_agents.specs import tensor_spec
    from tf_agents.trajectories import time_step as ts

    from replay_service import ReplayBufferManager

    root = tempfile.mkdtemp()
    observation = tensor_spec.BoundedTensorSpec([3], tf.float32, -8.0, 8.0, "observation")
    action = tensor_spec.BoundedTensorSpec([1], tf.float32, -2.0, 2.0, "action")
    policy = fixed_policy.FixedPolicy(
        np.array([1.5], np.float32), ts.time_step_spec(observation), action
    )
    report = {}
    with ReplayBufferManager(
        data_spec=policy.collect_data_spec,
        capacity=100,
        checkpoint_dir=os.path.join(root, "replay"),
        sequence_length=2,
        backend="reverb",
    ) as manager:
        manager.create_replay_buffer()
        report["patched"] = hasattr(inspect._check_instance, "_replay_service_original")
        try:
            policy_saver.PolicySaver(policy, batch_size=None).save(os.path.join(root, "policy"))
        except TypeError as e:
            report["error"] = str(e)
        else:
            loaded = py_tf_eager_policy.SavedModelPyTFEagerPolicy(
                os.path.join(root, "policy"), load_specs_from_pbtxt=True
            )
            step = ts.restart(np.zeros([3], np.float32))
            report["action"] = loaded.action(step).action.tolist()
    print("REPORT " + json.dumps(report))
    """
)


def run_python(
    *args: str, env: dict[str, str] | None = None, cwd: Path | str = REPO
) -> subprocess.CompletedProcess:
    """Runs this interpreter with `args` in a fresh process, this worktree first on the path."""
    environ = dict(os.environ if env is None else env, TF_CPP_MIN_LOG_LEVEL="3")
    # No empty entry: an empty PYTHONPATH entry puts the current directory on the path.
    environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), environ.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )


def report_of(result: subprocess.CompletedProcess) -> dict:
    """The JSON line a script printed after `REPORT `."""
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert lines, result.stdout + result.stderr
    return json.loads(lines[-1][len("REPORT ") :])


def test_policy_saver_saves_loads_and_acts_after_the_quick_start() -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (inspect_patch.PATCH_ENV, "WRAPT_DISABLE_EXTENSIONS")
    }
    report = report_of(run_python("-c", _QUICK_START_THEN_POLICY_SAVER, env=env))
    assert report.get("error") is None, report
    assert report == {"patched": True, "action": [1.5]}


_POLICY_SAVER_BEFORE_ANY_BUFFER = textwrap.dedent(
    """
    import inspect, json, os, sys, tempfile

    import numpy as np
    import tensorflow as tf
    from tf_agents.policies import fixed_policy, policy_saver
    from tf_agents.specs import tensor_spec
    from tf_agents.trajectories import time_step as ts

    from replay_service import ReplayBufferManager

    root = tempfile.mkdtemp()
    observation = tensor_spec.BoundedTensorSpec([3], tf.float32, -8.0, 8.0, "observation")
    action = tensor_spec.BoundedTensorSpec([1], tf.float32, -2.0, 2.0, "action")
    policy = fixed_policy.FixedPolicy(
        np.array([1.5], np.float32), ts.time_step_spec(observation), action
    )
    report = {"patched": hasattr(inspect._check_instance, "_replay_service_original")}
    try:
        policy_saver.PolicySaver(policy, batch_size=None).save(os.path.join(root, "policy"))
    except TypeError as e:
        report["error"] = str(e)
    report["saved"] = os.path.isfile(os.path.join(root, "policy", "saved_model.pb"))
    print("REPORT " + json.dumps(report))
    """
)


def test_policy_saver_saves_right_after_the_import_before_any_buffer() -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (inspect_patch.PATCH_ENV, "WRAPT_DISABLE_EXTENSIONS")
    }
    report = report_of(run_python("-c", _POLICY_SAVER_BEFORE_ANY_BUFFER, env=env))
    assert report == {"patched": True, "saved": True}, report


# Each setting is a process importing TensorFlow: `make test` runs "0", and
# test_a_bad_switch_value_is_a_config_error_naming_it reads "off" and "False" as off too.
@pytest.mark.parametrize(
    "setting",
    [
        "0",
        pytest.param("off", marks=pytest.mark.slow),
        pytest.param("False", marks=pytest.mark.slow),
    ],
)
def test_the_switch_leaves_inspect_alone_and_policy_saver_fails_as_before(setting: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "WRAPT_DISABLE_EXTENSIONS"}
    env[inspect_patch.PATCH_ENV] = setting
    report = report_of(run_python("-c", _QUICK_START_THEN_POLICY_SAVER, env=env))
    assert report == {"patched": False, "error": ERROR}


def test_the_local_backend_import_path_imports_no_tensorflow(tmp_path: Path) -> None:
    pytest.importorskip("gymnasium")
    # ArraySpec leaves (what from_spaces builds on the local backend), so that
    # nothing here imports TensorFlow.
    script = textwrap.dedent(
        f"""
        import inspect, json, sys

        original = inspect._check_instance

        import gymnasium
        import numpy as np

        from replay_service import ReplayBufferManager
        from replay_service.specs.arrays import spec_for_spaces

        manager = ReplayBufferManager(
            spec_for_spaces(gymnasium.spaces.Box(-1, 1, (3,)), gymnasium.spaces.Discrete(2)),
            capacity=10,
            checkpoint_dir={str(tmp_path / "replay")!r},
            sequence_length=2,
            backend="local",
        )
        manager.create_replay_buffer()
        writer = manager.transition_writer()
        for i in range(4):
            writer.add(np.zeros(3, np.float32), 1, 1.0, np.zeros(3, np.float32), i == 3)
        with manager.torch_batches(2, transitions=True) as batches:
            batch = next(iter(batches))
        manager.close()
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "reverb"))
        print("REPORT " + json.dumps({{
            "rows": int(batch.rewards.shape[0]),
            "same_inspect": inspect._check_instance is original,
            "patched_by": "replay_service.backends.reverb.platform.inspect_patch" in sys.modules,
            "loaded": loaded,
        }}))
        """
    )
    report = report_of(run_python("-c", script))
    # The patch is applied where the probe sees the failure (this environment), with no
    # TensorFlow or Reverb imported on the way.
    assert report == {
        "rows": 2,
        "same_inspect": not inspect_patch.needs_patch() and not inspect_patch.is_patched(),
        "patched_by": True,
        "loaded": [],
    }


def test_the_runner_runs_a_script_that_never_imports_replay_service(tmp_path: Path) -> None:
    script = tmp_path / "save_policy.py"
    script.write_text(
        textwrap.dedent(
            """
            import importlib.util, json, sys

            import numpy as np
            import tensorflow as tf
            from tf_agents.policies import fixed_policy, policy_saver
            from tf_agents.specs import tensor_spec
            from tf_agents.trajectories import time_step as ts

            assert __name__ == "__main__"
            observation = tensor_spec.TensorSpec([3], tf.float32)
            action = tensor_spec.BoundedTensorSpec([1], tf.float32, -2.0, 2.0)
            policy = fixed_policy.FixedPolicy(
                np.array([1.5], np.float32), ts.time_step_spec(observation), action
            )
            policy_saver.PolicySaver(policy, batch_size=None).save(sys.argv[1])
            sees_cwd = importlib.util.find_spec("only_in_cwd") is not None
            print("REPORT " + json.dumps({"argv": sys.argv, "sees_cwd": sees_cwd}))
            """
        )
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (inspect_patch.PATCH_ENV, "WRAPT_DISABLE_EXTENSIONS")
    }
    out = tmp_path / "policy"
    plain = run_python(str(script), str(out), env=env, cwd=tmp_path)
    assert plain.returncode != 0 and ERROR in plain.stderr, plain.stdout + plain.stderr
    # Run from a directory whose modules `python SCRIPT` would not see (a checkout's packages).
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "only_in_cwd.py").write_text("")
    runner = ["-m", "replay_service.integrations.tf_compat", str(script), str(out)]
    report = report_of(run_python(*runner, env=env, cwd=checkout))
    assert (out / "saved_model.pb").is_file()
    assert report == {"argv": [str(script), str(out)], "sees_cwd": False}

    (checkout / "as_module.py").write_text(
        "import inspect, json, sys\n"
        "patched = hasattr(inspect._check_instance, '_replay_service_original')\n"
        "print('REPORT ' + json.dumps({'name': __name__, 'args': sys.argv[1:], 'p': patched}))\n"
    )
    runner = ["-m", "replay_service.integrations.tf_compat", "-m", "as_module", "--flag"]
    report = report_of(run_python(*runner, env=env, cwd=checkout))
    assert report == {"name": "__main__", "args": ["--flag"], "p": True}

    no_module = run_python("-m", "replay_service.integrations.tf_compat", "-m")
    assert no_module.returncode == 2 and "-m needs a module name" in no_module.stderr
    missing = run_python("-m", "replay_service.integrations.tf_compat", str(tmp_path / "nope.py"))
    assert missing.returncode == 2 and "no such script" in missing.stderr
    assert str(tmp_path / "nope.py") in missing.stderr

"""The standalone server as a real subprocess on a loopback port, with remote clients."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import reverb
import tensorflow as tf

from conftest import (
    CARTPOLE_CONFIG,
    CONFIGS,
    FAST_TIMEOUTS,
    REPO,
    all_items,
    collect,
    tree_digest,
    wait_for_adoption,
)
from replay_service import ConfigError, ReplayBufferManager
from replay_service.config.files import load_config
from replay_service.starter.envs import load_env
from replay_service.storage.directory import CHECKPOINTS_DIR, CORRUPT_DIR

PRIORITIZED_CONFIG = os.path.join(CONFIGS, "cartpole_prioritized.toml")
TABLE = "uniform_table"


def remote(data_spec, address, table=TABLE):
    return ReplayBufferManager(
        data_spec, 100_000, server_address=address, table_name=table, timeouts=FAST_TIMEOUTS
    )


def test_plain_reverb_client_sees_the_table_and_can_write_and_sample(start_server):
    server, address = start_server("--checkpoint_interval_s=0")
    # A server loads no torch (its libraries would be mapped): half a gigabyte less.
    with open(f"/proc/{server.proc.pid}/maps") as maps:
        assert "libtorch" not in maps.read()
    client = reverb.Client(address)
    info = client.server_info(timeout=10)[TABLE]
    assert info.max_size == 100_000
    assert info.signature.observation.shape == [2, 4]
    assert info.signature.observation.dtype == tf.float32
    with client.trajectory_writer(num_keep_alive_refs=2) as writer:
        for i in range(1001):
            step = tf.nest.map_structure(
                lambda s, v=i % 2: np.full(s.shape[1:], v, s.dtype.as_numpy_dtype), info.signature
            )
            writer.append(step)
            if i:
                window = tf.nest.map_structure(lambda c: c[-2:], writer.history)
                writer.create_item(TABLE, 1.0, window)
        writer.flush(timeout_ms=10_000)
    assert client.server_info(timeout=10)[TABLE].current_size == 1000
    sample = next(client.sample(TABLE, num_samples=1, emit_timesteps=False))
    assert sample.data[0].shape[0] == 2


def test_sigterm_checkpoints_and_restore_gives_the_same_items(start_server, env, policy, data_spec):
    server, address = start_server("--checkpoint_interval_s=0", "--restore_if_exists")
    collector = remote(data_spec, address)
    _, observer = collector.load_replay_buffer()
    collect(env, policy, observer, 80)
    written = all_items(collector.py_client, TABLE, collector.num_frames())
    collector.close()
    code, output = server.finish(signal.SIGTERM)
    assert code == 0, output
    assert "final checkpoint" in output

    restarted, address = start_server("--restore_if_exists")
    assert "restored" in "".join(restarted.output)
    learner = remote(data_spec, address)
    learner.load_replay_buffer()
    read = all_items(learner.py_client, TABLE, len(written))
    assert read.keys() == written.keys()
    for key, data in written.items():
        for a, b in zip(data, read[key], strict=True):
            np.testing.assert_array_equal(a, b)
    learner.close()
    code, output = restarted.finish(signal.SIGINT)
    assert code == 0, output


def test_a_corrupt_newest_checkpoint_is_moved_aside(start_server, tmp_path, env, policy, data_spec):
    server, address = start_server("--checkpoint_interval_s=0")
    collector = remote(data_spec, address)
    _, observer = collector.load_replay_buffer()
    collect(env, policy, observer, 30)
    first_count = collector.num_frames()
    collector.checkpoint()  # lands in the server's layout via its adoption loop
    collect(env, policy, observer, 30)
    collector.close()
    assert server.finish(signal.SIGTERM)[0] == 0
    root = tmp_path / "server_ckpt"
    newest = sorted(os.listdir(root / CHECKPOINTS_DIR))[-1]
    with open(root / CHECKPOINTS_DIR / newest / "tables.tfrecord", "wb") as f:
        f.write(b"not a tfrecord")

    restarted, address = start_server("--restore")
    learner = remote(data_spec, address)
    learner.load_replay_buffer()
    assert learner.num_frames() == first_count
    assert [n.startswith(newest) for n in os.listdir(root / CORRUPT_DIR)] == [True]
    assert any("cannot be restored" in line for line in restarted.output)
    learner.close()


def test_collector_and_learner_in_separate_processes(start_server, data_spec):
    _, address = start_server("--checkpoint_interval_s=0", config=PRIORITIZED_CONFIG)
    collector = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {os.path.join(REPO, "tests")!r})
        from conftest import collect
        from tf_agents.environments import suite_gym
        from tf_agents.policies import random_py_policy
        from replay_service import ReplayBufferManager
        from replay_service.specs.nests import trajectory_spec
        env = suite_gym.load("CartPole-v0")
        policy = random_py_policy.RandomPyPolicy(env.time_step_spec(), env.action_spec())
        with ReplayBufferManager(trajectory_spec(env), 100000, server_address={address!r},
                                 table_name="prioritized_table") as manager:
            _, observer = manager.load_replay_buffer()
            collect(env, policy, observer, 1200)
            print("collected", manager.num_frames())
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", collector],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    learner = remote(data_spec, address, table="prioritized_table")
    learner.load_replay_buffer()
    assert learner.num_frames() >= 1000  # min_size_to_sample of the prioritized config
    batch, info = next(iter(learner.get_dataset(batch_size=32, num_steps=2)))
    assert batch.observation.shape == [32, 2, 4]
    assert float(tf.reduce_min(info.probability)) > 0
    learner.close()


def test_status_reports_tables_and_last_checkpoint(start_server, tmp_path, env, policy, data_spec):
    _, address = start_server("--checkpoint_interval_s=0")
    collector = remote(data_spec, address)
    _, observer = collector.load_replay_buffer()
    collect(env, policy, observer, 20)
    count = collector.num_frames()
    collector.checkpoint()
    collector.close()
    wait_for_adoption(tmp_path / "server_ckpt")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "replay_service.cli.serve",
            "status",
            f"--address={address}",
            f"--checkpoint_dir={tmp_path / 'server_ckpt'}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"table {TABLE}: {count}/100000 items, {count} inserts, 0 samples" in result.stdout
    assert "sampler uniform, remover fifo, layout nested" in result.stdout
    assert "ckpt-00000001" in result.stdout


def test_refuses_existing_checkpoints_and_a_port_in_use(start_server):
    server, address = start_server("--checkpoint_interval_s=0")
    port = int(address.rsplit(":", 1)[1])
    busy, _ = start_server("--checkpoint_dir=/tmp/unused-dir-for-port-test", port=port, wait=False)
    code, output = busy.finish(sig=None)
    assert code == 2 and f"port {port} is already in use" in output
    assert server.finish(signal.SIGTERM)[0] == 0
    again, _ = start_server(wait=False)
    code, output = again.finish(sig=None)
    assert code == 2 and "--restore" in output and "--overwrite" in output


def test_signals_repeated_until_it_exits_still_give_exit_0(start_server, tmp_path):
    server, _ = start_server("--checkpoint_interval_s=0")
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 120
    sent = 0
    # Through the final checkpoint and the interpreter's shutdown after it.
    while server.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
        sent += 1
        with contextlib.suppress(ProcessLookupError):
            server.proc.send_signal(signal.SIGINT if sent % 3 == 0 else signal.SIGTERM)
    code, output = server.finish(sig=None)
    assert code == 0, output
    assert "replay-server stopped; final checkpoint" in output, output
    assert "already stopping" in output, output
    assert os.listdir(tmp_path / "server_ckpt" / CHECKPOINTS_DIR)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[server]\nprot = 1\n", "unknown key server.'prot'"),
        ("[table]\ncapacity = 0\n", "capacity must be a positive integer, got 0"),
        ('[table.sampling]\nsampler = "bogus"\n', "sampler must be one of"),
        ("[table\n", "not valid TOML"),
        ('[data_spec]\nenv = "NoSuchEnv-v9"\n', "NoSuchEnv-v9"),
        ('[data_spec]\nfields.observation = { dtype = "float32" }\n', "dtype = ..., shape"),
        ("[server]\nport = 70000\n", "port must be an integer in 1..65535, got 70000"),
        ("[table.sampling]\nsamples_per_insert = 4.0\nerror_buffer = 1.0\n", "error_buffer"),
    ],
)
def test_bad_configs_name_the_key_and_value(tmp_path, toml, message):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_config(path).data_spec.build(load_env)
    assert message in str(info.value)
    assert str(path) in str(info.value) or "data_spec" in str(info.value)


def test_missing_config_file_and_flag_overrides(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    config = load_config(CARTPOLE_CONFIG, server__port=9123, server__checkpoint_dir="x")
    assert (config.server.port, config.server.checkpoint_dir) == (9123, "x")
    assert config.table.sampling.sampler == "uniform"


def test_bad_config_on_the_command_line_exits_with_a_message(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[table]\ncapacity = -3\n")
    result = subprocess.run(
        [sys.executable, "-m", "replay_service.cli.serve", f"--config={path}"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert result.returncode == 2
    assert "capacity must be a positive integer, got -3" in result.stderr
    assert "Traceback" not in result.stderr


# Runs replay-server's entry point with the given arguments; at exit, prints which of the heavy
# libraries the process loaded.
_LOADED_AT_EXIT = """
import atexit, sys
atexit.register(lambda: print("loaded:", [m for m in ("tensorflow", "reverb", "torch")
                                           if m in sys.modules], file=sys.stderr))
sys.argv = ["replay-server", *sys.argv[1:]]
from replay_service.cli import run_server
run_server()
"""


def test_refusals_come_before_tensorflow_loads_and_keep_the_checkpoints(start_server, tmp_path):
    server, address = start_server("--checkpoint_interval_s=0")
    port = int(address.rsplit(":", 1)[1])
    assert server.finish(signal.SIGTERM)[0] == 0
    root = tmp_path / "server_ckpt"
    before = tree_digest(root)
    assert os.listdir(root / CHECKPOINTS_DIR)
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        # Every flag is checked before the directory is touched, so none of them takes its
        # lock or costs the checkpoints that --overwrite deletes.
        overwrite = ["--overwrite", f"--checkpoint_dir={root}"]
        cases = [
            ([*overwrite, "--metrics_port=70000"], "70000"),
            ([*overwrite, "--metrics_port=9", "--metrics_address=999.1.1.1"], "999.1.1.1"),
            ([*overwrite, f"--tensorboard_dir={tmp_path / 'tb'}", "--summary_interval_s=0"],
             "summary_interval"),
            ([*overwrite, f"--tensorboard_dir={tmp_path / 'a_file' / 'tb'}"], "a_file"),
            ([*overwrite, f"--port={taken}"], f"port {taken}"),
            ([f"--checkpoint_dir={root}", f"--port={port}"], "--overwrite"),
            ([f"--checkpoint_dir={tmp_path / 'a_file'}", f"--port={port}"], "a_file"),
            ([f"--checkpoint_dir={tmp_path / 'dangling'}", f"--port={port}"], "does not exist"),
            ([*overwrite, f"--port={port}", f"--metrics_port={port}"], "--metrics_port"),
            ([f"--checkpoint_dir={tmp_path / 'a_file'}", "--restore"], "not a directory"),
            ([f"--checkpoint_dir={tmp_path / 'none'}", "--restore"], "does not exist"),
        ]  # fmt: skip
        for args, named in cases:
            result = subprocess.run(
                [sys.executable, "-c", _LOADED_AT_EXIT, *args],
                capture_output=True,
                text=True,
                timeout=60,
                cwd=REPO,
            )
            own = [line for line in result.stderr.splitlines() if "replay-server" in line]
            assert result.returncode == 2 and len(own) == 1, (args, result.stderr)
            assert own[0].startswith("replay-server: error:") and named in own[0], (args, own)
            assert "loaded: []" in result.stderr, (args, result.stderr)
    assert tree_digest(root) == before, cases
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "dangling", "server_ckpt"]

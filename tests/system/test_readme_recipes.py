"""The recipes of README.md and docs/ run as written, with small sizes, temporary directories
and free ports.

Python blocks run with `exec` in a namespace holding what the block takes from its context (an
`agent`, an `env`); shell blocks run word for word as subprocesses, from a temporary directory
that links the repository's `.venv`, `configs` and `scripts`, so relative paths stay there.
README's "PyTorch quick start" is in test_readme_quickstart.py, the Ray recipe of
docs/operations.md in test_ray_cluster.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from conftest import REPO, ServerProcess, wait_for_adoption
from readme_blocks import DOCS, README, doc_block, readme_block, shell_commands, shrink
from replay_service import CheckpointStore, ReplayBufferManager
from replay_service.backends.reverb.connection import pick_free_port

pytest.importorskip("reverb", reason="the documents' recipes need the Reverb stack")

CONFIGURATION = DOCS / "configuration.md"
OPERATIONS = DOCS / "operations.md"
STARTER_BUFFERS = DOCS / "guide" / "starter-buffers.md"
SB3 = DOCS / "guide" / "sb3.md"


def run_python(code: str, namespace: dict[str, Any], source: Path = README) -> dict[str, Any]:
    """Runs a block of the markdown file `source` in `namespace` (what the block takes from its
    context)."""
    exec(compile(code, str(source), "exec"), namespace)
    return namespace


@pytest.fixture()
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory like a checkout's root: `.venv`, `configs`, `scripts` are links to
    the repository's; what a recipe writes under a relative path lands here."""
    work = tmp_path / "work"
    work.mkdir()
    for name in (".venv", "configs", "scripts"):
        (work / name).symlink_to(os.path.join(REPO, name))
    monkeypatch.chdir(work)
    return work


def start_command(words: list[str], cwd: Path) -> subprocess.Popen[str]:
    """Starts a documented command (to finish with `finish_command`)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.Popen(
        words, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish_command(process: subprocess.Popen[str], timeout: float = 180) -> str:
    """Waits for a started command; fails the test on a non-zero exit.

    Returns:
      Its stdout and stderr together.
    """
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = stdout + stderr
    assert process.returncode == 0, f"{process.args} exited {process.returncode}:\n{output}"
    return output


def run_command(words: list[str], cwd: Path, timeout: float = 180) -> str:
    """Runs a documented command to completion; fails the test on a non-zero exit.

    Returns:
      Its stdout and stderr together.
    """
    return finish_command(start_command(words, cwd), timeout)


class Server(ServerProcess):
    """A documented `replay-server` command in the background, its output read by a thread."""

    def __init__(self, words: list[str], cwd: Path) -> None:
        self.words = words
        super().__init__(command=words, cwd=cwd)

    def wait_listening(self) -> None:
        try:
            super().wait_listening()
        except AssertionError:
            self.proc.kill()
            raise

    def stop(self) -> str:
        """SIGTERM (the final checkpoint); fails the test unless it exits 0."""
        code, output = self.finish(signal.SIGTERM, timeout=120)
        assert code == 0, f"{self.words} exited {code}:\n{output}"
        return output


def test_readme_where_it_runs_block(user_dir: Path) -> None:
    namespace = run_python(readme_block("## Where it runs"), {})
    manager = namespace["manager"]
    try:
        manager.create_replay_buffer()
        assert manager.num_frames() == 0
    finally:
        manager.close()
    assert (user_dir / "runs/cartpole/replay").is_dir()


def test_readme_using_the_buffer_block(user_dir: Path, env: Any, policy: Any, data_spec: Any):
    from tf_agents.train import actor
    from tf_agents.train.utils import train_utils

    namespace = run_python(
        shrink(
            readme_block("## TF-Agents quick start"), {"steps_per_run=1000": "steps_per_run=50"}
        ),
        {
            "agent": SimpleNamespace(collect_data_spec=data_spec),
            "env": env,
            "policy": policy,
            "train_step": train_utils.create_train_step(),
            "actor": actor,
        },
    )
    # The block checkpoints what it collected, then clears (which checkpoints the empty table)
    # and closes.
    checkpoints = CheckpointStore("path/to/checkpoint/dir").checkpoints()
    assert [c.path for c in checkpoints][-2] == namespace["path"]
    assert checkpoints[-2].num_items > 0 and checkpoints[-1].num_items == 0
    assert namespace["dataset"] is not None
    with ReplayBufferManager(data_spec, 50000, "path/to/checkpoint/dir") as manager:
        manager.load_replay_buffer()
        assert manager.num_frames() == 0


def test_readme_options_block(user_dir: Path, data_spec: Any) -> None:
    namespace = run_python(
        doc_block(CONFIGURATION, "## Manager options"), {"data_spec": data_spec}, CONFIGURATION
    )
    manager = namespace["manager"]
    try:
        manager.create_replay_buffer()
        assert manager.num_frames() == 0
    finally:
        manager.close()
    assert (user_dir / "ckpt").is_dir()


def test_readme_replay_server_commands(user_dir: Path) -> None:
    # The block's servers listen on 8000 and 9000; here each gets a free port instead.
    block = readme_block("## Server quick start", "bash")
    # docs/operations.md repeats README's commands; both say the same.
    assert doc_block(OPERATIONS, "## replay-server", "bash") == block
    commands = shell_commands(block)
    assert len(commands) == 5, commands
    default_port, other_port = pick_free_port(), pick_free_port()
    data_dir = user_dir / "data-replay"
    for words in commands[:3]:
        assert words[:2] == [".venv/bin/replay-server", "--config=configs/default.toml"]
    new, restore, restore_if_exists = ([*words, f"--port={default_port}"] for words in commands[:3])
    other = shell_commands(
        shrink(
            " ".join(commands[3]),
            {"--port=9000": f"--port={other_port}", "/data/replay": str(data_dir)},
        )
    )[0]
    status = shell_commands(
        shrink(" ".join(commands[4]), {"localhost:8000": f"localhost:{default_port}"})
    )[0]

    server = Server(new, user_dir)
    # The fourth command's server (its own port and directory) starts alongside the first
    # (each spends seconds importing TensorFlow); it is stopped while the third one runs.
    side = Server(other, user_dir)
    try:
        server.wait_listening()
        assert "checkpoint" in server.stop()  # the final checkpoint of the new buffer
        first = CheckpointStore(str(user_dir / "replay_checkpoints")).entries()
        assert len(first) == 1

        server = Server(restore, user_dir)
        server.wait_listening()
        server.stop()
        server = Server(restore_if_exists, user_dir)
        server.wait_listening()
        try:
            report = run_command(status, user_dir, timeout=120)
            assert "uniform_table" in report and "checkpoint" in report
            side.wait_listening()
            side.stop()
            assert CheckpointStore(str(data_dir)).entries()
        finally:
            server.stop()
    finally:
        if side.proc.poll() is None:
            side.proc.kill()
            side.proc.wait()


def test_readme_starter_buffer_commands(user_dir: Path) -> None:
    small = {"--steps-per-run 672 --num-runs 10": "--steps-per-run 8 --num-runs 2"}
    populate, populate_script, help_ = (
        shell_commands(shrink(" ".join(words), small))[0] if "672" in words else words
        for words in shell_commands(doc_block(STARTER_BUFFERS, "# Starter buffers", "bash"))
    )
    help_run = start_command(help_, user_dir)  # alongside the first run (writes nothing)
    run_command(populate, user_dir)
    buffer = user_dir / "starter_buffers/my-starter-buffer"
    assert CheckpointStore(str(buffer)).entries()
    run_command(populate_script, user_dir)  # --overwrite
    assert "--buffer-name" in finish_command(help_run)

    (copy,) = shell_commands(doc_block(STARTER_BUFFERS, "## Training from a copy", "bash"))
    run_command(copy, user_dir)
    assert CheckpointStore(str(user_dir / "runs/exp1/replay")).entries()

    # The same copy in Python, into a new directory.
    from replay_service.starter import make_envs_and_policies, starter_data_spec

    envs, policies = make_envs_and_policies("building", "schedule", 1, seed=0)
    data_spec = starter_data_spec(envs[0], policies[0])
    namespace = run_python(
        shrink(
            doc_block(STARTER_BUFFERS, "## Training from a copy"),
            {'"runs/exp1/replay"': '"runs/exp2"'},
        ),
        {"agent": SimpleNamespace(collect_data_spec=data_spec)},
        STARTER_BUFFERS,
    )
    manager = namespace["manager"]
    try:
        copied = manager.num_frames()
    finally:
        manager.close()
    stored = CheckpointStore(str(buffer)).read_metadata()
    with ReplayBufferManager(data_spec, stored.capacity, str(buffer)) as source:
        source.load_replay_buffer()
        assert copied == source.num_frames() > 0


def test_readme_sharding_block(
    user_dir: Path, data_spec: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    # configs/sharded.toml's servers, as its comment starts them, on free ports.
    ports = [pick_free_port(), pick_free_port()]
    starts = [
        shell_commands(line.lstrip("# ").replace("replay-server", ".venv/bin/replay-server"))[0]
        for line in (user_dir / "configs/sharded.toml").read_text().splitlines()
        if line.startswith("#   replay-server")
    ]
    assert len(starts) == 2, starts
    sharded = user_dir / "sharded.toml"
    sharded.write_text(f"[sharding]\naddresses = {[f'localhost:{p}' for p in ports]!r}\n")
    servers = []
    try:
        for words, port, default in zip(starts, ports, (8010, 8011), strict=True):
            servers.append(Server([w.replace(str(default), str(port)) for w in words], user_dir))
        for server in servers:
            server.wait_listening()
        namespace = run_python(
            shrink(
                doc_block(OPERATIONS, "## Sharding"),
                {'"configs/sharded.toml"': repr(str(sharded))},
            ),
            {"data_spec": data_spec, "collector_id": 1},
            OPERATIONS,
        )
        record = namespace["record"]
        assert set(record.paths) == {f"localhost:{port}" for port in ports}
        for i in range(2):  # each server moves the block's checkpoint into its own directory
            wait_for_adoption(user_dir / f"replay_shard{i}")
    finally:
        for server in servers:
            if server.proc.poll() is None:
                server.stop()
    printed = capsys.readouterr().out  # the block prints the status of every shard
    assert all(f"localhost:{port}" in printed for port in ports), printed


def test_readme_stable_baselines3_block(user_dir: Path) -> None:
    pytest.importorskip("stable_baselines3", reason="needs the sb3 extra")
    namespace = run_python(
        shrink(doc_block(SB3, "# Stable-Baselines3"), {"model.learn(20_000)": "model.learn(300)"}),
        {},
        SB3,
    )
    buffer = namespace["model"].replay_buffer
    try:
        assert buffer.size() > 0
    finally:
        buffer.close()
    assert (user_dir / "buffer.pkl").is_file()
    assert CheckpointStore(str(user_dir / "runs/exp1/replay")).is_store()

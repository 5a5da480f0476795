"""Faults against real Reverb servers: a full disk, damaged checkpoints, signals, kill -9.

Each test states one guarantee and fails if it breaks. `make test` runs the fast cases;
`make test-slow` (the `slow` marker) repeats the kill and SIGTERM runs many more times.

The collector subprocess the SIGTERM and kill -9 tests drive is `tests/_collector.py`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import _collector
from _collector import COLLECTOR_THREADS, EMBEDDED_INTERVAL_S, remote_manager, step
from conftest import CARTPOLE_CONFIG, FAST_TIMEOUTS, REPO, all_items, tree_digest, wait_for
from replay_service import ReplayBufferManager
from replay_service.backends.reverb.connection import check_port_free, pick_free_port
from replay_service.backends.reverb.internals import (
    SAVE_SETTLE_S,
    is_concurrent_save_error,
    retry_concurrent_save,
)
from replay_service.backends.reverb.server import CheckpointedServer
from replay_service.config.options import TableConfig
from replay_service.errors import CheckpointError, CheckpointExistsError, NoCheckpointError
from replay_service.starter.envs import load_env
from replay_service.storage.directory import (
    CHECKPOINT_META_FILE,
    CHECKPOINTS_DIR,
    CORRUPT_DIR,
    LOCK_FILE,
    REVERB_DIR,
)
from replay_service.storage.files import DONE_FILE
from replay_service.storage.store import CheckpointStore

BLOCK = 4096
CAPACITY = 1000
START_TIMEOUT_S = 60
# Wall-clock bound on a stop with a final checkpoint (a few thousand items take well under 1 s).
STOP_TIMEOUT_S = 60


# ---------------------------------------------------------------------------------- helpers


def write_steps(observer: Any, first: int, count: int) -> None:
    """Writes steps `first .. first + count - 1` and waits until they are confirmed."""
    for counter in range(first, first + count):
        observer(step(counter))
    observer.flush()


def item_ids(manager: ReplayBufferManager, expected: int) -> list[int]:
    """The sorted ids (last step's action) of every item of the manager's uniform table."""
    if expected == 0:
        return []
    items = all_items(manager.py_client, manager.table_name, expected)
    return sorted(int(data[2][1]) for data in items.values())


def checkpoint_dirs(root: Path) -> list[str]:
    """Names of the directories under `root/checkpoints/`."""
    path = root / CHECKPOINTS_DIR
    return sorted(p.name for p in path.iterdir()) if path.exists() else []


def recorded_items(checkpoint: Path) -> int:
    """The item count recorded in a checkpoint's metadata file."""
    return int(json.loads((checkpoint / CHECKPOINT_META_FILE).read_text())["num_items"])


def newest_checkpoint(root: Path) -> Path | None:
    """The newest directory under `root/checkpoints/`, or None."""
    names = checkpoint_dirs(root)
    return root / CHECKPOINTS_DIR / names[-1] if names else None


def free_bytes(path: Path) -> int:
    """Bytes free for writing on the file system holding `path`."""
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


class Tmpfs:
    """A small tmpfs mounted for one test, with a ballast file that sets its free space."""

    def __init__(self, mount_point: Path) -> None:
        self.path = mount_point
        self.ballast = mount_point / "ballast"

    def leave_free(self, free: int) -> None:
        """Grows or shrinks the ballast file so that about `free` bytes (whole blocks) are free."""
        self.release()
        to_fill = free_bytes(self.path) - free
        if to_fill <= 0:
            return
        with open(self.ballast, "wb") as f:
            chunk = b"\0" * (64 * BLOCK)
            with contextlib.suppress(OSError):
                while to_fill > 0:
                    f.write(chunk[: min(len(chunk), to_fill)])
                    f.flush()
                    to_fill -= min(len(chunk), to_fill)
        assert free_bytes(self.path) <= free + BLOCK, "the ballast did not fill the tmpfs"

    def fill(self) -> None:
        """Leaves no free block at all."""
        self.leave_free(0)

    def release(self) -> None:
        """Deletes the ballast file."""
        with contextlib.suppress(FileNotFoundError):
            self.ballast.unlink()


@pytest.fixture()
def make_tmpfs(tmp_path: Path) -> Iterator[Callable[[int], Tmpfs]]:
    """Mounts tmpfs file systems of a given size (bytes); unmounts them at teardown.

    Skips the test when this process may not mount (not root, or no CAP_SYS_ADMIN).
    """
    mounted: list[Path] = []

    def mount(size: int) -> Tmpfs:
        point = tmp_path / f"tmpfs{len(mounted)}"
        point.mkdir()
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            pytest.skip(
                "a full disk needs a small tmpfs, and mount was refused here "
                f"({result.stderr.strip() or result.returncode}); run as root to cover it"
            )
        mounted.append(point)
        return Tmpfs(point)

    yield mount
    for point in reversed(mounted):
        if subprocess.run(["umount", str(point)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(point)], capture_output=True)


def checkpoint_blocks(path: Path) -> int:
    """Blocks a checkpoint's files take on a tmpfs (each file rounds up to whole blocks)."""
    return sum(-(-p.stat().st_size // BLOCK) for p in path.iterdir() if p.is_file())


# ------------------------------------------------------------------ 1. a full disk (embedded)


def test_a_checkpoint_on_a_full_disk_fails_cleanly_at_every_free_space_level(
    make_manager, make_tmpfs, tmp_path, caplog
):
    # How many blocks a checkpoint of the full buffer takes, measured on a normal disk with the
    # same writes.
    reference = make_manager(checkpoint_dir=str(tmp_path / "reference"))
    _, observer = reference.create_replay_buffer()
    write_steps(observer, 0, 51)
    write_steps(observer, 51, CAPACITY)
    full_blocks = checkpoint_blocks(Path(reference.checkpoint()))
    reference.close()

    disk = make_tmpfs(4 * full_blocks * BLOCK)
    root = disk.path / "ckpt"
    manager = make_manager(checkpoint_dir=str(root), keep_checkpoints=2)
    _, observer = manager.create_replay_buffer()
    write_steps(observer, 0, 51)
    good = Path(manager.checkpoint())
    good_digest = tree_digest(good)
    write_steps(observer, 51, CAPACITY)
    assert manager.num_frames() == CAPACITY

    # From no free block at all, then block by block from 8 short of the measured size until a
    # checkpoint fits: Reverb fails part way, or it finishes (writing DONE after a truncated
    # file, or complete files) and the verification or the metadata file fails. The exact size
    # on the tmpfs differs from the measured one by about a block from run to run, hence the
    # sweep up to the first level that fits rather than fixed levels.
    levels = [0, 1, 2, full_blocks // 2, *range(full_blocks - 8, full_blocks + 8)]
    messages = []
    fitted: Path | None = None
    for blocks in levels:
        disk.leave_free(blocks * BLOCK)
        try:
            fitted = Path(manager.checkpoint())
            break
        except CheckpointError as e:
            error = e
        message = str(error)
        messages.append(message)
        assert not isinstance(error, (IndexError, OSError)), message
        assert str(root) in message, f"{blocks} free blocks: the error names no path: {message}"
        assert checkpoint_dirs(root) == [good.name], f"{blocks} free blocks: {message}"
        assert tree_digest(good) == good_digest, "the previous good checkpoint was touched"
        assert not os.listdir(root / REVERB_DIR), "a failed checkpoint left files behind"
        assert manager.num_frames() == CAPACITY, "the buffer lost items"
    assert fitted is not None, ("no level let a checkpoint fit", full_blocks, messages)
    assert blocks > full_blocks - 8, ("a checkpoint fit well below its size", blocks, full_blocks)
    assert any("No space left on device" in m for m in messages), messages
    assert any("truncated" in m or "cannot move checkpoint" in m for m in messages), (
        "no level let Reverb finish a checkpoint that then failed verification or adoption",
        messages,
    )
    # The one that fit is complete and verified; the earlier one is untouched beside it.
    assert recorded_items(fitted) == CAPACITY
    assert checkpoint_dirs(root) == [good.name, fitted.name]
    assert tree_digest(good) == good_digest
    manager.close()
    shutil.rmtree(fitted)  # so that the next load must restore the earlier one

    # The previous good checkpoint restores with every item; space back, checkpoints work.
    loaded = make_manager(checkpoint_dir=str(root), keep_checkpoints=1)
    _, observer = loaded.load_replay_buffer()
    assert item_ids(loaded, 50) == list(range(1, 51))
    write_steps(observer, 1000, CAPACITY + 1)
    disk.fill()
    with pytest.raises(CheckpointError):
        loaded.checkpoint()
    disk.release()
    after = Path(loaded.checkpoint())
    assert recorded_items(after) == CAPACITY
    assert checkpoint_dirs(root) == [after.name], "keep_checkpoints=1 retains the new one only"
    loaded.close()
    again = make_manager(checkpoint_dir=str(root), keep_checkpoints=1)
    again.load_replay_buffer()
    assert item_ids(again, CAPACITY) == list(range(1001, 1001 + CAPACITY))


def test_the_periodic_checkpoint_thread_survives_a_full_disk_and_resumes(
    make_manager, make_tmpfs, caplog
):
    disk = make_tmpfs(1 << 20)
    root = disk.path / "ckpt"
    manager = make_manager(checkpoint_dir=str(root), checkpoint_interval_s=0.5)
    _, observer = manager.create_replay_buffer()
    write_steps(observer, 0, 51)
    wait_for(lambda: bool(checkpoint_dirs(root)), 10, "the first periodic checkpoint")
    write_steps(observer, 51, CAPACITY)
    disk.fill()
    before = checkpoint_dirs(root)
    with caplog.at_level(logging.ERROR, logger="replay_service.backends.reverb.server"):
        wait_for(
            lambda: sum("periodic checkpoint failed" in r.message for r in caplog.records) >= 3,
            20,
            "three failed periodic checkpoints",
        )
    failures = [r.message for r in caplog.records if "periodic checkpoint failed" in r.message]
    assert all(str(root) in message for message in failures), failures
    assert all(checkpoint_dirs(root)[i] in before for i in range(len(checkpoint_dirs(root))))
    assert any(t.name == "replay-checkpoints" for t in threading.enumerate())
    disk.release()

    def caught_up() -> bool:
        newest = newest_checkpoint(root)
        return newest is not None and recorded_items(newest) == CAPACITY

    wait_for(caught_up, 20, "a periodic checkpoint of the full buffer after space came back")
    manager.close()


def _server_env() -> dict[str, str]:
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)


class Server:
    """A `replay-server` subprocess in its own process group, stdout and stderr kept apart."""

    def __init__(self, *args: str, port: int | None = None) -> None:
        self.port = port or pick_free_port()
        self.address = f"localhost:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "replay_service.cli.serve", f"--port={self.port}", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=_server_env(),
            start_new_session=True,
        )
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.stdout), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.stderr), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream: Any, lines: list[str]) -> None:
        for line in stream:
            lines.append(line)

    def wait_for_line(self, prefix: str, timeout: float = START_TIMEOUT_S) -> None:
        """Waits until stdout has a line starting with `prefix`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(line.startswith(prefix) for line in self.stdout):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        raise AssertionError(f"no line {prefix!r} from the server:\n{self.output()}")

    def wait_listening(self) -> None:
        """Waits until the server listens."""
        self.wait_for_line("replay-server listening on port")

    def wait(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """Waits for the exit; returns its status (fails the test on a timeout)."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"the server did not exit within {timeout} s:\n{self.output()}"
            ) from None
        for reader in self._readers:
            reader.join(timeout=10)
        return code

    def output(self) -> str:
        """Everything the server printed so far."""
        return "".join(self.stdout) + "".join(self.stderr)

    def error_lines(self) -> list[str]:
        """Lines of stderr written by replay-server itself (not TF, Reverb, gRPC or absl logs)."""
        return [line for line in self.stderr if line.startswith("replay-server")]

    def kill(self) -> None:
        """SIGKILLs the whole process group if it still runs."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture()
def servers() -> Iterator[Callable[..., Server]]:
    """Starts `replay-server` subprocesses; kills whatever still runs at teardown."""
    started: list[Server] = []

    def start(*args: str, port: int | None = None, wait: bool = True) -> Server:
        server = Server(*args, port=port)
        started.append(server)
        if wait:
            server.wait_listening()
        return server

    yield start
    for server in started:
        server.kill()


def restore_in_process(root: Path) -> Any:
    """Restores `root` with the CartPole config in this process; returns the running owner."""
    from replay_service.backends.reverb.server import serve_config
    from replay_service.config.files import load_config

    config = load_config(
        CARTPOLE_CONFIG, server__checkpoint_dir=str(root), server__port=pick_free_port()
    )
    return serve_config(config, config.data_spec.build(load_env), restore=True)


def restored_count(root: Path) -> int:
    """Items a restore of `root` holds (the CartPole config's table)."""
    from replay_service.backends.reverb.connection import server_info

    owner = restore_in_process(root)
    try:
        assert owner.restored_from is not None
        count = int(server_info(owner.client, 10)["uniform_table"].current_size)
        assert count == owner.restored_from.num_items
        return count
    finally:
        owner.stop()


def test_replay_server_stopped_on_a_full_disk_exits_with_one_line_and_keeps_the_last_checkpoint(
    servers, make_tmpfs, data_spec
):
    disk = make_tmpfs(1 << 20)
    root = disk.path / "ckpt"
    server = servers(f"--config={CARTPOLE_CONFIG}", f"--checkpoint_dir={root}")
    manager = remote_manager(data_spec, server.address)
    _, observer = manager.create_replay_buffer()
    write_steps(observer, 0, 51)
    manager.checkpoint()
    wait_for(
        lambda: (c := newest_checkpoint(root)) is not None and recorded_items(c) == 50,
        30,
        "the server to adopt the checkpoint of 50 items",
    )
    write_steps(observer, 51, 3000)
    manager.close()
    disk.fill()
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait() != 0, server.output()
    errors = server.error_lines()
    assert len(errors) == 1, f"expected one line on stderr:\n{''.join(server.stderr)}"
    assert errors[0].startswith("replay-server: error: final checkpoint failed"), errors
    assert str(root) in errors[0], errors
    assert "Traceback" not in server.output(), server.output()
    disk.release()
    assert restored_count(root) == 50


# -------------------------------------------------------- 2. damaged files in the newest checkpoint

OLD_ITEMS = 30
NEW_ITEMS = 60


def _truncate(name: str, fraction: float | None = None, keep: int | None = None) -> Any:
    def damage(path: Path) -> None:
        target = path / name
        data = target.read_bytes()
        size = keep if keep is not None else int(len(data) * (fraction or 0.0))
        target.write_bytes(data[: max(0, min(size, len(data) - 1))] if size >= 0 else b"")

    return damage


def _cut_last(name: str) -> Any:
    def damage(path: Path) -> None:
        target = path / name
        target.write_bytes(target.read_bytes()[:-1])

    return damage


def _delete(name: str) -> Any:
    def damage(path: Path) -> None:
        (path / name).unlink()

    return damage


def _empty(name: str) -> Any:
    def damage(path: Path) -> None:
        (path / name).write_bytes(b"")

    return damage


def _flip(name: str, fraction: float) -> Any:
    def damage(path: Path) -> None:
        target = path / name
        data = bytearray(target.read_bytes())
        data[min(len(data) - 1, int(len(data) * fraction))] ^= 0x01
        target.write_bytes(bytes(data))

    return damage


DAMAGE = {
    "metadata truncated": _truncate(CHECKPOINT_META_FILE, 0.5),
    "metadata deleted": _delete(CHECKPOINT_META_FILE),
    "DONE deleted": _delete("DONE"),
    "chunks missing": _delete("chunks.tfrecord"),
    "items missing": _delete("items.tfrecord"),
    "chunks empty": _empty("chunks.tfrecord"),
    "items empty": _empty("items.tfrecord"),
    "chunks cut to 1 byte": _truncate("chunks.tfrecord", keep=1),
    "chunks cut in half": _truncate("chunks.tfrecord", 0.5),
    "chunks short by 1 byte": _cut_last("chunks.tfrecord"),
    "items cut in half": _truncate("items.tfrecord", 0.5),
    "items short by 1 byte": _cut_last("items.tfrecord"),
    "tables cut in half": _truncate("tables.tfrecord", 0.5),
    "chunks byte flipped": _flip("chunks.tfrecord", 0.5),
    "items byte flipped": _flip("items.tfrecord", 0.3),
    "tables byte flipped": _flip("tables.tfrecord", 0.9),
}
ONLY_CHECKPOINT_DAMAGE = ["metadata deleted", "DONE deleted", "chunks cut in half"]


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> Path:
    """A store with ckpt-1 (items 1..30) and ckpt-2 (items 1..60), built once per module."""
    from tf_agents.environments import suite_gym
    from tf_agents.policies import random_py_policy

    from replay_service.specs.nests import collect_data_spec

    env = suite_gym.load("CartPole-v0")
    spec = collect_data_spec(
        env, random_py_policy.RandomPyPolicy(env.time_step_spec(), env.action_spec())
    )
    root = tmp_path_factory.mktemp("damaged") / "base"
    with ReplayBufferManager(spec, CAPACITY, str(root), timeouts=FAST_TIMEOUTS) as manager:
        _, observer = manager.create_replay_buffer()
        write_steps(observer, 0, OLD_ITEMS + 1)
        manager.checkpoint()
        write_steps(observer, OLD_ITEMS + 1, NEW_ITEMS - OLD_ITEMS)
        manager.checkpoint()
    assert checkpoint_dirs(root) == ["ckpt-00000001", "ckpt-00000002"]
    return root


def file_contents(root: Path) -> list[str]:
    """Digests of every file under `root` but the lock, wherever it lies (a move keeps them)."""
    return sorted(v for k, v in tree_digest(root).items() if v != "dir" and k != LOCK_FILE)


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_newest_checkpoint_is_moved_aside_and_the_previous_one_restores(
    damage, two_checkpoints, make_manager, tmp_path, caplog
):
    root = tmp_path / "ckpt"
    shutil.copytree(two_checkpoints, root)
    DAMAGE[damage](root / CHECKPOINTS_DIR / "ckpt-00000002")

    with caplog.at_level(logging.WARNING):
        manager = make_manager(checkpoint_dir=str(root))
        manager.load_replay_buffer()
    warnings = " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert "ckpt-00000002" in warnings and "ckpt-00000001" in warnings, warnings
    moved = [p.name for p in (root / CORRUPT_DIR).iterdir()]
    assert len(moved) == 1 and moved[0].startswith("ckpt-00000002-"), moved
    assert manager.num_frames() == recorded_items(root / CHECKPOINTS_DIR / "ckpt-00000001")
    assert item_ids(manager, OLD_ITEMS) == list(range(1, OLD_ITEMS + 1))

    # Checkpoints go on: no sequence-number collision with the checkpoint moved aside.
    path = Path(manager.checkpoint())
    assert recorded_items(path) == OLD_ITEMS
    manager.close()
    again = make_manager(checkpoint_dir=str(root))
    again.load_replay_buffer()
    assert again.num_frames() == OLD_ITEMS
    again.close()


def only_damaged_checkpoint(two_checkpoints: Path, root: Path, damage: str) -> None:
    """Copies the store keeping ckpt-1 only, and damages it."""
    shutil.copytree(two_checkpoints, root)
    shutil.rmtree(root / CHECKPOINTS_DIR / "ckpt-00000002")
    DAMAGE[damage](root / CHECKPOINTS_DIR / "ckpt-00000001")


@pytest.mark.parametrize("damage", ONLY_CHECKPOINT_DAMAGE)
def test_a_damaged_only_checkpoint_is_never_replaced_by_an_empty_buffer(
    damage, two_checkpoints, make_manager, tmp_path
):
    root = tmp_path / "ckpt"
    only_damaged_checkpoint(two_checkpoints, root, damage)
    before = file_contents(root)

    with pytest.raises(CheckpointExistsError):
        make_manager(checkpoint_dir=str(root)).create_replay_buffer()
    assert file_contents(root) == before, "a refused create changed the directory"
    with pytest.raises(NoCheckpointError) as raised:
        make_manager(checkpoint_dir=str(root)).load_replay_buffer()
    assert "ckpt-00000001" in str(raised.value)
    assert file_contents(root) == before, "a failed load deleted data"
    # The damaged checkpoint now lies in corrupt/: starting anew still needs overwrite=True.
    with pytest.raises(CheckpointExistsError):
        make_manager(checkpoint_dir=str(root)).create_replay_buffer()
    assert file_contents(root) == before


def small_config(tmp_path: Path) -> str:
    """The CartPole config with the capacity of the managers here (CAPACITY)."""
    text = Path(CARTPOLE_CONFIG).read_text().replace("capacity = 100000", f"capacity = {CAPACITY}")
    path = tmp_path / "small.toml"
    path.write_text(text)
    return str(path)


def test_replay_server_restore_if_exists_refuses_a_damaged_only_checkpoint(
    servers, two_checkpoints, tmp_path
):
    root = tmp_path / "ckpt"
    only_damaged_checkpoint(two_checkpoints, root, "chunks cut in half")
    before = file_contents(root)
    for attempt in range(2):  # a supervisor restarting it must not get an empty buffer either
        server = servers(
            f"--config={small_config(tmp_path)}",
            f"--checkpoint_dir={root}",
            "--restore_if_exists",
            wait=False,
        )
        assert server.wait() != 0, f"attempt {attempt}: started:\n{server.output()}"
        lines = server.error_lines()
        assert len(lines) == 1 and "ckpt-00000001" in lines[0], server.output()
        assert "Traceback" not in server.output()
        assert file_contents(root) == before, "the server deleted data"


# ------------------------------------------------------------------------- 6. smaller holes


def test_a_lock_file_that_is_a_symbolic_link_is_refused_and_its_target_untouched(
    make_manager, tmp_path
):
    target = tmp_path / "precious"
    target.write_text("do not touch")
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / LOCK_FILE).symlink_to(target)
    with pytest.raises(CheckpointError, match="symbolic link"):
        make_manager(checkpoint_dir=str(root)).create_replay_buffer()
    assert target.read_text() == "do not touch"
    assert (root / LOCK_FILE).is_symlink()


def test_a_checkpoint_after_the_directory_was_deleted_is_real_or_raises(make_manager, tmp_path):
    root = tmp_path / "ckpt"
    manager = make_manager(checkpoint_dir=str(root))
    _, observer = manager.create_replay_buffer()
    write_steps(observer, 0, 41)
    manager.checkpoint()
    shutil.rmtree(root)
    try:
        path = manager.checkpoint()
    except CheckpointError:
        path = None
    manager.close()
    if path is not None:
        assert Path(path).is_dir()
        loaded = make_manager(checkpoint_dir=str(root))
        loaded.load_replay_buffer()
        assert item_ids(loaded, 40) == list(range(1, 41))


def test_create_with_overwrite_keeps_files_a_user_placed_under_checkpoints(make_manager, tmp_path):
    root = tmp_path / "ckpt"
    manager = make_manager(checkpoint_dir=str(root))
    _, observer = manager.create_replay_buffer()
    write_steps(observer, 0, 11)
    manager.checkpoint()
    manager.close()
    (root / CHECKPOINTS_DIR / "notes.txt").write_text("mine")
    (root / CHECKPOINTS_DIR / "ckpt-backup").mkdir()
    (root / CHECKPOINTS_DIR / "ckpt-backup" / "data").write_text("mine too")
    make_manager(checkpoint_dir=str(root)).create_replay_buffer(overwrite=True)
    assert (root / CHECKPOINTS_DIR / "notes.txt").read_text() == "mine"
    assert (root / CHECKPOINTS_DIR / "ckpt-backup" / "data").read_text() == "mine too"
    assert "ckpt-00000001" not in checkpoint_dirs(root)


def test_items_cleared_on_a_remote_server_do_not_come_back_after_kill_9(
    servers, data_spec, tmp_path
):
    root = tmp_path / "server_ckpt"
    port = pick_free_port()
    server = servers(f"--config={CARTPOLE_CONFIG}", f"--checkpoint_dir={root}", port=port)
    manager = remote_manager(data_spec, server.address)
    _, observer = manager.create_replay_buffer()
    write_steps(observer, 0, 101)
    manager.checkpoint()
    wait_for(
        lambda: (c := newest_checkpoint(root)) is not None and recorded_items(c) == 100,
        30,
        "the server to adopt the checkpoint of 100 items",
    )
    manager.clear()
    server.kill()
    manager.close()
    restarted = servers(
        f"--config={CARTPOLE_CONFIG}", f"--checkpoint_dir={root}", "--restore", port=port
    )
    after = remote_manager(data_spec, restarted.address)
    after.load_replay_buffer()
    assert after.num_frames() == 0, "cleared items came back after a restart"
    after.close()


# ------------------------------------------ 7. client checkpoints racing the server's own moves


@pytest.fixture()
def bare_server(tmp_path: Path, data_spec: Any) -> Iterator[CheckpointedServer]:
    """A running server owner without its schedule: the test decides when it adopts."""
    store = CheckpointStore(str(tmp_path / "ckpt"))
    server = CheckpointedServer.create([TableConfig()], data_spec, store, checkpoint_timeout=60.0)
    try:
        yield server
    finally:
        server.stop()


def test_a_client_checkpoint_is_adopted_only_once_its_save_surely_returned(bare_server):
    # Reverb's save lists and cleans its root after writing DONE; moving the new directory
    # in that moment failed the client's save with "<path> not found" (seen in the suite).
    path = bare_server.client.checkpoint()  # what a remote client's checkpoint() asks for
    done = os.path.join(path, DONE_FILE)
    now = time.time()
    os.utime(done, (now, now))  # as if the save wrote DONE just now
    assert bare_server.adopt_staged() == []
    assert os.path.isfile(done), "a just-finished checkpoint was moved"
    before = now - SAVE_SETTLE_S - 0.5
    os.utime(done, (before, before))
    adopted = bare_server.adopt_staged()
    assert [c.info["reverb_name"] for c in adopted] == [os.path.basename(path)]
    assert not os.path.exists(path)
    assert bare_server.last_checkpoint == adopted[0]


def test_a_client_save_that_loses_a_race_in_reverbs_cleanup_is_asked_for_again(bare_server):
    # Reverb deletes every older entry of its root after a save; an entry that vanishes between
    # its listing and its deletion fails the save. A dangling link vanishes that way every time.
    root = Path(bare_server.store.reverb_root)
    root.mkdir(parents=True, exist_ok=True)
    racing = root / "0000-moved-away"
    racing.symlink_to(root / "gone")
    client = bare_server.client
    with pytest.raises(RuntimeError) as raised:
        client.checkpoint()
    assert is_concurrent_save_error(raised.value), str(raised.value)
    assert str(racing) in str(raised.value)

    calls = []

    def save() -> str:
        calls.append(1)
        try:
            return client.checkpoint()
        finally:
            racing.unlink(missing_ok=True)  # the racing entry is gone by the second call

    path = retry_concurrent_save(save)
    assert len(calls) == 2
    assert os.path.isfile(os.path.join(path, DONE_FILE))

    failed = []

    def full_disk() -> str:
        failed.append(1)
        raise RuntimeError("chunks.tfrecord; No space left on device")

    with pytest.raises(RuntimeError, match="No space left"):
        retry_concurrent_save(full_disk)
    assert len(failed) == 1, "an error other than a lost race was asked for again"


# ---------------------------------------------------- collector subprocesses (_collector.py)


class Collector:
    """`_collector.py` run as a collector subprocess."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(_collector.__file__), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
            env=_server_env(),
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_collecting(self) -> None:
        wait_for(
            lambda: "collecting\n" in self.lines or self.proc.poll() is not None,
            START_TIMEOUT_S,
            "the collector to start",
        )
        assert self.proc.poll() is None, "".join(self.lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture()
def collectors() -> Iterator[Callable[..., Collector]]:
    """Starts collector subprocesses; kills whatever still runs at teardown."""
    started: list[Collector] = []

    def start(*args: str) -> Collector:
        collector = Collector(*args)
        started.append(collector)
        return collector

    yield start
    for collector in started:
        collector.kill()


def report(figure: str) -> None:
    """Prints a measured figure (shown with `pytest -s`)."""
    sys.stderr.write(f"FIGURE {figure}\n")


# ------------------------------------------------------------------------ 3. SIGTERM under load


def fifo_config(tmp_path: Path) -> str:
    """The CartPole config as a queue: each item is sampled once, oldest first, then removed."""
    text = (
        Path(CARTPOLE_CONFIG)
        .read_text()
        .replace('remover = "fifo"', 'remover = "fifo"\nmax_times_sampled = 1')
    )
    text = text.replace('sampler = "uniform"', 'sampler = "fifo"')
    path = tmp_path / "fifo.toml"
    path.write_text(text)
    return str(path)


def drain_ids(config: str, root: Path) -> list[int]:
    """Restores `root` in this process and takes every item out; returns their ids."""
    from replay_service.backends.reverb.connection import server_info
    from replay_service.backends.reverb.server import serve_config
    from replay_service.config.files import load_config

    loaded = load_config(config, server__checkpoint_dir=str(root), server__port=pick_free_port())
    owner = serve_config(loaded, loaded.data_spec.build(load_env), restore=True)
    try:
        count = int(server_info(owner.client, 10)["uniform_table"].current_size)
        assert owner.restored_from is not None and count == owner.restored_from.num_items
        ids = (
            [
                int(sample.data[2][1])
                for sample in owner.client.sample(
                    "uniform_table", num_samples=count, emit_timesteps=False
                )
            ]
            if count
            else []
        )
        assert len(set(ids)) == count, "an item was taken twice"
        return ids
    finally:
        owner.stop()


def run_sigterm_under_load(servers, collectors, tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    root = tmp_path / f"load{seed}"
    config = fifo_config(tmp_path)
    server = servers(f"--config={config}", f"--checkpoint_dir={root}", "--checkpoint_interval_s=0")
    out = tmp_path / f"collected{seed}.json"
    collector = collectors("collect", server.address, str(COLLECTOR_THREADS), str(out))
    collector.wait_collecting()
    time.sleep(rng.uniform(0.5, 2.0))
    sent = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    code = server.wait()
    stop_s = time.monotonic() - sent
    assert code == 0, server.output()
    collector.proc.wait(timeout=60)
    results = json.loads(out.read_text())
    assert len(results) == COLLECTOR_THREADS and all(r["error"] for r in results), results

    kept = set(drain_ids(config, root))
    confirmed = lost = in_flight = 0
    for r in results:
        ids = range(r["first"] + 1, r["confirmed"] + 1)
        confirmed += len(ids)
        lost += sum(i not in kept for i in ids)
        in_flight += r["written"] - r["confirmed"]
    report(
        f"SIGTERM under load (seed {seed}): {confirmed} confirmed, {lost} confirmed-then-lost, "
        f"{in_flight} steps in flight, {len(kept)} items restored, stop took {stop_s:.2f} s"
    )
    assert confirmed > 0, results
    assert lost == 0, f"{lost} confirmed items were lost: {results}"


def test_sigterm_under_load_loses_no_confirmed_item(servers, collectors, tmp_path):
    run_sigterm_under_load(servers, collectors, tmp_path, seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 9))
def test_sigterm_under_load_loses_no_confirmed_item_soak(servers, collectors, tmp_path, seed):
    run_sigterm_under_load(servers, collectors, tmp_path, seed)


# ------------------------------------------------------------------------ 4. repeated signals


# `make test` runs the process-group case (what a supervisor or a terminal's Ctrl-C sends);
# signals repeated to the process alone, SIGTERM and SIGINT mixed, are also covered there by
# tests/system/cli/test_server.py::test_signals_repeated_until_it_exits_still_give_exit_0.
@pytest.mark.parametrize(
    ("first", "second", "group"),
    [
        pytest.param(signal.SIGTERM, signal.SIGTERM, False, marks=pytest.mark.slow),
        pytest.param(signal.SIGTERM, signal.SIGINT, False, marks=pytest.mark.slow),
        (signal.SIGTERM, signal.SIGTERM, True),
    ],
    ids=["SIGTERM twice", "SIGTERM then SIGINT", "SIGTERM twice to the process group"],
)
def test_repeated_signals_still_end_with_a_final_checkpoint_that_restores(
    servers, data_spec, tmp_path, first, second, group
):
    root = tmp_path / "ckpt"
    server = servers(f"--config={CARTPOLE_CONFIG}", f"--checkpoint_dir={root}")
    manager = remote_manager(data_spec, server.address)
    _, observer = manager.create_replay_buffer()
    write_steps(observer, 0, 3001)
    manager.close()

    def send(sig: int) -> None:
        if group:
            os.killpg(server.proc.pid, sig)
        else:
            server.proc.send_signal(sig)

    sent = time.monotonic()
    send(first)
    server.wait_for_line("replay-server: stopping", timeout=10)
    send(second)
    send(second)
    code = server.wait(timeout=STOP_TIMEOUT_S)
    report(
        f"repeated signals ({'group' if group else 'pid'}): stop took "
        f"{time.monotonic() - sent:.2f} s"
    )
    assert code == 0, server.output()
    assert any(line.startswith("replay-server stopped; final checkpoint") for line in server.stdout)
    assert any("already stopping" in line for line in server.stderr), "the second signal was lost"
    assert restored_count(root) == 3000


# ---------------------------------------------------------- 5. kill -9 of an embedded manager


def _reverb_time(name: str) -> float:
    """Parses Reverb's checkpoint name, e.g. 2026-11-22T02:53:12.168022853+00:00."""
    from datetime import datetime

    stamp, _, zone = name.partition("+")
    seconds, _, fraction = stamp.partition(".")
    return datetime.fromisoformat(f"{seconds}.{fraction[:6].ljust(6, '0')}+{zone}").timestamp()


LOSS_BOUND_S = EMBEDDED_INTERVAL_S + 3.0  # one interval + one checkpoint + scheduling slack


def run_embedded_kill_point(collectors, make_manager, tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    root = tmp_path / f"embedded{seed}"
    collector = collectors("embedded", str(root))
    collector.wait_collecting()
    time.sleep(rng.uniform(1.2, 3.5))
    caught = False
    if seed % 2:  # kill while a checkpoint is written or verified
        deadline = time.monotonic() + 3 * EMBEDDED_INTERVAL_S
        while time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError):
                if os.listdir(root / REVERB_DIR):
                    caught = True
                    break
            time.sleep(0.0005)
    collector.proc.send_signal(signal.SIGKILL)
    killed_at = time.time()
    collector.proc.wait(timeout=30)

    manager = make_manager(checkpoint_dir=str(root), capacity=100_000)
    manager.load_replay_buffer()
    count = manager.num_frames()
    assert not (root / CORRUPT_DIR).exists(), "a checkpoint looked complete but did not load"
    newest = newest_checkpoint(root)
    assert newest is not None, "no checkpoint after several intervals"
    info = json.loads((newest / CHECKPOINT_META_FILE).read_text())
    assert count == info["num_items"]
    loss_s = killed_at - _reverb_time(info["reverb_name"])
    report(
        f"embedded kill -9 (seed {seed}{', during a checkpoint' if caught else ''}): "
        f"{count} items restored, loss window {loss_s:.2f} s"
    )
    assert loss_s < LOSS_BOUND_S
    assert item_ids(manager, count) == list(range(1, count + 1))
    manager.close()


# One kill point in `make test`; the soak below and seed 1 in `make test-slow`.
@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_kill_9_of_an_embedded_manager_restores_its_newest_checkpoint(
    collectors, make_manager, tmp_path, seed
):
    run_embedded_kill_point(collectors, make_manager, tmp_path, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 120))
def test_kill_9_of_an_embedded_manager_soak(collectors, make_manager, tmp_path, seed):
    run_embedded_kill_point(collectors, make_manager, tmp_path, seed)


def _unanswered_first_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Makes every call to the first new server's address fail as an unanswered call does (a
    first contact that stalls), with its wait shortened to 2 s; returns the addresses asked."""
    from replay_service.backends.reverb import connection
    from replay_service.backends.reverb import server as checkpointed_server
    from replay_service.errors import ServerUnavailableError

    real = connection.server_info
    asked: list[str] = []

    def server_info(client: Any, timeout: float | None) -> Any:
        if not asked or client.server_address == asked[0]:
            asked.append(client.server_address)
            raise ServerUnavailableError(f"no Reverb server answered at {client.server_address!r}")
        return real(client, timeout)

    monkeypatch.setattr(connection, "server_info", server_info)
    monkeypatch.setattr(checkpointed_server, "INFO_TIMEOUT_S", 1.0)
    return asked


def test_a_new_server_that_never_answers_is_started_again_on_another_port(
    make_manager, monkeypatch, caplog
):
    import reverb

    asked = _unanswered_first_calls(monkeypatch)
    manager = make_manager()
    with caplog.at_level(logging.WARNING):
        manager.create_replay_buffer()
    # Fresh clients asked again until the first contact's time was up, then a new port.
    assert len(asked) >= 2 and set(asked) == {asked[0]}
    first_port = int(asked[0].rsplit(":", 1)[1])
    assert not manager.server_address.endswith(f":{first_port}")
    assert "never answered" in caplog.text and "starting it again" in caplog.text
    # The first server was stopped: nothing answers on its port any more.
    with pytest.raises(Exception):  # noqa: B017 - Reverb raises RuntimeError or DeadlineExceeded
        reverb.Client(f"localhost:{first_port}").server_info(timeout=1)
    writer = manager.transition_writer()
    states = np.arange(24, dtype=np.float32).reshape(6, 4)
    for i in range(5):
        writer.add(states[i], 0, 1.0, states[i + 1], False, i == 4)
    writer.flush()
    assert manager.num_frames() == 5


def test_a_new_server_on_a_chosen_port_that_never_answers_is_an_error(make_manager, monkeypatch):
    from replay_service.errors import ServerUnavailableError

    asked = _unanswered_first_calls(monkeypatch)
    port = pick_free_port()
    manager = make_manager(port=port)
    with pytest.raises(ServerUnavailableError, match=f":{port}"):
        manager.create_replay_buffer()
    assert len(asked) >= 2 and set(asked) == {f"localhost:{port}"}
    monkeypatch.undo()  # a new server on the port answers again
    # The server that never answered was stopped before the directory was released: its port
    # is free again, and a new manager may start in the directory at once.
    check_port_free(port)
    again = make_manager(port=port)
    again.create_replay_buffer(overwrite=True)
    assert again.num_frames() == 0
    again.close()

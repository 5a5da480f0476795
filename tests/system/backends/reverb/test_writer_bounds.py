"""The client the manager hands out never blocks forever on a dead server, and a packed
collector that exits without `close()` loses nothing it wrote.

A standalone `replay-server` runs in a subprocess; TF-Agents' own observers write through
`manager.py_client`; the server is killed with SIGKILL. Every call that could block runs in a
thread joined with a timeout, so a regression fails instead of hanging the suite.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tf_agents.replay_buffers.reverb_utils import (
    ReverbAddTrajectoryObserver,
    ReverbTrajectorySequenceObserver,
)

from _collector import UNCLOSED_TIMEOUTS, step
from conftest import CARTPOLE_CONFIG, REPO
from replay_service import ReplayBufferManager
from replay_service.config.options import Timeouts
from replay_service.errors import (
    SampleTimeoutError,
    ServerUnavailableError,
    WriteTimeoutError,
)

COLLECTOR = Path(__file__).resolve().parents[3] / "_collector.py"
WRITE_S = 1.0
TIMEOUTS = Timeouts(connect=2.0, write=WRITE_S, sample=1.0, checkpoint=30.0)
# A bounded call returns within its timeout plus this slack (a loaded machine).
SLACK_S = 10.0


def _config(tmp_path: Path, layout: str) -> str:
    """The CartPole config with `layout` named in its table."""
    text = Path(CARTPOLE_CONFIG).read_text()
    path = tmp_path / f"cartpole_{layout}.toml"
    path.write_text(text.replace("[table]\n", f'[table]\nlayout = "{layout}"\n', 1))
    return str(path)


def _bounded(call: Any, bound_s: float) -> BaseException | None:
    """Runs `call` in a thread; returns what it raised (None if it returned), failing the test
    if it is still blocked after `bound_s + SLACK_S` seconds."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as e:  # handed to the test
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(bound_s + SLACK_S)
    assert not thread.is_alive(), f"{call} still blocks after {time.monotonic() - started:.1f} s"
    return outcome[0]


def _manager(data_spec: Any, address: str, timeouts: Timeouts = TIMEOUTS) -> ReplayBufferManager:
    return ReplayBufferManager(
        data_spec,
        100_000,
        table_name="uniform_table",
        server_address=address,
        timeouts=timeouts,
    )


def test_tf_agents_observers_on_py_client_raise_after_the_server_is_killed(
    start_server, tmp_path, data_spec
):
    # A server per table layout; both start side by side (each spends seconds importing
    # TensorFlow), and both layouts are checked side by side too (each check waits out about
    # fifteen timeouts of one or two seconds against its killed server).
    layouts = ["packed", "nested"]
    servers = [
        start_server(
            f"--checkpoint_dir={tmp_path / layout}", config=_config(tmp_path, layout), wait=False
        )
        for layout in layouts
    ]
    for server, _ in servers:
        server.wait_listening()
    with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:
        checks = [
            pool.submit(_check_observers_raise_after_a_kill, server, address, data_spec)
            for server, address in servers
        ]
        for check in checks:
            check.result(timeout=300)  # re-raises a layout's failed assertion


def _check_observers_raise_after_a_kill(server: Any, address: str, data_spec: Any) -> None:
    """TF-Agents' observers on the manager's `py_client`, and the client's other calls, raise
    within their timeouts once `server` is killed."""
    manager = _manager(data_spec, address)
    manager.load_replay_buffer()
    client = manager.py_client
    table = manager.table_name
    observers = [
        ReverbAddTrajectoryObserver(client, table, manager.sequence_length),
        ReverbTrajectorySequenceObserver(client, table, manager.sequence_length),
    ]
    for observer in observers:
        for counter in range(10):
            observer(step(counter))
        observer.flush()
    assert manager.num_frames() == 2 * 9
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(timeout=30)

    def write_and_flush(observer: Any) -> None:
        for counter in range(10, 20):
            observer(step(counter))
        observer.flush()

    for observer in observers:
        for call in (lambda o=observer: write_and_flush(o), observer.close):
            error = _bounded(call, WRITE_S)
            assert isinstance(error, WriteTimeoutError), repr(error)
            assert address in str(error) and f"{int(WRITE_S * 1000)} ms" in str(error)

    # The client's other calls are bounded too.
    checks = [
        (lambda: client.server_info(), ServerUnavailableError, TIMEOUTS.connect),
        (lambda: client.reset(table), WriteTimeoutError, WRITE_S),
        (lambda: client.mutate_priorities(table, {1: 2.0}), WriteTimeoutError, WRITE_S),
        (lambda: next(iter(client.sample(table))), SampleTimeoutError, TIMEOUTS.sample),
        (manager.clear, WriteTimeoutError, WRITE_S),
        (
            lambda: manager.get_replay_buffer_and_observer()[0].num_frames(),
            ServerUnavailableError,
            TIMEOUTS.connect,
        ),
    ]
    for call, kind, bound_s in checks:
        error = _bounded(call, bound_s)
        assert isinstance(error, kind), repr(error)
        assert address in str(error), str(error)
    _bounded(manager.close, WRITE_S)


def _run_collector(address: str, writer: str, steps: int, *wait: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.Popen(
        [sys.executable, str(COLLECTOR), "unclosed", address, writer, str(steps), *wait],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_packed_collector_that_exits_without_close_loses_nothing(start_server, tmp_path, data_spec):
    steps = 41  # 40 items of 2 steps: fewer than a packed chunk, none sent when the last came
    # Each writer ("observer": the manager's; "tf_agents": TF-Agents' own observer) writes to a
    # server of its own; the servers and then the collectors run side by side (each process
    # spends seconds importing TensorFlow).
    writers = ["observer", "tf_agents"]
    config = _config(tmp_path, "packed")
    servers = [
        start_server(f"--checkpoint_dir={tmp_path / writer}", config=config, wait=False)
        for writer in writers
    ]
    for server, _ in servers:
        server.wait_listening()
    collectors = [
        _run_collector(address, writer, steps)
        for writer, (_, address) in zip(writers, servers, strict=True)
    ]
    for writer, collector, (_, address) in zip(writers, collectors, servers, strict=True):
        out, err = collector.communicate(timeout=120)
        assert collector.returncode == 0, (writer, out + err)
        assert "not confirmed" not in err, (writer, err)
        manager = _manager(data_spec, address)
        manager.load_replay_buffer()
        assert manager.num_frames() == steps - 1, (writer, err)
        manager.close()


def test_packed_collector_exit_warns_of_unconfirmed_items_when_the_server_is_gone(
    start_server, tmp_path
):
    server, address = start_server(config=_config(tmp_path, "packed"))
    collector = _run_collector(address, "tf_agents", 41, "wait")
    assert collector.stdout is not None and collector.stdin is not None
    assert collector.stdout.readline().strip() == "written"
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(timeout=30)
    started = time.monotonic()
    out, err = collector.communicate("\n", timeout=UNCLOSED_TIMEOUTS.write + 60)
    took = time.monotonic() - started
    assert collector.returncode == 0, out + err
    # The 41 steps written after the kill make 41 items (the first spans the kill); the 40
    # before it may be unconfirmed too (the observer never flushes mid-episode).
    warning = re.search(
        r"(\d+) item\(s\) written by 1 packed writer\(s\) that were never closed were not "
        r"confirmed by the server within 2 s",
        err,
    )
    assert warning is not None, err
    assert 41 <= int(warning.group(1)) <= 81, warning.group(0)
    assert took < UNCLOSED_TIMEOUTS.write + 30, took

"""Shared fixtures: a real CartPole environment, its data spec, and managers that clean up."""

from __future__ import annotations

import gc
import hashlib
import itertools
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("GRPC_POLL_STRATEGY", "epoll1")

import signal
import stat
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from replay_service.backends.reverb.connection import pick_free_port
from replay_service.config.options import Timeouts

try:
    import reverb
    from tf_agents.drivers import py_driver
    from tf_agents.environments import suite_gym
    from tf_agents.policies import random_py_policy

    from replay_service import ReplayBufferManager
    from replay_service.specs.nests import collect_data_spec
except ImportError:  # no Reverb stack (e.g. Python 3.12): only the `local` tests run
    HAVE_REVERB = False
else:
    HAVE_REVERB = True

TESTS_DIR = Path(__file__).resolve().parent
LOCAL_TEST_FILES = (
    "unit/test_portable.py",
    "unit/backends/local/test_sum_tree.py",
    "integration/backends/local/test_local_backend.py",
    "integration/backends/local/test_local_device.py",
)
"""Test files (relative to tests/) that import no TensorFlow, TF-Agents or Reverb at module
level; the Makefile's LOCAL_TESTS names the same files."""

if not HAVE_REVERB:
    collect_ignore_glob = [
        path.relative_to(TESTS_DIR).as_posix()
        for path in TESTS_DIR.rglob("test_*.py")
        if path.relative_to(TESTS_DIR).as_posix() not in LOCAL_TEST_FILES
    ]

TIERS = ("unit", "integration", "system")
"""The tier directories under tests/; each test gets its directory's marker (`-m unit` etc.)."""


_TIER_ORDER = {"system": 0, "integration": 1, "unit": 2}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks each test with its tier, the first directory of its path under tests/; in a
    pytest-xdist worker (`make test` runs `-n`), orders the tiers slowest first (system,
    integration, unit), each file whole, so that no long file starts last on one worker."""
    rank = {}
    for item in items:
        path = Path(item.path).resolve()
        tier = None
        if path.is_relative_to(TESTS_DIR):
            tier = path.relative_to(TESTS_DIR).parts[0]
            if tier in TIERS:
                item.add_marker(tier)
        rank[item.nodeid] = _TIER_ORDER.get(tier, len(_TIER_ORDER))
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: rank[item.nodeid])  # stable: files stay whole and in order


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "configs")
CARTPOLE_CONFIG = os.path.join(CONFIGS, "cartpole.toml")
START_TIMEOUT_S = 60
FAST_TIMEOUTS = Timeouts(connect=5.0, write=10.0, sample=1.0, checkpoint=60.0)


_ITERATOR_SEQ = itertools.count()
_ITERATORS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
"""Every tf.data iterator made in this process (once TensorFlow is imported), with the
sequence number of its making."""
_FIRST_ITERATOR = pytest.StashKey[int]()
"""The sequence number of the first iterator a test may make."""


def _track_dataset_iterators() -> None:
    """Records each tf.data iterator made from now on in `_ITERATORS` (once per process)."""
    module = sys.modules.get("tensorflow.python.data.ops.iterator_ops")
    if module is None or getattr(module.OwnedIterator.__init__, "_tracked", False):
        return
    init = module.OwnedIterator.__init__

    def tracked(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _ITERATORS[self] = next(_ITERATOR_SEQ)

    tracked._tracked = True  # type: ignore[attr-defined]
    module.OwnedIterator.__init__ = tracked


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Notes where this test's tf.data iterators start (see `pytest_runtest_teardown`)."""
    _track_dataset_iterators()
    item.stash[_FIRST_ITERATOR] = next(_ITERATOR_SEQ)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Collects a test's left-over tf.data iterators while its servers still run.

    An iterator kept alive past its test by a reference cycle (most often the traceback of
    an error it raised) is destroyed by the next garbage collection. If its Reverb server
    has stopped by then, or its table has been emptied, the iterator's destructor waits for
    sampler threads that no longer get an answer: that collection, in whichever later test
    it falls, blocked for 20 s to over a minute. Collected here, before the test's fixtures
    stop the servers, the destructor returns at once; the check costs nothing for the tests
    whose iterators are gone (nearly all).
    """
    first = item.stash.get(_FIRST_ITERATOR, None)
    if first is not None and any(seq >= first for seq in list(_ITERATORS.values())):
        gc.collect()
    yield


@pytest.fixture(autouse=True, scope="session")
def _sb3_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Stable-Baselines3's `learn()` makes a log directory in the system's temp directory on
    every call unless `SB3_LOGDIR` names one: the tests' go under pytest's temp root."""
    previous = os.environ.get("SB3_LOGDIR")
    os.environ["SB3_LOGDIR"] = str(tmp_path_factory.mktemp("sb3_logs"))
    yield
    if previous is None:
        os.environ.pop("SB3_LOGDIR", None)
    else:
        os.environ["SB3_LOGDIR"] = previous


@pytest.fixture()
def env() -> Any:
    """A CartPole-v0 py environment."""
    pytest.importorskip("tf_agents", reason="the CartPole fixtures need TF-Agents")
    environment = suite_gym.load("CartPole-v0")
    environment.seed(0)
    return environment


@pytest.fixture()
def policy(env: Any) -> Any:
    """A seeded random policy for `env`."""
    return random_py_policy.RandomPyPolicy(env.time_step_spec(), env.action_spec(), seed=0)


@pytest.fixture()
def data_spec(env: Any, policy: Any) -> Any:
    """The per-step Trajectory spec of `env` (what `agent.collect_data_spec` gives)."""
    return collect_data_spec(env, policy)


@pytest.fixture()
def make_manager(data_spec: Any, tmp_path: Any) -> Iterator[Callable[..., ReplayBufferManager]]:
    """Builds managers (default: CartPole spec, capacity 1000, tmp checkpoint dir) and closes
    every one of them at teardown."""
    made: list[ReplayBufferManager] = []

    def factory(**kwargs: Any) -> ReplayBufferManager:
        kwargs.setdefault("data_spec", data_spec)
        kwargs.setdefault("capacity", 1000)
        if "server_address" not in kwargs:
            kwargs.setdefault("checkpoint_dir", str(tmp_path / "ckpt"))
        kwargs.setdefault("timeouts", FAST_TIMEOUTS)
        manager = ReplayBufferManager(**kwargs)
        made.append(manager)
        return manager

    yield factory
    for manager in made:
        manager.close()


@pytest.fixture()
def make_from_spaces(tmp_path: Any) -> Iterator[Callable[..., ReplayBufferManager]]:
    """Builds `from_spaces` managers (default: CartPole-shaped Box(4) observations, Discrete(2)
    actions, capacity 500, a tmp checkpoint dir named `name`) on `backend`, and closes every one
    of them at teardown."""
    made: list[ReplayBufferManager] = []

    def factory(
        backend: str,
        name: str = "ckpt",
        observation: Any = None,
        action: Any = None,
        **kwargs: Any,
    ) -> ReplayBufferManager:
        from gymnasium import spaces

        kwargs.setdefault("capacity", 500)
        kwargs.setdefault("timeouts", FAST_TIMEOUTS)
        manager = ReplayBufferManager.from_spaces(
            observation or spaces.Box(-10.0, 10.0, (4,), np.float32),
            action or spaces.Discrete(2),
            checkpoint_dir=str(tmp_path / name),
            backend=backend,
            **kwargs,
        )
        made.append(manager)
        return manager

    yield factory
    for manager in made:
        manager.close()


def collect(env: Any, policy: Any, observer: Any, steps: int) -> None:
    """Runs `steps` non-boundary environment steps through `observer` and flushes it."""
    py_driver.PyDriver(env, policy, [observer], max_steps=steps).run(env.reset())
    observer.flush()


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Polls `condition` until it holds; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def wait_for_adoption(checkpoint_dir: Any, timeout: float = 30.0) -> None:
    """Waits until a running replay-server moved the checkpoints clients asked for into its
    `checkpoints/` (it waits `SAVE_SETTLE_S` after each save, then adopts at its next poll)."""
    from replay_service.storage.store import CheckpointStore

    store = CheckpointStore(str(checkpoint_dir))
    wait_for(
        lambda: bool(store.entries()) and not store.staged(),
        timeout,
        f"the server to adopt the client's checkpoint in {checkpoint_dir}",
    )


def all_items(client: reverb.Client, table: str, expected: int) -> dict[int, list[np.ndarray]]:
    """Samples a uniform table until every one of its `expected` items was seen.

    Returns:
      Item key -> flattened item data (a packed table's rows unpacked, where `client` is the
      manager's `PackingClient`).
    """
    layout = getattr(client, "layout", None)
    items: dict[int, list[np.ndarray]] = {}
    for _ in range(200):
        for sample in client.sample(table, num_samples=200, emit_timesteps=False):
            data = sample.data if layout is None else layout.unpack_leaves(sample.data[0])
            items[int(sample.info.key)] = [np.asarray(x) for x in data]
        if len(items) >= expected:
            break
    assert len(items) == expected, f"saw {len(items)} distinct items, expected {expected}"
    return items


class ServerProcess:
    """The installed `replay-server` as a subprocess whose output is collected by a thread."""

    def __init__(self, *args: str, command: list[str] | None = None, cwd: Any = REPO) -> None:
        """Starts `replay-server *args`, or `command` as given (e.g. a documented command line)."""
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        self.proc = subprocess.Popen(
            command or [os.path.join(os.path.dirname(sys.executable), "replay-server"), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=cwd,
            env=env,
        )
        self.output: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)

    def wait_listening(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            if any(line.startswith("replay-server listening on port") for line in self.output):
                return
            time.sleep(0.05)
        raise AssertionError("server did not start:\n" + "".join(self.output))

    def finish(self, sig: int | None = signal.SIGTERM, timeout: float = 60) -> tuple[int, str]:
        if sig is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return self.proc.returncode, "".join(self.output)


CHILD_DONE = "done"
"""What `run_child` answers a scenario's request once it ran the request's handler."""


def run_child(
    script: str,
    *args: str,
    handle: Callable[[str], None] | None = None,
    timeout: float = 150.0,
) -> Any:
    """Runs `python script *args` (tests/ on its path) and returns the JSON of its last line.

    Tests whose servers die under live Reverb samplers run that part here: Reverb's sampler
    retries a dead address forever and its iterator's destructor waits for it, so those
    iterators must die with a process of their own (`child_main`), not in a pytest worker.
    A line `@request` the child prints (`child_request`) is passed to `handle` (e.g. "kill
    a server"); the child waits until `handle` returned.

    Raises:
      AssertionError: the child failed (its stderr shown), printed no JSON, or took longer
        than `timeout` seconds.
    """
    import json
    import queue
    import tempfile

    path = os.pathsep.join(p for p in (str(TESTS_DIR), REPO, os.environ.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(
            [sys.executable, script, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=dict(os.environ, PYTHONPATH=path),
        )
        lines: queue.Queue[str | None] = queue.Queue()

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout
        last = ""
        try:
            while True:
                try:
                    line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
                except queue.Empty:
                    raise AssertionError(f"{script} {args} ran over {timeout} s") from None
                if line is None:
                    break
                if line.startswith("@"):
                    if handle is not None:
                        handle(line[1:].strip())
                    assert proc.stdin is not None
                    proc.stdin.write(CHILD_DONE + "\n")
                    proc.stdin.flush()
                elif line.strip():
                    last = line
            code = proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        stderr.seek(0)
        assert code == 0, f"{script} {args} exited with {code}:\n{stderr.read()[-6000:]}"
    return json.loads(last)


def child_request(request: str) -> None:
    """In a `run_child` child: asks the parent test to run `request`, and waits until it did."""
    print("@" + request, flush=True)
    answer = sys.stdin.readline().strip()
    assert answer == CHILD_DONE, f"parent answered {answer!r} to {request!r}"


def child_main(scenarios: dict[str, Callable[..., Any]]) -> None:
    """A `run_child` child's entry: runs `scenarios[argv[1]](*argv[2:])`, prints its result as
    JSON, and ends with `os._exit` (no destructor waits on a sampler of a dead server); a
    failure prints its traceback and exits with 1."""
    import json
    import traceback

    try:
        result = scenarios[sys.argv[1]](*sys.argv[2:])
        print(json.dumps(result), flush=True)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture()
def start_server(tmp_path) -> Iterator:
    pytest.importorskip("reverb", reason="replay-server needs dm-reverb")
    started: list[ServerProcess] = []

    def start(
        *extra: str, port: int | None = None, wait: bool = True, config: str = CARTPOLE_CONFIG
    ) -> tuple[ServerProcess, str]:
        port = port or pick_free_port()
        args = [
            f"--config={config}",
            f"--port={port}",
            f"--checkpoint_dir={tmp_path / 'server_ckpt'}",
            *extra,
        ]
        server = ServerProcess(*args)
        started.append(server)
        if wait:
            server.wait_listening()
        return server, f"localhost:{port}"

    yield start
    for server in started:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


def tree_digest(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file (and a marker for every directory, and for
    anything else: a named pipe is never opened) under root."""
    digest = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs:
            digest[os.path.relpath(os.path.join(directory, name), root)] = "dir"
        for name in files:
            path = os.path.join(directory, name)
            if os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode):
                digest[os.path.relpath(path, root)] = f"special {os.stat(path).st_mode:o}"
                continue
            digest[os.path.relpath(path, root)] = hashlib.sha256(
                Path(path).read_bytes()
            ).hexdigest()
    return digest

"""Load test: 4 collector processes and 1 learner process against real replay servers.

Starts `--num_shards` local `replay-server` processes on loopback ports (or uses the servers of
`--addresses`), then runs, for `--duration_s` seconds:

  * `--num_collectors` collector processes, each with its own remote manager and observer
    (collector i writes to shard i % N), writing synthetic CartPole-shaped episodes whose
    content is a deterministic function of (collector, episode, step);
  * one learner process sampling `--batch_size` batches through `get_dataset`.

Afterwards it reconciles what the servers counted with what the processes report:

  * inserts counted by the servers == items the collectors created and had confirmed (each
    collector flushes before it reports);
  * samples counted by the servers >= items the learner consumed (the pipeline prefetches);
  * every process started, finished and exited within its time limit (otherwise it is killed
    and the run fails);
  * the server RSS (VmRSS from /proc/<pid>/status, sampled every `--monitor_interval_s`)
    plateaus: once the table is full by the middle of the run, RSS may grow by at most
    `--max_rss_growth_pct` over the second half.

It prints throughput (inserts/s, samples/s), latency percentiles (observer call, learner
next-batch) and RSS, optionally writes them as JSON (`--json`), and exits with status 1 if a
check fails (2 for invalid flags). Every wait is bounded: the whole run takes at most
start-up + `--duration_s` (capped at 600) + shutdown grace.

  python scripts/load_test.py --duration_s=60
  python scripts/load_test.py --duration_s=20 --num_shards=2 --json=load.json
  python scripts/load_test.py --addresses=localhost:8000 --server_pids=12345 --capacity=100000
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import contextlib
import ctypes
import dataclasses
import json
import multiprocessing
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from tf_agents.trajectories import trajectory

from replay_service.backends.reverb.connection import pick_free_port
from replay_service.config.options import Timeouts
from replay_service.distributed.shard_config import ShardedConfig
from replay_service.distributed.shard_status import sharded_status
from replay_service.distributed.sharding import ShardedReplayBuffer
from replay_service.errors import ConfigError, ReplayServiceError

TABLE_NAME = "uniform_table"
SEQUENCE_LENGTH = 2
EPISODE_STEPS = 200  # CartPole-v0's episode limit
DEFAULT_DURATION_S = 60.0
MAX_DURATION_S = 600.0
DEFAULT_COLLECTORS = 4
DEFAULT_CAPACITY = 20_000
DEFAULT_BATCH_SIZE = 64
DEFAULT_MAX_RSS_GROWTH_PCT = 25.0
DEFAULT_MONITOR_INTERVAL_S = 0.5
START_TIMEOUT_S = 180.0  # process spawn + TensorFlow import, several at once on few cores
STOP_GRACE_S = 60.0  # after the stop signal: final flush, report, exit
SERVER_STOP_TIMEOUT_S = 60.0
STATUS_TIMEOUT_S = 10.0
MAX_LATENCY_SAMPLES = 2_000_000  # per process; later calls are counted but not timed
REWEIGHT_EVERY_BATCHES = 100
EXIT_FAILED = 1
EXIT_USAGE = 2
HELP_ARGS = frozenset({"-h", "-?", "-help", "--help", "-helpshort", "--helpshort"})
LISTENING_LINE = "replay-server listening on port"
WORKER_TIMEOUTS = Timeouts(connect=60.0, write=30.0, sample=30.0, checkpoint=120.0)
MID, FIRST, LAST = 1, 0, 2
PR_SET_PDEATHSIG = 1

SERVER_CONFIG = """\
[server]
checkpoint_interval_s = 0
keep_checkpoints = 1

[table]
name = "{table}"
capacity = {capacity}
sequence_length = {sequence_length}

[table.sampling]
sampler = "uniform"
remover = "fifo"

[data_spec]
structure = "trajectory"
fields.observation = {{ dtype = "float32", shape = [4] }}
fields.action = {{ dtype = "int64", shape = [] }}
"""


@dataclasses.dataclass(frozen=True)
class LoadTestConfig:
    """What to run.

    Attributes:
      duration_s: Seconds of load, counted from the moment every process is ready.
      num_collectors: Collector processes; collector i writes to shard i % N.
      capacity: Items per shard (servers started here are configured with it; existing
        servers must have it).
      batch_size: Items per learner batch.
      num_shards: Local servers to start when `addresses` is empty.
      addresses: "host:port" of running servers to use instead of starting any.
      server_pids: Process ids of those servers, for RSS (only readable on this machine).
      episode_steps: Steps per synthetic episode (the last one is the episode boundary).
      max_rss_growth_pct: Allowed RSS growth over the second half once the table is full.
      monitor_interval_s: Seconds between RSS and counter samples.
      start_timeout_s: Seconds every process (servers included) may take to become ready.
    """

    duration_s: float = DEFAULT_DURATION_S
    num_collectors: int = DEFAULT_COLLECTORS
    capacity: int = DEFAULT_CAPACITY
    batch_size: int = DEFAULT_BATCH_SIZE
    num_shards: int = 1
    addresses: tuple[str, ...] = ()
    server_pids: tuple[int, ...] = ()
    episode_steps: int = EPISODE_STEPS
    max_rss_growth_pct: float = DEFAULT_MAX_RSS_GROWTH_PCT
    monitor_interval_s: float = DEFAULT_MONITOR_INTERVAL_S
    start_timeout_s: float = START_TIMEOUT_S

    def __post_init__(self) -> None:
        if not _is_number(self.duration_s) or not 0 < self.duration_s <= MAX_DURATION_S:
            raise ConfigError(
                f"duration_s must be in (0, {MAX_DURATION_S:g}] seconds, got {self.duration_s!r}"
            )
        for name in ("num_collectors", "capacity", "batch_size", "num_shards"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.episode_steps, int) or self.episode_steps <= SEQUENCE_LENGTH:
            raise ConfigError(
                f"episode_steps must be an integer > {SEQUENCE_LENGTH}, got {self.episode_steps!r}"
            )
        for name in ("max_rss_growth_pct", "monitor_interval_s", "start_timeout_s"):
            value = getattr(self, name)
            if not _is_number(value) or value <= 0:
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        if self.addresses:
            ShardedConfig(tuple(self.addresses))
        if self.server_pids and not self.addresses:
            raise ConfigError(
                f"server_pids {list(self.server_pids)!r} apply only with addresses (servers "
                "started here are measured anyway)"
            )


@dataclasses.dataclass(frozen=True)
class Check:
    """One reconciliation check.

    Attributes:
      name: What was checked.
      ok: Whether it held (None: not applicable in this run).
      detail: The numbers behind it.
    """

    name: str
    ok: bool | None
    detail: str


@dataclasses.dataclass(frozen=True)
class LoadTestReport:
    """Everything a run measured.

    Attributes:
      duration_s: Measured seconds from the start signal to the stop signal.
      num_shards: Servers used.
      num_collectors: Collector processes.
      capacity: Items per shard.
      batch_size: Items per learner batch.
      server_inserts: Inserts the servers counted during the run.
      collector_items: Items the collectors created and had confirmed.
      collector_steps: Steps the collectors wrote.
      server_samples: Samples the servers counted during the run.
      learner_items: Items in the batches the learner consumed.
      learner_batches: Batches the learner consumed.
      inserts_per_s: `server_inserts / duration_s`.
      samples_per_s: `server_samples / duration_s`.
      learner_items_per_s: `learner_items / duration_s`.
      observer_latency_us: p50, p90, p99 of one observer call, in microseconds.
      learner_latency_ms: p50, p90, p99 of one learner `next(iterator)`, in milliseconds
        (the first batch, which starts the pipeline, is excluded).
      first_batch_s: Seconds the learner's first batch took.
      rss_max_mib: Largest server RSS seen (summed over shards), or None if unreadable.
      rss_final_mib: Server RSS at the end of the run.
      rss_mid_mib: Server RSS at the middle of the run.
      rss_growth_mib: `rss_final_mib - rss_mid_mib`: growth over the second half.
      table_full_at_mid: Whether every shard was at capacity by the middle of the run.
      checks: The reconciliation checks.
      startup_s: Seconds from the start of the run until every process was ready.
      total_s: Seconds the whole run took, servers' start and stop included.
    """

    duration_s: float
    num_shards: int
    num_collectors: int
    capacity: int
    batch_size: int
    server_inserts: int
    collector_items: int
    collector_steps: int
    server_samples: int
    learner_items: int
    learner_batches: int
    inserts_per_s: float
    samples_per_s: float
    learner_items_per_s: float
    observer_latency_us: tuple[float, float, float]
    learner_latency_ms: tuple[float, float, float]
    first_batch_s: float | None
    rss_max_mib: float | None
    rss_final_mib: float | None
    rss_mid_mib: float | None
    rss_growth_mib: float | None
    table_full_at_mid: bool | None
    checks: tuple[Check, ...]
    startup_s: float = 0.0
    total_s: float = 0.0

    @property
    def ok(self) -> bool:
        """Whether no check failed."""
        return all(check.ok is not False for check in self.checks)

    def to_json(self) -> dict[str, Any]:
        """Returns the report as JSON-compatible data, with `ok`."""
        return {**dataclasses.asdict(self), "ok": self.ok}


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# ------------------------------------------------------------------------ synthetic episodes


def synthetic_step(collector: int, episode: int, t: int, episode_steps: int) -> Any:
    """One CartPole-shaped `Trajectory` step, a deterministic function of its arguments.

    Args:
      collector: Collector index (observation[0]).
      episode: Episode index of that collector (observation[1]).
      t: Step within the episode (observation[2]); step `episode_steps - 1` is the boundary.
      episode_steps: Steps per episode.

    Returns:
      An unbatched `Trajectory` of numpy values.
    """
    last = episode_steps - 1
    step_type = FIRST if t == 0 else LAST if t == last else MID
    next_step_type = FIRST if t == last else LAST if t == last - 1 else MID
    return trajectory.Trajectory(
        step_type=np.int32(step_type),
        observation=np.array([collector, episode, t, (t * 7 + episode) % 11], np.float32),
        action=np.int64((collector + episode + t) % 2),
        policy_info=(),
        next_step_type=np.int32(next_step_type),
        reward=np.float32(1.0),
        discount=np.float32(0.0 if t == last - 1 else 1.0),
    )


def _data_spec() -> Any:
    from replay_service.specs.nests import spec_from_description

    return spec_from_description(
        [
            {"path": "observation", "dtype": "float32", "shape": [4]},
            {"path": "action", "dtype": "int64", "shape": []},
        ]
    )


def _open_shards(config: LoadTestConfig, addresses: Sequence[str]) -> ShardedReplayBuffer:
    shards = ShardedReplayBuffer(
        ShardedConfig(tuple(addresses)),
        _data_spec(),
        config.capacity,
        SEQUENCE_LENGTH,
        table_name=TABLE_NAME,
        timeouts=WORKER_TIMEOUTS,
    )
    return shards.load()


# ------------------------------------------------------------------------------- workers


class _Collector:
    """Writes synthetic episodes through one observer and counts the items it creates."""

    def __init__(self, index: int, config: LoadTestConfig, addresses: Sequence[str]) -> None:
        self._index = index
        self._config = config
        self._shards = _open_shards(config, addresses)
        self._observer = self._shards.observer(index)

    def run(self, stop: Any, deadline: float) -> dict[str, Any]:
        """Writes steps until `stop` is set or `deadline` passes, then flushes.

        Args:
          stop: A multiprocessing event.
          deadline: `time.monotonic()` value at which to stop regardless.

        Returns:
          Items created (all confirmed by the flush), steps, episodes and call latencies.
        """
        episode_steps = self._config.episode_steps
        latencies: list[int] = []
        items = steps = episode = t = in_episode = 0
        while not stop.is_set() and time.monotonic() < deadline:
            step = synthetic_step(self._index, episode, t, episode_steps)
            start = time.perf_counter_ns()
            self._observer(step)
            elapsed = time.perf_counter_ns() - start
            if len(latencies) < MAX_LATENCY_SAMPLES:
                latencies.append(elapsed)
            steps += 1
            in_episode += 1
            if in_episode >= SEQUENCE_LENGTH:
                items += 1
            t += 1
            if t == episode_steps:
                episode, t, in_episode = episode + 1, 0, 0
        self._observer.flush()
        return {
            "items": items,
            "steps": steps,
            "episodes": episode,
            "latencies_ns": np.asarray(latencies, np.int64),
        }


class _Learner:
    """Consumes batches from every shard and times each `next()`."""

    def __init__(self, config: LoadTestConfig, addresses: Sequence[str]) -> None:
        self._config = config
        self._shards = _open_shards(config, addresses)
        # Built before the process reports ready: on a loaded machine building the pipeline
        # took longer than a short run, and the learner then never took a batch.
        reweight = REWEIGHT_EVERY_BATCHES if self._shards.num_shards > 1 else None
        self._iterator = iter(self._shards.get_dataset(config.batch_size, reweight_every=reweight))

    def run(self, stop: Any, deadline: float) -> dict[str, Any]:
        """Waits for a batch worth of items, then consumes batches until `stop` or `deadline`.

        The first batch is taken even if `stop` came while waiting for items (the table still
        holds them), so a run on a slow machine still measures the read path.

        Returns:
          Batches and items consumed, the first batch's latency and the others'.

        Raises:
          TimeoutError: If the buffer does not fill within `WORKER_TIMEOUTS.sample`.
        """
        self._wait_for_items(deadline)
        iterator = self._iterator
        latencies: list[int] = []
        first_batch_ns: int | None = None
        batches = 0
        while time.monotonic() < deadline and (batches == 0 or not stop.is_set()):
            start = time.perf_counter_ns()
            next(iterator)
            elapsed = time.perf_counter_ns() - start
            if first_batch_ns is None:
                first_batch_ns = elapsed
            elif len(latencies) < MAX_LATENCY_SAMPLES:
                latencies.append(elapsed)
            batches += 1
        return {
            "batches": batches,
            "items": batches * self._config.batch_size,
            "first_batch_ns": first_batch_ns,
            "latencies_ns": np.asarray(latencies, np.int64),
        }

    def _wait_for_items(self, deadline: float) -> None:
        limit = min(deadline, time.monotonic() + float(WORKER_TIMEOUTS.sample or 0))
        while self._shards.num_frames() < self._config.batch_size:
            if time.monotonic() >= limit:  # not on `stop`: the collectors' last flush may fill it
                raise TimeoutError(
                    f"fewer than {self._config.batch_size} items in the buffer after "
                    f"{WORKER_TIMEOUTS.sample} s of collecting"
                )
            time.sleep(0.05)


def worker_main(
    role: str,
    index: int,
    config: LoadTestConfig,
    addresses: Sequence[str],
    channels: tuple[Any, Any, Any, Any],
) -> None:
    """Entry point of a collector or learner process.

    Reports `(name, error or None)` on the ready queue once connected, waits for the start
    event, works until the stop event (or its own deadline), then reports
    `(name, result dict)` on the results queue and exits at once, without closing its
    connections. Every wait is bounded, so the process ends by itself even if the parent is
    gone.

    Args:
      role: "collector" or "learner".
      index: Collector index (0 for the learner).
      config: The run's configuration.
      addresses: The shards.
      channels: `(ready queue, results queue, start event, stop event)`.
    """
    ready, results, go, stop = channels
    name = f"{role}-{index}"
    try:
        work: _Collector | _Learner = (
            _Collector(index, config, addresses)
            if role == "collector"
            else _Learner(config, addresses)
        )
    except BaseException as e:
        ready.put((name, f"{type(e).__name__}: {e}"))
        ready.close()
        ready.join_thread()
        os._exit(EXIT_FAILED)
    ready.put((name, None))
    try:
        if not go.wait(config.start_timeout_s):
            raise TimeoutError(f"no start signal within {config.start_timeout_s} s")
        result = work.run(stop, time.monotonic() + config.duration_s + STOP_GRACE_S / 2)
    except BaseException as e:
        result = {"error": f"{type(e).__name__}: {e}"}
    results.put((name, result))
    results.close()
    results.join_thread()
    # Reported (a collector flushed first): exit at once. The servers drop this process's
    # streams; tearing down sample streams and TensorFlow could take many seconds.
    os._exit(0)


# ---------------------------------------------------------------------------- local servers


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class LocalServer:
    """A `python -m replay_service.cli.serve` subprocess on a free loopback-reachable port.

    It gets SIGTERM (a clean stop) if the process that started it dies.

    Args:
      config_path: TOML server config.
      checkpoint_dir: Its checkpoint directory.
    """

    def __init__(self, config_path: str, checkpoint_dir: str) -> None:
        self.port = pick_free_port()
        self.address = f"localhost:{self.port}"
        self.output: list[str] = []
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "replay_service.cli.serve",
                f"--config={config_path}",
                f"--port={self.port}",
                f"--checkpoint_dir={checkpoint_dir}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
            preexec_fn=_die_with_parent,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        """The server's process id."""
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)

    def wait_listening(self, timeout: float) -> None:
        """Blocks until the server accepts clients.

        Raises:
          ReplayServiceError: If it exits or does not listen within `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if any(line.startswith(LISTENING_LINE) for line in self.output):
                return
            time.sleep(0.05)
        tail = "".join(self.output[-20:])
        raise ReplayServiceError(
            f"replay-server on port {self.port} did not start within {timeout} s "
            f"(exit code {self.proc.poll()}):\n{tail}"
        )

    def stop(self, timeout: float = SERVER_STOP_TIMEOUT_S) -> int | None:
        """Stops the server with SIGTERM (SIGKILL after `timeout`); returns its exit code.

        Returns:
          The exit code, or None if it had to be killed.
        """
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=timeout)
            code = None
        self._reader.join(timeout=5)
        return code


@contextlib.contextmanager
def local_servers(
    config: LoadTestConfig, workdir: str, exit_codes: list[int | None]
) -> Iterator[list[LocalServer]]:
    """Launches `config.num_shards` servers (all at once) and stops them on exit.

    The servers are still starting when this yields: call `wait_listening` on each before
    relying on them (their ports are known already).

    Args:
      config: Capacity and shard count.
      workdir: Directory for the server config and checkpoint directories.
      exit_codes: Receives each server's exit code (None: killed) when they stop.

    Yields:
      The launched servers.
    """
    config_path = os.path.join(workdir, "server.toml")
    with open(config_path, "w", encoding="utf-8") as f:
        f.write(
            SERVER_CONFIG.format(
                table=TABLE_NAME, capacity=config.capacity, sequence_length=SEQUENCE_LENGTH
            )
        )
    servers: list[LocalServer] = []
    try:
        for shard in range(config.num_shards):
            servers.append(LocalServer(config_path, os.path.join(workdir, f"shard{shard}")))
        yield servers
    finally:
        exit_codes.extend(server.stop() for server in servers)


# ------------------------------------------------------------------------------- monitoring


def read_rss_kib(pid: int) -> int | None:
    """Returns VmRSS of process `pid` in KiB from /proc/<pid>/status, or None if unreadable."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclasses.dataclass(frozen=True)
class Sample:
    """One monitor reading.

    Attributes:
      t: Seconds since the start signal.
      rss_kib: Summed server RSS, or None if unreadable.
      size: Items in the table over all shards, or None if a server did not answer.
    """

    t: float
    rss_kib: int | None
    size: int | None


class Monitor:
    """Samples server RSS and table size in a thread until stopped.

    Args:
      pids: Server process ids (may be empty).
      addresses: The shards.
      interval_s: Seconds between samples.
    """

    def __init__(self, pids: Sequence[int], addresses: Sequence[str], interval_s: float) -> None:
        self._pids = list(pids)
        self._addresses = list(addresses)
        self._interval = interval_s
        self._start = time.monotonic()
        self._stop = threading.Event()
        self.samples: list[Sample] = []
        self._thread = threading.Thread(target=self._loop, name="load-test-monitor", daemon=True)

    def start(self) -> None:
        """Starts sampling; `t` counts from now."""
        self._start = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        """Stops sampling (waits for the thread at most one status timeout). Idempotent."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=STATUS_TIMEOUT_S + self._interval)

    def sample(self) -> Sample:
        """Takes one reading now and records it."""
        rss = [read_rss_kib(pid) for pid in self._pids]
        try:
            size: int | None = sharded_status(
                self._addresses, TABLE_NAME, STATUS_TIMEOUT_S
            ).total.size
        except ReplayServiceError:
            size = None
        reading = Sample(
            t=time.monotonic() - self._start,
            rss_kib=sum(r for r in rss if r is not None) if rss and None not in rss else None,
            size=size,
        )
        self.samples.append(reading)
        return reading

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self.sample()


# ---------------------------------------------------------------------------------- the run


@dataclasses.dataclass
class _Outcome:
    """What the processes reported (mutable while the run goes on)."""

    results: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    problems: list[str] = dataclasses.field(default_factory=list)


def run_load_test(config: LoadTestConfig) -> LoadTestReport:
    """Runs the load test described by `config` and reconciles the counts.

    Args:
      config: What to run.

    Returns:
      The report; `report.ok` tells whether every check held.

    Raises:
      ReplayServiceError: If the servers cannot be started or reached at all.
    """
    exit_codes: list[int | None] = []
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="replay_load_test_") as workdir:
        if config.addresses:
            report = _run_against(config, list(config.addresses), list(config.server_pids), began)
        else:
            with local_servers(config, workdir, exit_codes) as servers:

                def wait_servers() -> None:
                    for server in servers:
                        server.wait_listening(config.start_timeout_s)

                addresses = [s.address for s in servers]
                report = _run_against(
                    config, addresses, [s.pid for s in servers], began, wait_servers
                )
    report = dataclasses.replace(report, total_s=time.monotonic() - began)
    if exit_codes:
        clean = all(code == 0 for code in exit_codes)
        detail = f"exit codes {exit_codes} (None: killed after {SERVER_STOP_TIMEOUT_S:g} s)"
        report = dataclasses.replace(
            report, checks=(*report.checks, Check("servers stopped cleanly", clean, detail))
        )
    return report


def _run_against(
    config: LoadTestConfig,
    addresses: list[str],
    pids: list[int],
    began: float,
    wait_servers: Callable[[], None] | None = None,
) -> LoadTestReport:
    """Runs the workers against `addresses`; `wait_servers` runs once they are launching."""
    ctx = multiprocessing.get_context("spawn")
    ready, results = ctx.Queue(), ctx.Queue()
    go, stop = ctx.Event(), ctx.Event()
    channels = (ready, results, go, stop)
    roles = [("collector", i) for i in range(config.num_collectors)] + [("learner", 0)]
    processes = {
        f"{role}-{index}": ctx.Process(
            target=worker_main,
            args=(role, index, config, addresses, channels),
            name=f"load-test-{role}-{index}",
            daemon=True,
        )
        for role, index in roles
    }
    outcome = _Outcome()
    monitor = Monitor(pids, addresses, config.monitor_interval_s)
    try:
        for process in processes.values():
            process.start()
        if wait_servers is not None:
            wait_servers()
        _wait_ready(processes, ready, config.start_timeout_s)
        before = sharded_status(addresses, TABLE_NAME, STATUS_TIMEOUT_S).total
        monitor.start()
        started = time.monotonic()
        startup = started - began
        go.set()
        _run_for(processes, config.duration_s, outcome)
        stop.set()
        duration = time.monotonic() - started
        _collect_results(processes, results, outcome)
        monitor.stop()
        monitor.sample()
        after = sharded_status(addresses, TABLE_NAME, STATUS_TIMEOUT_S).total
    finally:
        stop.set()
        go.set()
        monitor.stop()
        _reap(processes, outcome)
    report = _report(config, len(addresses), duration, before, after, monitor.samples, outcome)
    return dataclasses.replace(report, startup_s=startup)


def _wait_ready(processes: dict[str, Any], ready: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = set(processes)
    while pending and time.monotonic() < deadline:
        try:
            name, error = ready.get(timeout=0.5)
        except queue.Empty:
            dead = sorted(n for n in pending if not processes[n].is_alive())
            if dead:
                raise ReplayServiceError(
                    f"{', '.join(dead)} exited before becoming ready (exit codes "
                    f"{[processes[n].exitcode for n in dead]})"
                ) from None
            continue
        if error is not None:
            raise ReplayServiceError(f"{name} could not start: {error}")
        pending.discard(name)
    if pending:
        raise ReplayServiceError(f"{', '.join(sorted(pending))} not ready within {timeout} s")


def _run_for(processes: dict[str, Any], duration_s: float, outcome: _Outcome) -> None:
    end = time.monotonic() + duration_s
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(left, 0.5))
        dead = sorted(n for n, p in processes.items() if not p.is_alive())
        if dead:
            outcome.problems.append(f"{', '.join(dead)} exited early; stopped the run")
            return


def _collect_results(processes: dict[str, Any], results: Any, outcome: _Outcome) -> None:
    deadline = time.monotonic() + STOP_GRACE_S
    while len(outcome.results) < len(processes) and time.monotonic() < deadline:
        waiting = [p for n, p in processes.items() if n not in outcome.results]
        all_gone = not any(p.is_alive() for p in waiting)
        try:
            name, result = results.get(timeout=0.5)
        except queue.Empty:
            if all_gone:  # they exited before the last get: nothing more can arrive
                break
            continue
        outcome.results[name] = result
        if "error" in result:
            outcome.problems.append(f"{name} failed: {result['error']}")
    missing = sorted(set(processes) - set(outcome.results))
    if missing:
        outcome.problems.append(f"no result from {', '.join(missing)} within {STOP_GRACE_S:g} s")


def _reap(processes: dict[str, Any], outcome: _Outcome) -> None:
    deadline = time.monotonic() + STOP_GRACE_S
    for name, process in processes.items():
        process.join(timeout=max(0.1, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join(timeout=10)
            outcome.problems.append(f"{name} did not exit within {STOP_GRACE_S:g} s; killed")


# ---------------------------------------------------------------------------------- report


def percentiles(values_ns: np.ndarray, scale: float) -> tuple[float, float, float]:
    """Returns p50, p90, p99 of `values_ns` divided by `scale` (0s when empty)."""
    if values_ns.size == 0:
        return (0.0, 0.0, 0.0)
    p50, p90, p99 = np.percentile(values_ns, [50, 90, 99]) / scale
    return (float(p50), float(p90), float(p99))


def _mib(kib: int | None) -> float | None:
    return None if kib is None else kib / 1024.0


def _memory(
    samples: Sequence[Sample], duration_s: float, total_capacity: int
) -> tuple[float | None, float | None, float | None, bool | None]:
    rss = [s for s in samples if s.rss_kib is not None]
    if not rss:
        return None, None, None, None
    mid = next((s for s in rss if s.t >= duration_s / 2), rss[-1])
    full = None if mid.size is None else mid.size >= total_capacity
    return _mib(max(s.rss_kib or 0 for s in rss)), _mib(rss[-1].rss_kib), _mib(mid.rss_kib), full


def _report(
    config: LoadTestConfig,
    num_shards: int,
    duration: float,
    before: Any,
    after: Any,
    samples: Sequence[Sample],
    outcome: _Outcome,
) -> LoadTestReport:
    collectors = [r for n, r in outcome.results.items() if n.startswith("collector")]
    learner = outcome.results.get("learner-0", {})
    collector_items = sum(int(r.get("items", 0)) for r in collectors)
    observer_ns = np.concatenate(
        [r["latencies_ns"] for r in collectors if "latencies_ns" in r] or [np.zeros(0, np.int64)]
    )
    learner_ns = learner.get("latencies_ns", np.zeros(0, np.int64))
    inserts = after.inserts - before.inserts
    samples_count = after.samples - before.samples
    learner_items = int(learner.get("items", 0))
    rss_max, rss_final, rss_mid, full = _memory(samples, duration, config.capacity * num_shards)
    growth = None if rss_final is None or rss_mid is None else rss_final - rss_mid
    checks = _checks(outcome, inserts, collector_items, samples_count, learner_items)
    first = learner.get("first_batch_ns")
    return LoadTestReport(
        duration_s=duration,
        num_shards=num_shards,
        num_collectors=config.num_collectors,
        capacity=config.capacity,
        batch_size=config.batch_size,
        server_inserts=inserts,
        collector_items=collector_items,
        collector_steps=sum(int(r.get("steps", 0)) for r in collectors),
        server_samples=samples_count,
        learner_items=learner_items,
        learner_batches=int(learner.get("batches", 0)),
        inserts_per_s=inserts / duration,
        samples_per_s=samples_count / duration,
        learner_items_per_s=learner_items / duration,
        observer_latency_us=percentiles(observer_ns, 1e3),
        learner_latency_ms=percentiles(learner_ns, 1e6),
        first_batch_s=None if first is None else first / 1e9,
        rss_max_mib=rss_max,
        rss_final_mib=rss_final,
        rss_mid_mib=rss_mid,
        rss_growth_mib=growth,
        table_full_at_mid=full,
        checks=(*checks, _plateau_check(config, full, rss_mid, growth)),
    )


def _checks(
    outcome: _Outcome, inserts: int, collector_items: int, samples_count: int, learner_items: int
) -> tuple[Check, ...]:
    problems = "; ".join(outcome.problems) or "all ready, finished and exited in time"
    return (
        Check("processes finished in time", not outcome.problems, problems),
        Check(
            "server inserts == collector items",
            inserts == collector_items and inserts > 0,
            f"{inserts} inserts counted, {collector_items} items reported",
        ),
        Check(
            "server samples >= learner items",
            samples_count >= learner_items > 0,
            f"{samples_count} samples counted, {learner_items} items consumed",
        ),
    )


def _plateau_check(
    config: LoadTestConfig, full: bool | None, rss_mid: float | None, growth: float | None
) -> Check:
    if rss_mid is None or growth is None:
        return Check("server RSS plateaus", None, "RSS not measured (pass --server_pids)")
    pct = 100.0 * growth / rss_mid if rss_mid else 0.0
    detail = f"{growth:+.1f} MiB ({pct:+.1f}%) over the second half"
    if not full:
        return Check("server RSS plateaus", None, f"{detail}; table not full by mid-run")
    limit = config.max_rss_growth_pct
    return Check("server RSS plateaus", pct <= limit, f"{detail}; limit {limit:g}%")


def format_report(report: LoadTestReport) -> str:
    """Renders the report as a two-column table followed by the checks."""

    def fmt(values: tuple[float, float, float], unit: str) -> str:
        return " / ".join(f"{v:.2f}" for v in values) + f" {unit}"

    def mib(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1f} MiB"

    rows = [
        ("duration", f"{report.duration_s:.1f} s"),
        ("start-up / whole run", f"{report.startup_s:.1f} s / {report.total_s:.1f} s"),
        ("shards / collectors / learners", f"{report.num_shards} / {report.num_collectors} / 1"),
        ("capacity per shard", f"{report.capacity} items"),
        ("inserts (servers)", str(report.server_inserts)),
        ("items written (collectors)", str(report.collector_items)),
        ("samples (servers)", str(report.server_samples)),
        ("items consumed (learner)", f"{report.learner_items} ({report.learner_batches} batches)"),
        ("inserts/s", f"{report.inserts_per_s:.0f}"),
        ("samples/s (servers)", f"{report.samples_per_s:.0f}"),
        ("items consumed/s (learner)", f"{report.learner_items_per_s:.0f}"),
        ("observer call p50/p90/p99", fmt(report.observer_latency_us, "us")),
        ("learner next() p50/p90/p99", fmt(report.learner_latency_ms, "ms")),
        (
            "learner first batch",
            "n/a" if report.first_batch_s is None else f"{report.first_batch_s:.2f} s",
        ),
        ("server RSS max / final", f"{mib(report.rss_max_mib)} / {mib(report.rss_final_mib)}"),
        (
            "server RSS growth, 2nd half",
            "n/a" if report.rss_growth_mib is None else f"{report.rss_growth_mib:+.1f} MiB",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    lines.append("")
    for check in report.checks:
        mark = {True: "PASS", False: "FAIL", None: "n/a "}[check.ok]
        lines.append(f"[{mark}] {check.name}: {check.detail}")
    lines.append(f"result: {'PASS' if report.ok else 'FAIL'}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------- command


def _define_flags() -> Any:
    from absl import flags

    flags.DEFINE_float(
        "duration_s",
        DEFAULT_DURATION_S,
        f"Seconds of load after every process is ready (at most {MAX_DURATION_S:g}).",
    )
    flags.DEFINE_integer(
        "num_collectors", DEFAULT_COLLECTORS, "Collector processes (collector i -> shard i % N)."
    )
    flags.DEFINE_integer(
        "capacity",
        DEFAULT_CAPACITY,
        "Items per shard. Keep it below what is written (a few thousand items/s) so the table "
        "fills and evicts, which is what the RSS plateau check is about.",
    )
    flags.DEFINE_integer("batch_size", DEFAULT_BATCH_SIZE, "Items per learner batch.")
    flags.DEFINE_integer(
        "num_shards", 1, "Local replay-server processes to start (ignored with --addresses)."
    )
    flags.DEFINE_list(
        "addresses",
        [],
        "Comma-separated host:port of running servers to use instead of starting any; their "
        f"table {TABLE_NAME!r} must hold CartPole-shaped 2-step items with --capacity.",
    )
    flags.DEFINE_list("server_pids", [], "Process ids of the --addresses servers, for RSS.")
    flags.DEFINE_float(
        "max_rss_growth_pct",
        DEFAULT_MAX_RSS_GROWTH_PCT,
        "Fail if server RSS grows by more than this over the second half once the table is full.",
    )
    flags.DEFINE_float(
        "monitor_interval_s", DEFAULT_MONITOR_INTERVAL_S, "Seconds between RSS samples."
    )
    flags.DEFINE_string("json", None, "Also write the report as JSON to this path.")
    return flags.FLAGS


def _config_from_flags(values: Any) -> LoadTestConfig:
    try:
        pids = tuple(int(p) for p in values.server_pids)
    except ValueError:
        raise ConfigError(f"--server_pids must be integers, got {values.server_pids!r}") from None
    return LoadTestConfig(
        duration_s=values.duration_s,
        num_collectors=values.num_collectors,
        capacity=values.capacity,
        batch_size=values.batch_size,
        num_shards=values.num_shards,
        addresses=tuple(values.addresses),
        server_pids=pids,
        max_rss_growth_pct=values.max_rss_growth_pct,
        monitor_interval_s=values.monitor_interval_s,
    )


def _main(argv: list[str], values: Any) -> int:
    if len(argv) > 1:
        print(f"error: unexpected arguments {argv[1:]!r}; see --help", file=sys.stderr)
        return EXIT_USAGE
    try:
        config = _config_from_flags(values)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        report = run_load_test(config)
    except ReplayServiceError as e:
        print(f"error: load test could not run: {e}", file=sys.stderr)
        return EXIT_FAILED
    print(format_report(report))
    if values.json:
        with open(values.json, "w", encoding="utf-8") as f:
            json.dump(report.to_json(), f, indent=2)
    return 0 if report.ok else EXIT_FAILED


def _parse_flags(argv: list[str]) -> list[str]:
    """Parses the flags; `--help` prints this docstring and the flags, then exits with 0."""
    from absl import flags

    args = argv[1 : argv.index("--")] if "--" in argv else argv[1:]
    if HELP_ARGS.intersection(args):
        print(f"{__doc__.strip()}\n\nflags:\n{flags.FLAGS.main_module_help()}")
        sys.exit(0)
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        print(f"error: {e} (see --help)", file=sys.stderr)
        sys.exit(EXIT_USAGE)


if __name__ == "__main__":
    from absl import app

    _flag_values = _define_flags()
    app.run(lambda argv: _main(argv, _flag_values), flags_parser=_parse_flags)

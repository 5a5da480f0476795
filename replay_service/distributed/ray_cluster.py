"""Shards and collectors as Ray actors (needs the `ray` extra).

    ray.init()
    shards = start_shards("configs/cartpole.toml", num_shards=2, root_dir="runs/ray/replay",
                          checkpoint_interval_s=60)
    config = shards.config                    # a sharding.ShardedConfig, one address per shard
    collectors = [start_collector(config, i, data_spec, capacity=100_000) for i in range(4)]
    ray.get([c.collect.remote(steps=1000) for c in collectors])
    with ShardedReplayBuffer(config, data_spec, 100_000).load() as buffer: ...
    shards.stop()                             # final checkpoint on every shard

Shard `i` is a `replay-server` in a Ray actor, checkpointing into `<root_dir>/shard-<i>` on a
port chosen once, so its address stays the same across restarts. If its process dies, Ray
restarts the actor (up to `max_restarts` times) and the new one restores the newest checkpoint
that verifies (the `--restore_if_exists` rule of `checkpointed_server.serve_config`): what a
crash loses is at most one `checkpoint_interval_s` plus one checkpoint's duration of confirmed
items. A restarted actor must run on a node that sees the same `root_dir` (one node, or a
shared filesystem).

Collector `i` writes to shard `i % N` (`ShardedConfig.shard_index`), through a remote
`ReplayBufferManager`.

Every actor reserves `DEFAULT_NUM_CPUS` (0.25) of a CPU by default, so two shards and four
collectors (1.5 CPUs) fit on a 2-CPU machine; pass `num_cpus=` to reserve more. Starting an
actor waits for it within a bound: one that Ray cannot place (not enough free resources) or that
does not finish starting in time is killed and reported, with what it asked for and what the
cluster has, instead of waiting forever.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import time
from typing import Any

from replay_service.backends.reverb.connection import pick_free_port
from replay_service.config.files import load_config
from replay_service.config.options import (
    DEFAULT_TABLE_NAME,
    MAX_TIMEOUT_S,
    Timeouts,
    require_number,
    require_positive_int,
)
from replay_service.distributed.shard_config import ShardedConfig
from replay_service.errors import ConfigError, ReplayServiceError, ServerUnavailableError

SHARD_DIR_PREFIX = "shard-"
DEFAULT_START_TIMEOUT_S = 300.0
"""Seconds a shard may take to be placed and to start (restoring its checkpoint included)."""
DEFAULT_COLLECTOR_START_TIMEOUT_S = 120.0
"""Seconds a collector may take to be placed and to start (importing TF-Agents, connecting)."""
DEFAULT_NUM_CPUS = 0.25
"""CPUs Ray reserves for each shard and collector actor unless told otherwise. A reservation is
a scheduling share, not a limit: the process uses what it needs."""


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ConfigError(
            "replay_service.distributed.ray_cluster needs Ray: pip install 'replay_service[ray]'"
        ) from e
    return ray


class ShardServer:
    """One shard: a `CheckpointedServer` started by `serve_config` in a Ray actor.

    A new actor (first start or restart after a crash) restores the newest checkpoint of its
    directory if there is one and starts empty otherwise.

    Args:
      config_path: TOML config of the server (tables, data spec); None: the defaults.
      checkpoint_dir: This shard's checkpoint directory.
      port: The port to serve on (kept across restarts).
      checkpoint_interval_s: Seconds between checkpoints (0: only on stop).
    """

    def __init__(
        self,
        config_path: str | None,
        checkpoint_dir: str,
        port: int,
        checkpoint_interval_s: float,
    ) -> None:
        from replay_service.backends.reverb.server import serve_config
        from replay_service.starter.envs import load_env

        config = load_config(
            config_path,
            server__port=port,
            server__checkpoint_dir=checkpoint_dir,
            server__checkpoint_interval_s=checkpoint_interval_s,
        )
        self._server = serve_config(config, config.data_spec.build(load_env), restore=None)
        self._host = _node_address()

    def address(self) -> str:
        """ "host:port" of this shard, reachable from other nodes."""
        return f"{self._host}:{self._server.port}"

    def info(self) -> dict[str, Any]:
        """pid, address and the checkpoint this start restored (None: started empty)."""
        restored = self._server.restored_from
        return {
            "pid": os.getpid(),
            "address": self.address(),
            "restored_from": restored.path if restored else None,
            "restored_items": restored.num_items if restored else None,
        }

    def checkpoint(self) -> str:
        """Takes a checkpoint now; returns its path."""
        return self._server.checkpoint().path

    def stop(self) -> str | None:
        """Stops confirming writes, takes a final checkpoint and stops; returns its path."""
        final = self._server.stop(final_checkpoint=True)
        return final.path if final else None


class Collector:
    """A collector in a Ray actor: CartPole-like gym environments with a random policy, written
    through an observer to its shard. For other environments or policies, subclass and override
    `collect`.

    Args:
      config: The shards.
      collector_id: This collector's id; it writes to shard `collector_id % N`.
      data_spec: Per-step data spec (a TF-Agents Trajectory spec).
      capacity: Items per shard, as configured on the servers.
      sequence_length: Steps per item.
      table_name: The sharded table.
      timeouts: Bounds on blocking calls.
      env_name: Gym environment id for `collect`.
    """

    def __init__(
        self,
        config: ShardedConfig,
        collector_id: int,
        data_spec: Any,
        capacity: int,
        sequence_length: int = 2,
        table_name: str = DEFAULT_TABLE_NAME,
        timeouts: Timeouts | None = None,
        env_name: str = "CartPole-v0",
    ) -> None:
        from replay_service.manager import ReplayBufferManager

        self._address = config.address_for(collector_id)
        self._manager = ReplayBufferManager(
            data_spec,
            capacity,
            sequence_length=sequence_length,
            table_name=table_name,
            server_address=self._address,
            timeouts=timeouts,
        )
        self._manager.load_replay_buffer()
        self._env_name = env_name
        self._seed = collector_id

    def address(self) -> str:
        """The shard this collector writes to."""
        return self._address

    def collect(self, steps: int) -> int:
        """Runs `steps` environment steps into the shard and waits until they are confirmed.

        Returns:
          The shard's item count after the flush.
        """
        from tf_agents.drivers import py_driver
        from tf_agents.environments import suite_gym
        from tf_agents.policies import random_py_policy

        env = suite_gym.load(self._env_name)
        env.seed(self._seed)
        policy = random_py_policy.RandomPyPolicy(
            env.time_step_spec(), env.action_spec(), seed=self._seed
        )
        self._seed += 1000
        _, observer = self._manager.get_replay_buffer_and_observer()
        py_driver.PyDriver(env, policy, [observer], max_steps=steps).run(env.reset())
        observer.flush()
        return self._manager.num_frames()

    def close(self) -> None:
        """Flushes and releases the connection."""
        self._manager.close()


def _node_address() -> str:
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except Exception:  # outside Ray (tests of the class itself)
        return socket.gethostname()


def _check_num_cpus(num_cpus: object) -> float:
    """Returns `num_cpus` as a float.

    Raises:
      ConfigError: If it is not a finite number >= 0 (Ray takes fractions below 1).
    """
    if (
        isinstance(num_cpus, bool)
        or not isinstance(num_cpus, (int, float))
        or not math.isfinite(num_cpus)
        or num_cpus < 0
    ):
        raise ConfigError(f"num_cpus must be a finite number >= 0, got {num_cpus!r}")
    return float(num_cpus)


def _check_timeout(name: str, value: object) -> float:
    """Returns the timeout `value` (seconds), unchanged.

    Raises:
      ConfigError: If it is not a finite number > 0 and <= `MAX_TIMEOUT_S` (None, which would
        wait forever, NaN and negative values included), naming `name` and the value.
    """
    return require_number(name, value, 0, positive=True, maximum=MAX_TIMEOUT_S)


def _wait_started(
    ray: Any,
    started: list[tuple[str, Any, Any]],
    resources: dict[str, float],
    timeout: float,
    error: type[ReplayServiceError],
) -> list[Any]:
    """Waits until every actor answers its first call; kills them all if one does not.

    Args:
      ray: The `ray` module.
      started: `(name, actor, ref of a first call)` per actor.
      resources: What each actor asked Ray for, e.g. `{"CPU": 0.25}`.
      timeout: Seconds for all of them together.
      error: The class of the error raised.

    Returns:
      The first calls' results, in order.

    Raises:
      ReplayServiceError: (`error`) If an actor was not placed or did not finish starting
        within `timeout` (naming it, what it asked for and what the cluster has), or failed
        while starting (with Ray's error).
    """
    refs = [ref for _, _, ref in started]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    done = {ref.hex() for ref in ready}
    pending = [name for name, _, ref in started if ref.hex() not in done]
    results: list[Any] = []
    failure = None
    if pending:
        try:
            total, available = ray.cluster_resources(), ray.available_resources()
        except Exception as e:  # a cluster that does not answer is reported as such
            total = available = f"unknown ({e})"
        failure = (
            f"{', '.join(pending)} did not start within {timeout} s. Each asked Ray for "
            f"{resources}; the cluster has {total} in all, {available} free. An actor that "
            "Ray cannot place waits for free resources: pass a smaller num_cpus, stop other "
            "actors or give Ray more CPUs (ray.init(num_cpus=...)); one that was placed but "
            "starts slowly (restoring a large checkpoint) needs a larger start_timeout_s"
        )
    else:
        for name, _, ref in started:
            try:
                results.append(ray.get(ref, timeout=timeout))
            except Exception as e:  # RayActorError, RayTaskError: the constructor failed
                failure = f"{name} failed while starting: {e}"
                break
    if failure is None:
        return results
    for _, actor, _ in started:
        ray.kill(actor, no_restart=True)
    raise error(failure)


@dataclasses.dataclass
class RayShards:
    """Running shard actors.

    Attributes:
      config: Their addresses as a `ShardedConfig` (shard order).
      actors: The actor handles, in shard order.
      checkpoint_dirs: Each shard's checkpoint directory.
    """

    config: ShardedConfig
    actors: list[Any]
    checkpoint_dirs: list[str]

    def wait_ready(self, index: int, timeout: float = DEFAULT_START_TIMEOUT_S) -> dict[str, Any]:
        """Waits until shard `index` (e.g. after a restart) serves again; returns its `info()`.

        Raises:
          ServerUnavailableError: If it does not within `timeout` seconds.
          ConfigError: If `timeout` is not a finite number of seconds > 0.
        """
        ray = _ray()
        timeout = _check_timeout("timeout", timeout)
        try:
            return ray.get(self.actors[index].info.remote(), timeout=timeout)
        except Exception as e:  # GetTimeoutError, RayActorError
            raise ServerUnavailableError(
                f"shard {index} ({self.config.addresses[index]}) did not serve within "
                f"{timeout} s: {e}"
            ) from e

    def wait_restarted(
        self, index: int, old_pid: int, timeout: float = DEFAULT_START_TIMEOUT_S
    ) -> dict[str, Any]:
        """Waits until shard `index` serves from a process other than `old_pid` (Ray restarted
        it after a crash); returns its `info()`.

        Raises:
          ServerUnavailableError: If that does not happen within `timeout` seconds.
          ConfigError: If `timeout` is not a finite number of seconds > 0.
        """
        deadline = time.monotonic() + _check_timeout("timeout", timeout)
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                left = max(0.01, min(10.0, deadline - time.monotonic()))
                info = self.wait_ready(index, timeout=left)
                if info["pid"] != old_pid:
                    return info
            except ServerUnavailableError as e:  # still restarting
                last = e
            time.sleep(0.5)
        raise ServerUnavailableError(
            f"shard {index} ({self.config.addresses[index]}) was not restarted within "
            f"{timeout} s (old pid {old_pid}){f': {last}' if last else ''}"
        )

    def stop(self, timeout: float = DEFAULT_START_TIMEOUT_S) -> list[str | None]:
        """Takes a final checkpoint on every shard and ends the actors.

        Returns:
          Each shard's final checkpoint path (None where it failed; the actor is killed anyway).

        Raises:
          ConfigError: If `timeout` is not a finite number of seconds > 0 (nothing is stopped).
        """
        ray = _ray()
        timeout = _check_timeout("timeout", timeout)
        paths: list[str | None] = []
        for actor in self.actors:
            try:
                paths.append(ray.get(actor.stop.remote(), timeout=timeout))
            except Exception:  # an actor that is gone or hangs is killed below
                paths.append(None)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        return paths


def start_shards(
    config_path: str | os.PathLike[str] | None,
    num_shards: int,
    root_dir: str | os.PathLike[str],
    *,
    checkpoint_interval_s: float = 60.0,
    max_restarts: int = 3,
    num_cpus: float = DEFAULT_NUM_CPUS,
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
) -> RayShards:
    """Starts `num_shards` replay-server actors and waits until every one serves.

    Args:
      config_path: TOML config of every shard (see `configs/`); None: the defaults.
      num_shards: How many shards.
      root_dir: Shard `i` checkpoints into `<root_dir>/shard-<i>` (restoring what is there).
      checkpoint_interval_s: Seconds between checkpoints; bounds what a crash loses.
      max_restarts: How often Ray restarts a shard whose process died (-1: always).
      num_cpus: CPUs Ray reserves for each shard (default 0.25, a scheduling share: the
        Reverb server uses what it needs). Two shards and four collectors with the defaults
        take 1.5 CPUs; reserve 1 or more to give each shard a core of its own.
      start_timeout_s: Seconds the shards may take to be placed by Ray and to start
        (restoring included).

    Returns:
      The actors and their `ShardedConfig`.

    Raises:
      ConfigError: If Ray is missing or a value is invalid (`start_timeout_s` must be a
        finite number of seconds > 0); no actor was started then.
      ServerUnavailableError: If a shard fails to start, or is not placed (not enough free
        resources for `num_cpus`) or not serving within `start_timeout_s`; the message names
        it, what it asked for and what the cluster has. Every shard is killed then.
    """
    ray = _ray()
    require_positive_int("num_shards", num_shards, maximum=None)
    path = None if config_path is None else os.path.abspath(os.fspath(config_path))
    cpus = _check_num_cpus(num_cpus)
    timeout = _check_timeout("start_timeout_s", start_timeout_s)
    load_config(path)  # a bad config fails here, not in every actor
    remote_cls = ray.remote(max_restarts=max_restarts, max_task_retries=0, num_cpus=cpus)(
        ShardServer
    )
    dirs = [
        os.path.join(os.path.abspath(os.fspath(root_dir)), f"{SHARD_DIR_PREFIX}{i}")
        for i in range(num_shards)
    ]
    actors = [
        remote_cls.remote(path, directory, pick_free_port(), float(checkpoint_interval_s))
        for directory in dirs
    ]
    addresses = _wait_started(
        ray,
        [
            (f"shard {i} ({directory})", actor, actor.address.remote())
            for i, (directory, actor) in enumerate(zip(dirs, actors, strict=True))
        ],
        {"CPU": cpus},
        timeout,
        ServerUnavailableError,
    )
    return RayShards(
        config=ShardedConfig(addresses=tuple(addresses)), actors=actors, checkpoint_dirs=dirs
    )


def start_collector(
    config: ShardedConfig,
    collector_id: int,
    data_spec: Any,
    capacity: int,
    *,
    num_cpus: float = DEFAULT_NUM_CPUS,
    start_timeout_s: float = DEFAULT_COLLECTOR_START_TIMEOUT_S,
    **kwargs: Any,
) -> Any:
    """Starts a `Collector` actor writing to shard `collector_id % N` and waits until it has
    connected to its shard.

    Args:
      config: The shards (e.g. `start_shards(...).config`).
      collector_id: The collector's id.
      data_spec: Per-step data spec.
      capacity: Items per shard.
      num_cpus: CPUs Ray reserves for the actor (default 0.25, a scheduling share: the
        environment loop uses what it needs).
      start_timeout_s: Seconds the actor may take to be placed by Ray and to start.
      **kwargs: `Collector` options (`sequence_length`, `table_name`, `timeouts`, `env_name`).

    Returns:
      The actor handle; call `collector.collect.remote(steps)`.

    Raises:
      ConfigError: If Ray is missing, or `num_cpus` or `start_timeout_s` (a finite number of
        seconds > 0) is invalid; no actor was started then.
      ReplayServiceError: If the actor fails to start (e.g. its shard does not answer), or is
        not placed (not enough free resources for `num_cpus`) or not started within
        `start_timeout_s`; the message names it, what it asked for and what the cluster has.
        The actor is killed then.
    """
    ray = _ray()
    cpus = _check_num_cpus(num_cpus)
    timeout = _check_timeout("start_timeout_s", start_timeout_s)
    actor = ray.remote(num_cpus=cpus)(Collector).remote(
        config, collector_id, data_spec, capacity, **kwargs
    )
    name = f"collector {collector_id} (shard {config.address_for(collector_id)})"
    _wait_started(
        ray,
        [(name, actor, actor.address.remote())],
        {"CPU": cpus},
        timeout,
        ReplayServiceError,
    )
    return actor

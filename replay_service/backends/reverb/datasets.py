"""tf.data sampling with bounded waits: the read pipeline every sampling path shares.

Two things can leave a learner waiting in `next()`:

- an empty table (or a rate limiter waiting for inserts): Reverb datasets built with
  `rate_limiter_timeout_ms` simply end when no item arrives in time, which a training loop sees
  as a silently exhausted dataset; `raise_when_exhausted` turns that end into an error that says
  why;
- a lost server (killed, stopped, or the embedded manager closed): Reverb's sampler retries
  UNAVAILABLE forever, so the iterator blocks for good; `guard_liveness` watches the server
  beside the sample stream and fails it within `liveness_bound(Timeouts.sample,
  Timeouts.connect)` seconds.

`bound_sampling` applies both, and every sampling path goes through it: `read_pipeline`
(`get_dataset`, `torch_batches`, `torch_dataset`), `mixed_dataset`, and `ReplayBuffer.as_dataset`
(TF-Agents' pipeline; the sharded datasets are built from it).
"""

from __future__ import annotations

import atexit
import dataclasses
import math
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import reverb
import tensorflow as tf
from tf_agents.replay_buffers import reverb_replay_buffer

from replay_service.backends.reverb.tables import check_mix_weights, find_table
from replay_service.config.options import TableConfig, require_positive_int, to_ms
from replay_service.errors import ConfigError
from replay_service.integrations import tf_compat
from replay_service.specs.layouts import NESTED, Layout, as_layout
from replay_service.specs.nests import table_signature

tf_compat.patch_inspect()  # lets TF-Agents' PolicySaver save policies (see tf_compat)

EMPTY_BUFFER_MESSAGE = "replay_service: no item could be sampled"


def raise_when_exhausted(dataset: tf.data.Dataset, message: str) -> tf.data.Dataset:
    """Makes `dataset` raise `tf.errors.InvalidArgumentError(message)` instead of ending.

    Args:
      dataset: A dataset that ends only when sampling timed out.
      message: The error message.

    Returns:
      A dataset with the same elements and element spec.
    """
    spec = dataset.element_spec

    def fail(_: tf.Tensor) -> Any:
        check = tf.debugging.Assert(tf.constant(False), [tf.constant(message)], name="sampling")
        with tf.control_dependencies([check]):
            return tf.nest.map_structure(
                lambda s: tf.zeros([d if d is not None else 0 for d in s.shape], s.dtype), spec
            )

    return dataset.concatenate(tf.data.Dataset.range(1).map(fail))


def sampling_timeout_message(table_name: str, timeout_s: float | None) -> str:
    """The error text of a sampling timeout on `table_name`."""
    return (
        f"{EMPTY_BUFFER_MESSAGE} from table {table_name!r} within {timeout_s} s: the buffer is "
        "empty (or holds fewer items than min_size_to_sample), or its samples-per-insert rate "
        "limiter waits for more inserts. Collect data first, or raise Timeouts.sample."
    )


# Reverb's sampler error for an item whose columns are not the table signature's.
FOREIGN_ITEM_ERROR = "Inconsistent number of tensors received"


def foreign_item_message(table_name: str, reverb_message: str) -> str:
    """The error text of sampling an item that does not match `table_name`'s signature.

    Args:
      table_name: The sampled table.
      reverb_message: Reverb's own message (kept at the end).

    Returns:
      What happened, the usual cause and what to do.
    """
    return (
        f"table {table_name!r} holds an item whose columns are not its signature's: it was "
        "written by a writer that does not check items against the table signature, such as "
        "TF-Agents' ReverbAddTrajectoryObserver (validate_items=False) on a layout='packed' "
        "table (whose steps are one uint8 column). Write through the manager's observer() or "
        "writers; export() skips such items with a warning, so the others can be imported into "
        f"a new buffer. Reverb: {reverb_message}"
    )


# ---------------------------------------------------------------------------- server liveness

# Reverb's sampler treats UNAVAILABLE as transient and retries it forever, so an iterator whose
# server died (or whose embedded manager was closed) blocks in `next()` for good;
# `rate_limiter_timeout_ms` only bounds the wait inside a live server. Every dataset handed out
# is therefore guarded: a watch running beside the sample stream asks the server for its
# `server_info` once per check interval and fails the stream when the server has not answered
# for `Timeouts.sample` seconds.
SERVER_LOST_MESSAGE = "replay_service: lost the Reverb server"
MANAGER_CLOSED_MESSAGE = "replay_service: the manager of this dataset was closed"
# Used as the grace period when Timeouts.sample and Timeouts.connect are both None.
DEFAULT_GRACE_S = 60.0
MAX_CHECK_INTERVAL_S = 1.0
MIN_CHECK_INTERVAL_S = 0.05
MAX_PACE_S = 0.1
MIN_PACE_S = 0.01
# Elements of the guard's input: the sample stream, then watch rounds for as long as it runs.
_ENDLESS = 2**62


class Lifeline:
    """A flag shared by a manager and the datasets it hands out, raised by `close()`, and a count
    of the manager's `clear()` calls, by which torch streams drop what they sampled before one.

    A pickled copy (a DataLoader worker's) keeps the state it had when pickled; such workers
    notice a closed embedded manager through its stopped server instead.
    """

    def __init__(self) -> None:
        self.closed = False
        self.clears = 0

    def close(self) -> None:
        """Makes every guarded dataset holding this lifeline fail at its next check."""
        self.closed = True

    def cleared(self) -> None:
        """Records that the tables were emptied."""
        self.clears += 1


@dataclasses.dataclass(frozen=True)
class LivenessRules:
    """How a guarded dataset watches its server, derived from the timeouts.

    Attributes:
      grace: Seconds the server may stay unreachable before the dataset fails
        (`Timeouts.sample`; `Timeouts.connect`, else `DEFAULT_GRACE_S`, when that is None).
      interval: Seconds between two checks: `grace / 3`, within [0.05, 1].
      pace: Seconds a watch round waits before looking at the clock: `interval / 4`, within
        [0.01, 0.1].
      probe_timeout: Whole seconds one `server_info` check may take: the smaller of `grace`
        and `Timeouts.connect`, rounded, at least 1.
    """

    grace: float
    interval: float
    pace: float
    probe_timeout: int

    @classmethod
    def from_timeouts(cls, sample: float | None, connect: float | None) -> LivenessRules:
        """The rules for `Timeouts.sample` and `Timeouts.connect` (seconds, None: forever)."""
        grace = sample if sample is not None else connect if connect is not None else None
        grace = DEFAULT_GRACE_S if grace is None else float(grace)
        interval = max(MIN_CHECK_INTERVAL_S, min(MAX_CHECK_INTERVAL_S, grace / 3))
        pace = max(MIN_PACE_S, min(MAX_PACE_S, interval / 4))
        probe_timeout = max(1, round(min(grace, connect if connect is not None else grace)))
        return cls(grace, interval, pace, probe_timeout)

    @property
    def bound(self) -> float:
        """The longest a guarded `next()` can block once the server is gone, in seconds.

        The watch runs while the dataset is being pulled, so this counts from the later of the
        loss and the call. The first failing check starts within `interval + pace`; the
        dataset fails at the end of the first failing check `grace` after it, checks being at
        most `interval + pace` apart and each taking at most `probe_timeout`. With
        `Timeouts.sample >= 1` and `Timeouts.connect >= 1` this is at most
        `2 * Timeouts.sample + Timeouts.connect`.
        """
        return self.grace + 2 * (self.interval + self.pace) + self.probe_timeout


def liveness_bound(sample_timeout: float | None, connect_timeout: float | None) -> float:
    """Seconds within which a dataset fails after its server is lost (see `LivenessRules`).

    Args:
      sample_timeout: `Timeouts.sample`.
      connect_timeout: `Timeouts.connect`.

    Returns:
      The bound, e.g. 72.2 s for the default timeouts (sample 60 s, connect 10 s).
    """
    return LivenessRules.from_timeouts(sample_timeout, connect_timeout).bound


# Watch rounds (and the sharded mixture's weight reads) call Python (`tf.py_function`) from
# TensorFlow's threads. Once the interpreter is finalizing, such a thread exits when it asks
# for the GIL, and the function never returns: destroying an iterator that is still alive then
# (a stream or dataset iterator never closed) waited for it forever, and the process did not
# exit. At exit, `_stop_rounds` sets a flag that they read in the graph before calling Python.
_ROUNDS_STOPPED = threading.Event()
_STOP_FLAG: tf.Variable | None = None
_STOP_FLAG_LOCK = threading.Lock()
# How long `_stop_rounds` lets rounds that read the flag just before it was set finish.
_STOP_DRAIN_S = 0.05


def python_calls_stopped() -> tf.Variable:
    """The process's flag that every `tf.py_function` of a sampling pipeline reads in the
    graph first, calling Python only while it is False: set at exit (created, and
    `_stop_rounds` registered with `atexit`, on first use)."""
    global _STOP_FLAG
    with _STOP_FLAG_LOCK:
        if _STOP_FLAG is None:
            with tf.init_scope():
                _STOP_FLAG = tf.Variable(
                    False, trainable=False, name="replay_service_rounds_stopped"
                )
            atexit.register(_stop_rounds)
        return _STOP_FLAG


def _stop_rounds() -> None:
    """Makes every watch round of this process a plain wait that calls no Python (run at
    exit, before the interpreter finalizes); datasets are no longer guarded afterwards."""
    _ROUNDS_STOPPED.set()
    with _STOP_FLAG_LOCK:
        flag = _STOP_FLAG
    if flag is None:
        return
    try:
        flag.assign(True)
    except Exception:  # best effort at exit: TensorFlow may be torn down already
        return
    time.sleep(_STOP_DRAIN_S)  # releases the GIL to rounds already past the flag


class _Watch:
    """The state behind one guarded dataset: when the server was last seen, shared by rounds."""

    def __init__(
        self,
        server_address: str,
        table_name: str | Sequence[str],
        rules: LivenessRules,
        lifeline: Lifeline | None,
    ) -> None:
        self._address = server_address
        self._what = _tables_text(table_name)
        self._rules = rules
        self._lifeline = lifeline
        self._lock = threading.Lock()
        self._client: reverb.Client | None = None
        self._next_check = 0.0
        self._checking = False
        self._down_since: float | None = None
        self._reason = ""

    def round(self) -> str:
        """One watch round: starts a check when one is due, returns the verdict so far.

        Never blocks: the check (`server_info`, up to `probe_timeout`) runs in its own thread,
        so a round holds none of TensorFlow's inter-op threads.

        Returns:
          "" while the dataset may go on, else the message it fails with.
        """
        if _ROUNDS_STOPPED.is_set():
            return ""
        if self._lifeline is not None and self._lifeline.closed:
            return self._closed_message()
        now = time.monotonic()
        with self._lock:
            due = not self._checking and now >= self._next_check
            if due:
                self._checking = True
                self._next_check = now + self._rules.interval
            down_since, reason = self._down_since, self._reason
        if due:
            threading.Thread(
                target=self._check, name="replay_service:liveness", daemon=True
            ).start()
        if down_since is None or now - down_since < self._rules.grace:
            return ""
        return (
            f"{SERVER_LOST_MESSAGE} at {self._address} while sampling {self._what}: it has "
            f"not answered for {now - down_since:.1f} s (limit {self._rules.grace} s, "
            f"Timeouts.sample; last error: {reason}). The server was stopped or crashed, or the "
            "network dropped: restart it (a replay-server restores its latest checkpoint), then "
            "create a new dataset."
        )

    def _check(self) -> None:
        start = time.monotonic()
        try:
            if self._client is None:
                self._client = reverb.Client(self._address)
            self._client.server_info(timeout=self._rules.probe_timeout)
            reason = ""
        except Exception as e:  # Reverb raises RuntimeError or DeadlineExceededError.
            reason = _one_line(e)
        with self._lock:
            self._checking = False
            if not reason:
                self._down_since = None
            elif self._down_since is None:
                self._down_since = start
            self._reason = reason

    def _closed_message(self) -> str:
        return (
            f"{MANAGER_CLOSED_MESSAGE} (server {self._address}, {self._what}): "
            "datasets and batch streams stop with their ReplayBufferManager; create a new "
            "manager, load the buffer and ask it for a new dataset."
        )


def guard_liveness(
    dataset: tf.data.Dataset,
    server_address: str,
    table_name: str | Sequence[str],
    *,
    sample_timeout: float | None,
    connect_timeout: float | None,
    lifeline: Lifeline | None = None,
) -> tf.data.Dataset:
    """Makes an endless sampling dataset fail when its server is gone instead of blocking.

    The result interleaves, without ordering them, `dataset` (element 0) with an endless
    series of watch rounds that produce no element: each waits `LivenessRules.pace`, starts a
    check of the server (in a Python thread) when one is due, and fails with
    `tf.errors.InvalidArgumentError` naming the server, the table and what to do when the
    server has been unreachable for longer than `Timeouts.sample` (or at once when `lifeline`
    is closed). The elements of `dataset` keep
    their order and their element spec; its errors pass through. Iterating it inside a
    `tf.function` is guarded the same way (the rounds call Python through `tf.py_function`,
    so the dataset cannot be serialized, e.g. for the tf.data service).

    Args:
      dataset: Sampling from `server_address`; must not end (turn ends into errors first,
        see `raise_when_exhausted`), since its end would not end the result.
      server_address: "host:port" of its server.
      table_name: The table it samples (or the tables it mixes), for the message.
      sample_timeout: `Timeouts.sample`, the grace period.
      connect_timeout: `Timeouts.connect`, the limit of one check.
      lifeline: Closed by the manager that handed the dataset out.

    Returns:
      The guarded dataset; `next()` fails within `liveness_bound(...)` seconds of the loss.
    """
    rules = LivenessRules.from_timeouts(sample_timeout, connect_timeout)
    watch = _Watch(server_address, table_name, rules, lifeline)

    stopped = python_calls_stopped()

    def call_watch() -> tf.Tensor:
        return tf.reshape(tf.py_function(watch.round, [], tf.string), [])

    def watch_round() -> tf.Tensor:
        message = tf.cond(stopped, lambda: tf.constant(""), call_watch)
        check = tf.debugging.Assert(tf.equal(message, ""), [message], name="server_liveness")
        with tf.control_dependencies([check]):
            return tf.constant(False)

    def keep(index: tf.Tensor) -> tf.Tensor:
        return tf.cond(index == 0, lambda: tf.constant(True), watch_round)

    def branch(index: tf.Tensor) -> tf.data.Dataset:
        # Element 0 is the sample stream; every later one a watch round, which ends empty.
        paced = _sleeping(tf.data.Dataset.from_tensors(index), rules.pace / 2)
        return paced.filter(keep).flat_map(lambda _: dataset)

    # The sloppy parallel interleave gives every cycle element its own thread, on which the
    # rounds sleep, so they hold up neither the sample stream nor TensorFlow's inter-op threads
    # (a round sleeping in Python held one of them and cut the throughput of the maps after
    # it about 3x). `Dataset.interleave(num_parallel_calls=2, deterministic=False)` shares two
    # threads between the stream and the rounds opened ahead, and cut it about 10x. TensorFlow
    # logs once that `parallel_interleave` is deprecated; it is still in TF 2.14 and 2.15.
    return tf.data.Dataset.range(_ENDLESS).apply(
        tf.data.experimental.parallel_interleave(
            branch,
            cycle_length=2,
            block_length=1,
            sloppy=True,
            buffer_output_elements=2,
            prefetch_input_elements=1,
        )
    )


def _sleeping(dataset: tf.data.Dataset, seconds: float) -> tf.data.Dataset:
    """`dataset` whose every `next()` (its end included) first waits `seconds`.

    The wait happens in the iterating thread, inside tf.data (`SleepDataset`), not in a
    function run on an inter-op thread.
    """
    variant = tf.raw_ops.SleepDataset(
        input_dataset=tf.data.experimental.to_variant(dataset),
        sleep_microseconds=max(1, int(seconds * 1e6)),
        output_types=[s.dtype for s in tf.nest.flatten(dataset.element_spec)],
        output_shapes=[s.shape for s in tf.nest.flatten(dataset.element_spec)],
    )
    return tf.data.experimental.from_variant(variant, dataset.element_spec)


def _tables_text(table_name: str | Sequence[str]) -> str:
    if isinstance(table_name, str):
        return f"table {table_name}"
    return "tables " + ", ".join(table_name)


def _one_line(error: BaseException) -> str:
    """The first line of an error, without brackets (which end an assertion's message)."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return lines[0].replace("[", "(").replace("]", ")")


def replay_service_message(error: tf.errors.OpError) -> str | None:
    """The message of a sampling error raised by one of our guards, without TF's decoration.

    Args:
      error: An error raised while iterating a dataset.

    Returns:
      The text from "replay_service:" to the end of the assertion, or None if `error` was not
      raised by `raise_when_exhausted` or `guard_liveness`.
    """
    start = error.message.find("replay_service:")
    if start < 0:
        return None
    end = error.message.find("]", start)
    text = error.message[start : end if end >= 0 else None]
    return text.replace("\\'", "'").replace('\\"', '"')


# ------------------------------------------------------------------------------ read pipeline


def bound_sampling(
    dataset: tf.data.Dataset,
    server_address: str,
    table_name: str | Sequence[str],
    exhausted_message: str,
    *,
    sample_timeout: float | None,
    connect_timeout: float | None,
    lifeline: Lifeline | None,
) -> tf.data.Dataset:
    """The in-flight rules of every sampling dataset: errors instead of an end or a hang.

    Args:
      dataset: Endless batches (or items) sampled from `server_address`, which end only when
        sampling timed out (`rate_limiter_timeout_ms`).
      server_address: "host:port" of the server.
      table_name: The table sampled (or the tables mixed), for messages.
      exhausted_message: The error text when no item arrives within `sample_timeout`.
      sample_timeout: `Timeouts.sample`; None waits for items forever (the server is still
        watched, see `LivenessRules`).
      connect_timeout: `Timeouts.connect`, the limit of one liveness check.
      lifeline: Closed by the manager that hands the dataset out; None: never closed.

    Returns:
      A dataset with the same elements that raises `tf.errors.InvalidArgumentError` with
      `exhausted_message`, or naming the lost server, instead of ending or blocking.
    """
    if sample_timeout is not None:
        dataset = raise_when_exhausted(dataset, exhausted_message)
    return guard_liveness(
        dataset,
        server_address,
        table_name,
        sample_timeout=sample_timeout,
        connect_timeout=connect_timeout,
        lifeline=lifeline,
    )


def default_in_flight(batch_size: int) -> int:
    """Samples requested ahead per Reverb worker: about four batches, at least 64."""
    return max(64, 4 * batch_size)


def read_pipeline(
    server_address: str,
    table_name: str,
    signature: Any,
    batch_size: int,
    *,
    sample_timeout: float | None,
    connect_timeout: float | None = None,
    num_workers: int = 2,
    max_in_flight: int | None = None,
    lifeline: Lifeline | None = None,
    layout: Layout,
    unpack: bool = True,
) -> tf.data.Dataset:
    """Batches of `ReplaySample(info, data)` of one table, bounded by `bound_sampling`.

    `num_workers` `reverb.TrajectoryDataset`s of one worker each with a deep in-flight window,
    each batched on its own thread, their batches taken in the order they are ready.

    Args:
      server_address: "host:port" of the server.
      table_name: Table to sample.
      signature: Nest of `tf.TensorSpec` of one item (leading dimension `sequence_length`).
      batch_size: Items per batch.
      sample_timeout: Seconds to wait for an item before raising; None waits forever.
      connect_timeout: `Timeouts.connect`, the limit of one liveness check.
      num_workers: Sample streams (1 keeps the order of FIFO/LIFO/heap samplers).
      max_in_flight: Samples requested ahead per stream; None: `default_in_flight`.
      lifeline: Closed by the manager that hands the dataset out.
      layout: The table's layout; a packed table's rows are read and unpacked into
        `signature`'s nest once per batch (`Layout.unpack_samples`).
      unpack: Whether a packed table's rows are unpacked; False: `data` is the batch of
        packed rows, `uint8[batch_size, sequence_length, step_bytes]` (for readers that
        unpack them outside TensorFlow, see `Layout.batch_reader`).

    Returns:
      An endless dataset of batches with leading dim `batch_size`. Iterating raises
      `tf.errors.InvalidArgumentError` when no item arrives within `sample_timeout`
      (`EMPTY_BUFFER_MESSAGE`), when the server has been unreachable for `sample_timeout`
      (`SERVER_LOST_MESSAGE`, within `liveness_bound(sample_timeout, connect_timeout)` s) and
      when `lifeline` was closed (`MANAGER_CLOSED_MESSAGE`).
    """
    item_signature = layout.item_signature(_length(signature))
    in_flight = max_in_flight or default_in_flight(batch_size)

    def stream(_: Any = None) -> tf.data.Dataset:
        return _item_dataset(
            server_address,
            table_name,
            item_signature,
            sample_timeout=sample_timeout,
            num_workers=1,
            max_in_flight=in_flight,
        ).batch(batch_size, drop_remainder=True)

    if num_workers == 1:
        batches = stream()
    else:
        # One sample stream per worker, each batching its own items on its own tf.data thread:
        # Reverb unpacks items and tf.data copies them into batches in the thread that pulls
        # them, so one stream with several workers kept that work on one thread.
        batches = tf.data.Dataset.range(num_workers).interleave(
            tf.autograph.experimental.do_not_convert(stream),
            cycle_length=num_workers,
            block_length=1,
            num_parallel_calls=num_workers,
            deterministic=False,
        )
    if unpack:
        batches = layout.unpack_samples(batches)
    return bound_sampling(
        batches,
        server_address,
        table_name,
        sampling_timeout_message(table_name, sample_timeout),
        sample_timeout=sample_timeout,
        connect_timeout=connect_timeout,
        lifeline=lifeline,
    )


def sample_dataset(
    server_address: str,
    table_name: str,
    data_spec: Any,
    sequence_length: int,
    batch_size: int,
    *,
    sample_timeout: float | None,
    num_workers: int = 2,
    max_in_flight: int | None = None,
    connect_timeout: float | None = None,
    lifeline: Lifeline | None = None,
    layout: Layout,
) -> tf.data.Dataset:
    """A tuned sampling pipeline with the element structure of TF-Agents' `as_dataset`.

    `read_pipeline` (one `reverb.TrajectoryDataset` with a deep in-flight window and a few
    workers, batched) replaces TF-Agents' interleave of up to 32 shallow datasets: the same
    `(trajectory, sample_info)` batches (info broadcast to `[batch, sequence_length]`) at a
    fraction of the per-batch overhead.

    Args:
      server_address: "host:port" of the server.
      table_name: Table to sample.
      data_spec: Per-step data spec.
      sequence_length: Steps per item.
      batch_size: Items per batch.
      sample_timeout: Seconds to wait for an item before raising; None waits forever.
      num_workers: Sample streams (1 keeps the order of FIFO/LIFO/heap samplers).
      max_in_flight: Samples requested ahead per worker; default `4 * batch_size` (>= 64).
      connect_timeout: `Timeouts.connect`, the limit of one liveness check.
      lifeline: Closed by the manager that hands the dataset out.
      layout: The table's layout.

    Returns:
      A dataset of `(Trajectory, SampleInfo)` with leading dims `[batch_size, sequence_length]`
      that raises instead of ending or blocking (see `read_pipeline`).
    """
    return read_pipeline(
        server_address,
        table_name,
        table_signature(data_spec, sequence_length),
        batch_size,
        sample_timeout=sample_timeout,
        connect_timeout=connect_timeout,
        num_workers=num_workers,
        max_in_flight=max_in_flight,
        lifeline=lifeline,
        layout=layout,
    ).map(_splitter(sequence_length))


def mixed_dataset(
    server_address: str,
    tables: Sequence[TableConfig],
    weights: Mapping[str, float],
    data_spec: Any,
    batch_size: int,
    *,
    sample_timeout: float | None,
    seed: int | None = None,
    connect_timeout: float | None = None,
    lifeline: Lifeline | None = None,
    layout: Layout,
) -> tf.data.Dataset:
    """Batches whose items each come from table `name` with probability weight / sum(weights).

    Each table is sampled by its own sampler (uniform, prioritized...) through an unbatched
    `reverb.TrajectoryDataset`; `tf.data.Dataset.sample_from_datasets` picks the table of every
    item independently. `sample_info` is that of the table the item came from: its `key` is
    unique across the tables of one server (the same window written into two tables gets two
    keys), so `update_priorities(info.key, p, table=name)` with every key of a mixed batch
    updates exactly the items of `name`; `probability` and `table_size` are per table.

    Args:
      server_address: "host:port" of the server.
      tables: Every table of the buffer.
      weights: Table name -> weight (see `check_mix_weights`).
      data_spec: Per-step data spec.
      batch_size: Items per batch.
      sample_timeout: Seconds to wait for an item of a table before raising; None waits forever.
      seed: Seed of the choice of tables; None draws a random one.
      connect_timeout: `Timeouts.connect`, the limit of one liveness check.
      lifeline: Closed by the manager that hands the dataset out.
      layout: The tables' layout (a packed table's rows are unpacked once per batch).

    Returns:
      A dataset of `(Trajectory, SampleInfo)` with leading dims `[batch_size, sequence_length]`
      that raises instead of ending or blocking (see `bound_sampling`).

    Raises:
      ConfigError: If the weights are invalid (see `check_mix_weights`) or `batch_size` < 1.
    """
    require_positive_int("batch_size", batch_size, maximum=None)
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ConfigError(f"seed must be an integer or None, got {seed!r}")
    probabilities = check_mix_weights(tables, weights)
    sequence_length = find_table(tables, next(iter(probabilities))).sequence_length
    signature = layout.item_signature(sequence_length)
    datasets = []
    for name, probability in probabilities.items():
        config = find_table(tables, name)
        ordered = config.sampling.sampler in ("fifo", "lifo", "max_heap", "min_heap")
        datasets.append(
            _item_dataset(
                server_address,
                name,
                signature,
                sample_timeout=sample_timeout,
                num_workers=1 if ordered else 2,
                # About four batches' worth of this table's items ahead, like sample_dataset.
                max_in_flight=max(16, math.ceil(4 * batch_size * probability)),
            )
        )
    if len(datasets) == 1:
        items = datasets[0]
    else:
        # An exhausted table (sampling timed out) ends the mix instead of silently
        # changing its proportions.
        items = tf.data.Dataset.sample_from_datasets(
            datasets,
            weights=list(probabilities.values()),
            seed=seed,
            stop_on_empty_dataset=True,
        )
    batches = layout.unpack_samples(items.batch(batch_size, drop_remainder=True))
    return bound_sampling(
        batches,
        server_address,
        list(probabilities),
        f"{EMPTY_BUFFER_MESSAGE} from one of the mixed tables {list(probabilities)} within "
        f"{sample_timeout} s: a table is empty (or holds fewer items than min_size_to_sample), "
        "or its samples-per-insert rate limiter waits for more inserts. Collect data first, or "
        "raise Timeouts.sample.",
        sample_timeout=sample_timeout,
        connect_timeout=connect_timeout,
        lifeline=lifeline,
    ).map(_splitter(sequence_length))


def _item_dataset(
    server_address: str,
    table_name: str,
    signature: Any,
    *,
    sample_timeout: float | None,
    num_workers: int,
    max_in_flight: int,
) -> tf.data.Dataset:
    """Unbatched `ReplaySample(info, data)` items of one table; ends when sampling times out."""
    timeout_ms = to_ms(sample_timeout)
    return reverb.TrajectoryDataset(
        server_address,
        table_name,
        dtypes=tf.nest.map_structure(lambda s: s.dtype, signature),
        shapes=tf.nest.map_structure(lambda s: s.shape, signature),
        max_in_flight_samples_per_worker=max_in_flight,
        num_workers_per_iterator=num_workers,
        rate_limiter_timeout_ms=-1 if timeout_ms is None else timeout_ms,
    )


def _length(signature: Any) -> int:
    """The leading (time) dimension of an item signature."""
    return int(tf.nest.flatten(signature)[0].shape[0])


def _splitter(sequence_length: int) -> Any:
    """Maps a batch of `ReplaySample` to `(data, info)`, info broadcast to `[B, T]`."""

    def split(sample: reverb.ReplaySample) -> tuple[Any, Any]:
        info = tf.nest.map_structure(
            lambda x: tf.repeat(x[:, None], sequence_length, axis=1), sample.info
        )
        return sample.data, info

    return split


class ReplayBuffer(reverb_replay_buffer.ReverbReplayBuffer):
    """TF-Agents' `ReverbReplayBuffer` whose datasets fail clearly instead of waiting forever.

    `as_dataset` is TF-Agents' pipeline bounded by `bound_sampling`: iterating raises
    `tf.errors.InvalidArgumentError` when no item arrives within `sample_timeout`, when the
    server has been lost for `sample_timeout` (within `liveness_bound(sample_timeout,
    connect_timeout)` seconds), and after `stop_sampling()`. Everything else (`num_frames`,
    `py_client`, `clear`...) is TF-Agents'.

    Args:
      data_spec: Per-step data spec.
      table_name: Table to sample.
      sequence_length: Steps per item.
      sample_timeout: Seconds to wait for an item before the dataset raises; None waits forever.
      connect_timeout: `Timeouts.connect`, the limit of one liveness check; None: at most
        `sample_timeout`.
      layout: The table's layout, or its name (resolved for `data_spec`, see
        `specs.layouts.resolve_layout`): a packed table's items are read as `uint8` rows and
        unpacked into `data_spec`'s nest before TF-Agents' pipeline sees them.
      **kwargs: Passed to `ReverbReplayBuffer` (`server_address` or `local_server`, ...).
    """

    def __init__(
        self,
        data_spec: Any,
        table_name: str,
        sequence_length: int,
        *,
        sample_timeout: float | None,
        connect_timeout: float | None = None,
        layout: Layout | str = NESTED,
        **kwargs: Any,
    ) -> None:
        timeout_ms = to_ms(sample_timeout)
        super().__init__(
            data_spec,
            table_name,
            sequence_length,
            rate_limiter_timeout_ms=-1 if timeout_ms is None else timeout_ms,
            **kwargs,
        )
        self._sample_timeout = sample_timeout
        self._connect_timeout = connect_timeout
        self._layout = as_layout(layout, data_spec)
        self.lifeline = Lifeline()

    def stop_sampling(self) -> None:
        """Makes every dataset built from this buffer (and lent its lifeline) fail.

        Called by `ReplayBufferManager.close()`; each such dataset raises at its next watch
        round (within a tenth of a second, or one liveness check) instead of blocking.
        """
        self.lifeline.close()

    # Datasets built inside tf.data functions (the sharded mixture's flat_map) would otherwise
    # be converted by AutoGraph, whose rewrite of a zero-argument super() looks the class up by
    # walking every stack frame's locals; depending on what ran before in the process, that
    # lookup failed with a TypeError from the converted __init__.
    @tf.autograph.experimental.do_not_convert
    def _as_dataset(
        self,
        sample_batch_size: int | None = None,
        num_steps: int | None = None,
        sequence_preprocess_fn: Any = None,
        num_parallel_calls: int | None = None,
    ) -> tf.data.Dataset:
        # TF-Agents reads items shaped by `_data_spec`: the stored steps (a packed table's
        # rows) for the time it builds the pipeline; each sequence is unpacked before anything
        # else sees it.
        layout = self._layout
        data_spec = self._data_spec
        self._data_spec = layout.step_spec()
        try:
            dataset = super()._as_dataset(
                sample_batch_size,
                num_steps,
                layout.sequence_preprocess(sequence_preprocess_fn),
                num_parallel_calls,
            )
        finally:
            self._data_spec = data_spec
        return bound_sampling(
            dataset,
            self._server_address,
            self._table_name,
            sampling_timeout_message(self._table_name, self._sample_timeout),
            sample_timeout=self._sample_timeout,
            connect_timeout=self._connect_timeout,
            lifeline=self.lifeline,
        )

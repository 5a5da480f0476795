"""Server liveness: a sampling dataset fails when its Reverb server is gone instead of blocking.

Reverb's sampler retries UNAVAILABLE forever, so an iterator whose server was killed, stopped,
or whose embedded manager was closed blocks in `next()` for good; `guard_liveness` watches the
server beside the sample stream and fails it within `liveness_bound(Timeouts.sample,
Timeouts.connect)` seconds. `Lifeline` is the flag by which a manager's `close()` stops the
datasets it handed out, and `python_calls_stopped` the flag that keeps the `tf.py_function`s of
sampling pipelines from calling Python at exit.
"""

from __future__ import annotations

import atexit
import dataclasses
import threading
import time
from collections.abc import Sequence

import reverb
import tensorflow as tf

from replay_service.backends.base import Lifeline
from replay_service.backends.reverb.platform import inspect_patch

# Lets PolicySaver save policies (see inspect_patch); every tf.data module of this
# backend imports this one.
inspect_patch.patch_inspect()

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

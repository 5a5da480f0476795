"""A `reverb.Client` whose every blocking call is bounded by the manager's `Timeouts`.

Reverb's own client waits without a limit wherever its caller passes no timeout: a writer's
`flush()` and `end_episode()` (what TF-Agents' `ReverbAddTrajectoryObserver` and
`ReverbTrajectorySequenceObserver` call, always without a timeout), `server_info()`,
`reset()`, `mutate_priorities()`, `insert()`, the legacy writer's `flush()`/`close()`, and
each item of `sample()`. Once the server is gone (killed) they never return.
`BoundedClient` is the client the manager hands out (`ReplayBufferManager.py_client`, its
TF-Agents replay buffer's `py_client`; `PackingClient` on a packed layout is one): where the
caller gives no timeout, it bounds

- a writer's `flush`/`end_episode`/`close` (trajectory, structured and legacy writers),
  `insert`, `reset` and `mutate_priorities` by `timeouts.write`, raising `WriteTimeoutError`;
- `server_info` by `timeouts.connect`, raising `ServerUnavailableError`;
- each item of `sample` by `timeouts.sample`, raising `SampleTimeoutError`;
- `checkpoint` by `timeouts.checkpoint`, raising `CheckpointError`.

Every error names the server's address and the timeout. A timeout given by the caller
(`flush(timeout_ms=...)`) is Reverb's: it raises Reverb's `DeadlineExceededError` as before.
A writer that timed out is abandoned (`internals.abandon_writer`): its destructor never runs,
so dropping it cannot hang either.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import reverb
from reverb import structured_writer as structured_writer_lib
from reverb import trajectory_writer as trajectory_writer_lib

from replay_service.backends.reverb import layout_writers
from replay_service.backends.reverb.connection import server_info
from replay_service.backends.reverb.internals import abandon_writer
from replay_service.bounded import call_with_timeout
from replay_service.collect.writing import ItemWriter, TableWindows, WindowWriter
from replay_service.config.options import Timeouts, to_ms
from replay_service.errors import (
    CheckpointError,
    ConfigError,
    SampleTimeoutError,
    WriteTimeoutError,
)
from replay_service.sample.priorities import check_updates, describe_bad_priorities
from replay_service.specs.layouts import Layout

_T = TypeVar("_T")


class WriteBound:
    """How long the writers of one client wait for confirmations: `timeouts.write`.

    Args:
      address: "host:port" of the server (named in errors).
      write_s: `Timeouts.write` in seconds (None: wait forever, as asked).
    """

    def __init__(self, address: str, write_s: float | None) -> None:
        self.address = address
        self.write_s = write_s
        self.timeout_ms = to_ms(write_s)

    def error(self, what: str, timeout_ms: int | None = None) -> WriteTimeoutError:
        """The `WriteTimeoutError` of `what`, naming the server and the timeout."""
        waited = self.timeout_ms if timeout_ms is None else timeout_ms
        return WriteTimeoutError(
            f"{what}: written items were not confirmed within {waited} ms (Timeouts.write); "
            f"the server at {self.address!r} is down or its rate limiter blocks inserts"
        )

    def wait(self, call: Callable[[int | None], Any], timeout_ms: int | None, what: str) -> None:
        """Runs `call(timeout_ms)`, with `timeout_ms` or (None) the write timeout.

        Raises:
          WriteTimeoutError: If the write timeout (not the caller's) expires.
          reverb.errors.DeadlineExceededError: If the caller's `timeout_ms` expires.
        """
        if timeout_ms is not None:
            call(timeout_ms)
            return
        try:
            call(self.timeout_ms)
        except reverb.errors.DeadlineExceededError as e:
            raise self.error(what) from e

    def run(self, fn: Callable[[], _T], what: str) -> _T:
        """Runs a blocking call that takes no timeout of its own, for at most the write timeout.

        Raises:
          WriteTimeoutError: If it does not return in time (it goes on in a daemon thread).
        """
        try:
            return call_with_timeout(fn, self.write_s, what)
        except TimeoutError as e:
            if isinstance(e, WriteTimeoutError):
                raise
            raise WriteTimeoutError(
                f"{what} did not complete within {self.write_s} s (Timeouts.write); the "
                f"server at {self.address!r} is down or unreachable"
            ) from None


class _BoundedFlushes:
    """`flush` and `end_episode` of a Reverb writer (the class after this one in the bases),
    bounded by the write timeout when the caller gives none; a writer whose wait fails is
    abandoned once (`abandon_writer`), so that discarding it cannot block either.

    Args:
      writer: The C++ writer that Reverb's writer class wraps.
      bound: The client's `WriteBound`.
    """

    _abandoned = False
    _kind = "writer"

    def __init__(self, writer: Any, bound: WriteBound) -> None:
        super().__init__(writer)  # type: ignore[call-arg]
        self._bound = bound

    def flush(self, block_until_num_items: int = 0, timeout_ms: int | None = None) -> None:
        """Reverb's `flush`, bounded by the write timeout when `timeout_ms` is None.

        Raises:
          WriteTimeoutError: If the write timeout expires (the writer is abandoned).
        """
        self._bounded(super().flush, block_until_num_items, timeout_ms)  # type: ignore[misc]

    def end_episode(self, clear_buffers: bool = True, timeout_ms: int | None = None) -> None:
        """Reverb's `end_episode`, bounded by the write timeout when `timeout_ms` is None.

        Raises:
          WriteTimeoutError: If the write timeout expires (the writer is abandoned).
        """
        self._bounded(super().end_episode, clear_buffers, timeout_ms)  # type: ignore[misc]

    def _bounded(self, method: Callable[..., Any], arg: Any, timeout_ms: int | None) -> None:
        """Runs Reverb's `method(arg, timeout_ms=...)` within `WriteBound.wait`."""
        try:
            self._bound.wait(
                lambda ms: method(arg, timeout_ms=ms),
                timeout_ms,
                f"{self._kind}.{method.__name__}()",
            )
        except (WriteTimeoutError, reverb.errors.DeadlineExceededError):
            if not self._abandoned:
                self._abandoned = True
                abandon_writer(self)
            raise


class BoundedTrajectoryWriter(_BoundedFlushes, trajectory_writer_lib.TrajectoryWriter):
    """Reverb's `TrajectoryWriter` whose `flush`, `end_episode` and `close` wait at most the
    write timeout when the caller gives none (see the module docstring).

    Args:
      writer: The C++ writer (`pybind.TrajectoryWriter`).
      bound: The client's `WriteBound`.
    """

    _kind = "TrajectoryWriter"

    def close(self) -> None:
        """Closes the writer (its unsent items are dropped, as Reverb's `close`)."""
        if not self._abandoned:
            super().close()


class BoundedStructuredWriter(_BoundedFlushes, structured_writer_lib.StructuredWriter):
    """Reverb's `StructuredWriter` whose `flush` and `end_episode` wait at most the write
    timeout when the caller gives none.

    Args:
      writer: The C++ writer (`pybind.StructuredWriter`).
      bound: The client's `WriteBound`.
    """

    _kind = "StructuredWriter"


class BoundedLegacyWriter(reverb.client.Writer):
    """Reverb's legacy `Writer` (`Client.writer()`) whose `flush` and `close` wait at most the
    write timeout (they take none of their own).

    Args:
      internal_writer: The C++ writer (`pybind.Writer`).
      bound: The client's `WriteBound`.
    """

    def __init__(self, internal_writer: Any, bound: WriteBound) -> None:
        super().__init__(internal_writer)
        self._bound = bound

    def flush(self) -> None:
        """Reverb's `flush`, bounded by the write timeout.

        Raises:
          WriteTimeoutError: If it does not return in time (the writer is abandoned).
        """
        self._bounded(super().flush, "Writer.flush()")

    def close(self, retry_on_unavailable: bool = True) -> None:
        """Reverb's `close`, bounded by the write timeout.

        Raises:
          WriteTimeoutError: If it does not return in time (the writer is abandoned).
        """
        self._bounded(
            lambda: super(BoundedLegacyWriter, self).close(retry_on_unavailable), "Writer.close()"
        )

    def __del__(self) -> None:
        if not self._closed:
            # A finalizer cannot raise; a writer that timed out is abandoned.
            with contextlib.suppress(Exception):
                self.close()

    def _bounded(self, fn: Callable[[], Any], what: str) -> None:
        try:
            self._bound.run(fn, what)
        except WriteTimeoutError:
            self._closed = True
            abandon_writer(self)
            raise


def _reconnect(address: str, timeouts: Timeouts) -> BoundedClient:
    return BoundedClient(reverb.Client(address), timeouts)


class BoundedClient(reverb.Client):
    """A `reverb.Client` (sharing `client`'s connection) whose blocking calls are bounded by
    `timeouts` where the caller gives no timeout (see the module docstring).

    Args:
      client: The client of the server.
      timeouts: The manager's `Timeouts`.
    """

    def __init__(self, client: reverb.Client, timeouts: Timeouts) -> None:
        # The connection and the signature cache are the plain client's (no second channel).
        self._server_address = client.server_address
        self._client = client._client
        self._signature_cache = client._signature_cache
        self._timeouts = timeouts
        self._bound = WriteBound(client.server_address, timeouts.write)

    @property
    def timeouts(self) -> Timeouts:
        """The bounds of this client's blocking calls."""
        return self._timeouts

    @property
    def plain_client(self) -> reverb.Client:
        """A plain `reverb.Client` on the same connection (its calls are Reverb's, unbounded):
        for this project's writers, which pass their own timeouts."""
        client = reverb.Client.__new__(reverb.Client)
        client._server_address = self._server_address
        client._client = self._client
        client._signature_cache = self._signature_cache
        return client

    def __reduce__(self) -> Any:
        return _reconnect, (self._server_address, self._timeouts)

    def window_writer(
        self, windows: Sequence[TableWindows], layout: Layout, *, timeout_ms: int | None
    ) -> WindowWriter:
        """A collector's writer of `windows` (`collect.writing.WritingClient`): Reverb's
        `StructuredWriter` for a nested table, a `PackedWindowWriter` for a packed one
        (`layout_writers.window_writer`), on the plain client (collectors give every wait its
        timeout).

        Raises:
          ValueError: If the windows' configs are invalid (as Reverb).
        """
        return layout_writers.window_writer(self.plain_client, windows, layout, timeout_ms)

    def item_writer(self, layout: Layout, sequence_length: int) -> ItemWriter:
        """An import's writer of whole items of `sequence_length` steps stored as `layout`
        says (`layout_writers.item_writer`), on the plain client (an import gives every wait
        its timeout)."""
        return layout_writers.item_writer(self.plain_client, layout, sequence_length)

    def __repr__(self) -> str:
        return f"BoundedClient, server_address={self._server_address}"

    def trajectory_writer(
        self, num_keep_alive_refs: int, *, validate_items: bool = True
    ) -> trajectory_writer_lib.TrajectoryWriter:
        """Reverb's `trajectory_writer`, whose waits are bounded by `timeouts.write`.

        Raises:
          ValueError: If `num_keep_alive_refs` < 1 (as Reverb).
        """
        if num_keep_alive_refs < 1:
            raise ValueError(
                f"num_keep_alive_refs ({num_keep_alive_refs}) must be a positive integer"
            )
        # As Reverb's `Client.trajectory_writer`, with the bounded wrapper.
        options = reverb.pybind.AutoTunedChunkerOptions(num_keep_alive_refs, 1.0)
        internal = self._client.NewTrajectoryWriter(options, validate_items)
        return BoundedTrajectoryWriter(internal, self._bound)

    def structured_writer(self, configs: Any) -> Any:
        """Reverb's `structured_writer`, whose waits are bounded by `timeouts.write`.

        Raises:
          ValueError: If `configs` is empty or invalid (as Reverb).
        """
        writer = super().structured_writer(configs)  # no destructor of its own
        return BoundedStructuredWriter(writer._writer, self._bound)

    def writer(self, *args: Any, **kwargs: Any) -> Any:
        """Reverb's legacy `writer`, whose `flush` and `close` are bounded by `timeouts.write`."""
        writer = super().writer(*args, **kwargs)
        internal = writer._writer
        writer._closed = True  # the new wrapper owns the C++ writer (and closes it)
        return BoundedLegacyWriter(internal, self._bound)

    def insert(self, data: Any, priorities: dict[str, float]) -> None:
        """Reverb's `insert`, with the priorities checked first (Reverb's blocks forever on a
        negative one and stores +inf), bounded by `timeouts.write`.

        Raises:
          WriteTimeoutError: If the item is not confirmed in time.
          ConfigError: If a priority is NaN, infinite, negative or not a real number.
          ValueError: If `priorities` is empty (as Reverb).
        """
        bad = describe_bad_priorities(priorities, label="table")
        if bad:
            raise ConfigError(f"priorities must be finite real numbers >= 0, got {bad}")
        if not priorities:
            raise ValueError("priorities must contain at least one item")
        with self.writer(max_sequence_length=1) as writer:
            writer.append(data)
            for table, priority in priorities.items():
                writer.create_item(table=table, num_timesteps=1, priority=priority)

    def reset(self, table: str) -> None:
        """Reverb's `reset`, bounded by `timeouts.write`.

        Raises:
          WriteTimeoutError: If the server does not answer in time.
        """
        self._bound.run(lambda: super(BoundedClient, self).reset(table), f"reset({table!r})")

    def mutate_priorities(
        self,
        table: str,
        updates: dict[int, float] | None = None,
        deletes: list[int] | None = None,
    ) -> None:
        """Reverb's `mutate_priorities`, with every update checked before any is sent, bounded
        by `timeouts.write`.

        Args:
          table: Name of the table.
          updates: Item key -> new priority; keys not in the table are ignored.
          deletes: Keys of items to delete; keys not in the table are ignored.

        Raises:
          SpecMismatchError: If a key of `updates` is not an integer in [0, 2**64).
          ConfigError: If a priority is NaN, infinite, negative or not a real number.
          WriteTimeoutError: If the server does not answer in time.
        """
        checked = check_updates(updates)
        self._bound.run(
            lambda: super(BoundedClient, self).mutate_priorities(table, checked, deletes),
            f"mutate_priorities({table!r})",
        )

    def server_info(self, timeout: int | None = None) -> Any:
        """Reverb's `server_info`; with no `timeout`, bounded by `timeouts.connect`.

        Raises:
          ServerUnavailableError: If the server does not answer within `timeouts.connect`.
          reverb.errors.DeadlineExceededError: If it does not within the given `timeout`.
        """
        if timeout is not None or self._timeouts.connect is None:
            return super().server_info(timeout)
        return server_info(self.plain_client, self._timeouts.connect)

    def sample(self, table: str, *args: Any, **kwargs: Any) -> Iterator[Any]:
        """Reverb's `sample`; waiting for each item is bounded by `timeouts.sample`.

        Raises:
          SampleTimeoutError: (iterating) If an item does not come within `timeouts.sample`:
            the table is empty, its rate limiter blocks samples, or the server is gone.
        """
        samples = super().sample(table, *args, **kwargs)
        return self._bounded_samples(table, samples)

    def _bounded_samples(self, table: str, samples: Iterator[Any]) -> Iterator[Any]:
        limit = self._timeouts.sample
        done = object()
        while True:
            try:
                item = call_with_timeout(lambda: next(samples, done), limit, "sample")
            except TimeoutError:
                raise SampleTimeoutError(
                    f"table {table!r}: no item could be sampled within {limit} s "
                    f"(Timeouts.sample); the server at {self._server_address!r} is down, the "
                    "table is empty or its rate limiter blocks samples"
                ) from None
            if item is done:
                return
            yield item

    def checkpoint(self) -> str:
        """Reverb's `checkpoint`, bounded by `timeouts.checkpoint`.

        Raises:
          CheckpointError: If the server does not finish it in time.
        """
        limit = self._timeouts.checkpoint
        try:
            return call_with_timeout(super().checkpoint, limit, "checkpoint")
        except TimeoutError:
            raise CheckpointError(
                f"the server at {self._server_address!r} did not finish a checkpoint within "
                f"{limit} s (Timeouts.checkpoint)"
            ) from None

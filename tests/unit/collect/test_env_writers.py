"""`EnvWriters`: one writer per env, opened on its first step, waited on every `flush_every`
steps, padded and ended at episode ends, and closed so that one failing writer does not keep the
others' episodes open.

The writers are recording `WindowWriter`s handed out by a `WritingClient` of this file, behind a
real `WriteTarget`: what is checked is which calls `EnvWriters` makes on them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from replay_service.collect.env_writers import EnvWriters
from replay_service.collect.observer import FLUSH_DOWN_TO, WriteTarget
from replay_service.errors import WriteTimeoutError


class DeadlineError(Exception):
    """What a writer raises when the server does not confirm in time."""


class RecordingWriter:
    """A `WindowWriter` that records its calls; `fail_end` makes `end_episode` time out."""

    def __init__(self, can_skip_wait: bool) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.can_skip_wait = can_skip_wait
        self.fail_end = False

    def append(self, step: Any) -> None:
        self.calls.append(("append", list(step)))

    def flush(self, block_until_num_items: int = 0, timeout_ms: int | None = None) -> None:
        self.calls.append(("flush", block_until_num_items, timeout_ms))

    def end_episode(self, clear_buffers: bool = True, timeout_ms: int | None = None) -> None:
        self.calls.append(("end_episode", clear_buffers, timeout_ms))
        if self.fail_end:
            raise DeadlineError("not confirmed")

    def next_episode(self) -> bool:
        self.calls.append(("next_episode",))
        return self.can_skip_wait

    def abandon(self) -> None:
        self.calls.append(("abandon",))

    def names(self) -> list[str]:
        return [call[0] for call in self.calls]


class RecordingClient:
    """A `WritingClient` handing out `RecordingWriter`s, kept in `opened`."""

    server_address = "recording"

    def __init__(self, can_skip_wait: bool = False) -> None:
        self.opened: list[RecordingWriter] = []
        self.can_skip_wait = can_skip_wait

    def window_writer(self, windows: Any, layout: Any, *, timeout_ms: int | None) -> Any:
        writer = RecordingWriter(self.can_skip_wait)
        self.opened.append(writer)
        return writer


def make_target(
    client: RecordingClient, *, flush_every: int = 3, padded: bool = False, sequence_length: int = 3
) -> WriteTarget:
    return WriteTarget(
        client=client,
        table_name="t",
        sequence_length=sequence_length,
        stride_length=1,
        windows=[("t", sequence_length, 1, 1.0, padded)],
        data_spec=None,
        flush_every=flush_every,
        timeout_ms=250,
        pad_end_of_episode=padded,
        layout=None,
    )


@pytest.fixture(autouse=True)
def _deadlines_are_timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """`WriteTarget.wait` turns this file's `DeadlineError` into a `WriteTimeoutError`."""
    monkeypatch.setattr(
        "replay_service.collect.observer._deadline_errors", lambda: (DeadlineError,)
    )


def test_each_env_gets_its_own_writer_on_its_first_step():
    client = RecordingClient()
    envs = EnvWriters(make_target(client), None)
    envs.start(3)
    assert envs.writers == [None, None, None]
    envs.append(2, [np.int32(0)])
    envs.append(0, [np.int32(1)])
    envs.append(2, [np.int32(2)])
    assert len(client.opened) == 2
    assert envs.writers[1] is None
    assert envs.writers[2] is client.opened[0] and envs.writers[0] is client.opened[1]
    assert envs.steps == [1, 0, 2]
    assert client.opened[0].calls == [("append", [np.int32(0)]), ("append", [np.int32(2)])]


def test_a_writer_is_waited_on_every_flush_every_steps_of_its_own_env():
    client = RecordingClient()
    envs = EnvWriters(make_target(client, flush_every=3), None)
    envs.start(2)
    for step in range(7):
        envs.append(0, [step])
        if step < 2:
            envs.append(1, [step])
    first, second = client.opened
    assert first.names() == ["append"] * 3 + ["flush"] + ["append"] * 3 + ["flush", "append"]
    assert first.calls[3] == ("flush", FLUSH_DOWN_TO, 250)
    assert second.names() == ["append", "append"]  # 2 steps of its own: no wait yet


def test_a_padded_table_masks_real_steps_and_pads_the_episode_end():
    client = RecordingClient()
    padding = [np.float32(0), np.False_]
    envs = EnvWriters(make_target(client, flush_every=100, padded=True), padding)
    envs.start(1)
    envs.append(0, [np.float32(7)])
    envs.end_episode(0)
    writer = client.opened[0]
    # One real step (mask True) and, for sequence_length 3, two padding steps (mask False).
    assert writer.calls[0] == ("append", [np.float32(7), np.True_])
    assert writer.calls[1:3] == [("append", padding), ("append", padding)]
    assert writer.calls[3] == ("end_episode", True, 250)
    assert envs.steps == [0]


def test_an_unpadded_table_ends_the_episode_without_padding_or_mask():
    client = RecordingClient()
    envs = EnvWriters(make_target(client, flush_every=100), None)
    envs.start(1)
    envs.append(0, [1.0])
    envs.end_episode(0)
    assert client.opened[0].calls == [("append", [1.0]), ("end_episode", True, 250)]


def test_an_episode_boundary_in_a_stream_skips_the_wait_only_where_the_writer_can():
    skipping = RecordingClient(can_skip_wait=True)
    envs = EnvWriters(make_target(skipping, flush_every=3), None)
    envs.start(1)
    envs.append(0, [1])
    envs.append(0, [2])
    envs.end_episode(0, confirm=False)
    assert skipping.opened[0].names() == ["append", "append", "next_episode"]
    # Its items stay counted for the periodic wait: the next step is the third since one.
    envs.append(0, [3])
    assert skipping.opened[0].names()[-2:] == ["append", "flush"]

    waiting = RecordingClient(can_skip_wait=False)
    envs = EnvWriters(make_target(waiting, flush_every=3), None)
    envs.start(1)
    envs.append(0, [1])
    envs.append(0, [2])
    envs.end_episode(0, confirm=False)
    assert waiting.opened[0].names()[-2:] == ["next_episode", "end_episode"]
    envs.append(0, [3])  # the count started again with the confirmed end
    assert waiting.opened[0].names()[-1] == "append"


def test_ending_an_env_that_never_stepped_opens_no_writer():
    client = RecordingClient()
    envs = EnvWriters(make_target(client, padded=True), [0.0, np.False_])
    envs.start(2)
    envs.end_episode(1)
    envs.close()
    assert client.opened == []


def test_a_timed_out_wait_is_a_write_timeout_naming_table_and_bound():
    client = RecordingClient()
    envs = EnvWriters(make_target(client), None)
    envs.start(1)
    envs.append(0, [1])
    client.opened[0].fail_end = True
    with pytest.raises(WriteTimeoutError, match=r"table 't'.* within 250 ms.*'recording'"):
        envs.end_episode(0)


def test_flush_waits_on_every_writer_with_the_given_bound():
    client = RecordingClient()
    envs = EnvWriters(make_target(client, flush_every=100), None)
    envs.start(3)
    envs.append(0, [1])
    envs.append(2, [1])
    envs.flush(timeout_ms=40)
    envs.flush()
    for writer in client.opened:
        assert writer.calls[1:] == [("flush", 0, 40), ("flush", 0, 250)]


def test_close_ends_every_episode_abandons_a_failing_writer_and_raises_its_error():
    client = RecordingClient()
    envs = EnvWriters(make_target(client, flush_every=100), None)
    envs.start(3)
    for index in range(3):
        envs.append(index, [index])
    failing, *others = client.opened
    failing.fail_end = True
    with pytest.raises(WriteTimeoutError, match="table 't'"):
        envs.close()
    assert failing.names()[-2:] == ["end_episode", "abandon"]
    for writer in others:  # the episodes after the failing one were ended all the same
        assert writer.names()[-1] == "end_episode"
        assert "abandon" not in writer.names()
    assert envs.writers == []

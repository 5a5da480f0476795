"""Sampling datasets watched beside their Reverb server: the rules derived from the timeouts,
elements passing through in order, and a closed manager or a lost server failing `next()`
within the bound instead of blocking."""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Iterator

import numpy as np
import pytest
import reverb
import tensorflow as tf

from replay_service.backends.base import Lifeline
from replay_service.backends.reverb.liveness import (
    MANAGER_CLOSED_MESSAGE,
    SERVER_LOST_MESSAGE,
    LivenessRules,
    guard_liveness,
    liveness_bound,
)
from replay_service.backends.reverb.sampling_errors import replay_service_message


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    server = reverb.Server([reverb.Table.queue("q", 10)])
    yield f"localhost:{server.port}"
    server.stop()


@pytest.mark.parametrize(
    ("sample", "connect", "rules"),
    [
        (60.0, 10.0, LivenessRules(60.0, 1.0, 0.1, 10)),
        (None, 4.0, LivenessRules(4.0, 1.0, 0.1, 4)),
        (None, None, LivenessRules(60.0, 1.0, 0.1, 60)),
        (0.3, None, LivenessRules(0.3, 0.1, 0.025, 1)),
        (0.06, 0.2, LivenessRules(0.06, 0.05, 0.0125, 1)),
    ],
)
def test_the_rules_follow_the_timeouts_within_their_limits(sample, connect, rules) -> None:
    got = LivenessRules.from_timeouts(sample, connect)
    assert dataclasses.astuple(got) == pytest.approx(dataclasses.astuple(rules))


def test_the_bound_of_the_default_timeouts_is_72_2_seconds() -> None:
    assert liveness_bound(60.0, 10.0) == pytest.approx(72.2)
    assert liveness_bound(1.0, 1.0) <= 2 * 1.0 + 1.0


@pytest.mark.heavy
def test_elements_pass_in_order_until_the_lifeline_is_closed(address: str) -> None:
    lifeline = Lifeline()
    dataset = guard_liveness(
        tf.data.Dataset.range(10**9),
        address,
        "q",
        sample_timeout=5.0,
        connect_timeout=5.0,
        lifeline=lifeline,
    )
    assert dataset.element_spec == tf.TensorSpec([], tf.int64)
    iterator = iter(dataset)
    assert [int(next(iterator)) for _ in range(50)] == list(range(50))
    lifeline.close()
    with pytest.raises(tf.errors.InvalidArgumentError, match=MANAGER_CLOSED_MESSAGE) as raised:
        for _ in range(10**6):
            next(iterator)
    assert f"server {address}" in raised.value.message


@pytest.mark.heavy
def test_a_blocked_sampler_fails_within_the_bound_once_its_server_is_gone() -> None:
    server = reverb.Server([reverb.Table.queue("empty", 10)])
    address = f"localhost:{server.port}"
    with reverb.Client(address).trajectory_writer(num_keep_alive_refs=1) as writer:
        writer.append([np.int32(7)])
        writer.create_item("empty", 1.0, [writer.history[0][-1]])
    samples = reverb.TrajectoryDataset(
        address, "empty", tf.int32, tf.TensorShape([]), max_in_flight_samples_per_worker=1
    )
    dataset = guard_liveness(samples, address, "empty", sample_timeout=0.5, connect_timeout=1.0)
    iterator = iter(dataset)
    assert int(next(iterator).data) == 7  # the sampler is connected; the queue is empty now
    server.stop()
    start = time.monotonic()
    with pytest.raises(tf.errors.InvalidArgumentError, match=SERVER_LOST_MESSAGE) as raised:
        next(iterator)
    # The bound, with room for a machine under load.
    assert time.monotonic() - start <= liveness_bound(0.5, 1.0) + 3.0
    message = replay_service_message(raised.value)
    assert message is not None
    assert message.startswith(f"{SERVER_LOST_MESSAGE} at {address} while sampling table empty:")
    del raised, iterator  # stops the sampler's retries now, not at some later collection
    gc.collect()

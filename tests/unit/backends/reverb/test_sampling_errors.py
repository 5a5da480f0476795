"""Sampling errors of Reverb datasets: an exhausted dataset fails with our message instead of
ending, and our messages are read back from TensorFlow's decorated errors."""

from __future__ import annotations

import pytest
import tensorflow as tf

from replay_service.backends.reverb.sampling_errors import (
    EMPTY_BUFFER_MESSAGE,
    foreign_item_message,
    raise_when_exhausted,
    replay_service_message,
    sampling_timeout_message,
)


def test_an_exhausted_dataset_raises_the_message_after_its_elements() -> None:
    elements = tf.data.Dataset.from_tensor_slices(
        {"x": tf.constant([[1.0, 2.0], [3.0, 4.0]]), "n": tf.constant([5, 6])}
    )
    message = sampling_timeout_message("uniform_table", 0.5)
    dataset = raise_when_exhausted(elements, message)
    assert dataset.element_spec == elements.element_spec
    iterator = iter(dataset)
    assert [int(next(iterator)["n"]) for _ in range(2)] == [5, 6]
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        next(iterator)
    assert replay_service_message(raised.value) == message


def test_the_timeout_message_names_the_table_the_timeout_and_what_to_do() -> None:
    message = sampling_timeout_message("t", 2.5)
    assert message.startswith(f"{EMPTY_BUFFER_MESSAGE} from table 't' within 2.5 s")
    assert "raise Timeouts.sample" in message


def test_other_errors_are_not_ours() -> None:
    assert replay_service_message(tf.errors.InvalidArgumentError(None, None, "bad shape")) is None


def test_our_text_is_cut_at_the_assertions_end_and_unescaped() -> None:
    error = tf.errors.InvalidArgumentError(
        None, None, "assertion failed: [replay_service: table \\'t\\' \\\"x\\\"] [[node]]"
    )
    assert replay_service_message(error) == "replay_service: table 't' \"x\""


def test_a_foreign_item_names_the_table_the_cause_and_keeps_reverbs_words() -> None:
    message = foreign_item_message("packed", "Inconsistent number of tensors received")
    assert message.startswith("table 'packed' holds an item whose columns are not its")
    assert message.endswith("Reverb: Inconsistent number of tensors received")

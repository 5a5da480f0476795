"""A dataset's next element as a flat tensor list, the same as `next()` gives, through the
iterator resource or through `next()` for elements that are not plain tensors."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from replay_service.backends.reverb.platform.tf_iterators import flat_getter, numpy_view


def test_flat_getter_gives_every_element_flattened_then_out_of_range() -> None:
    dataset = tf.data.Dataset.range(3).map(lambda i: {"b": (i, 2 * i), "a": tf.cast(i, tf.float32)})
    get = flat_getter(dataset)
    for i in range(3):
        values = [np.asarray(v) for v in get()]
        assert values == [np.float32(i), i, 2 * i]  # sorted keys, as tf.nest.flatten
    with pytest.raises(tf.errors.OutOfRangeError):
        get()


def test_elements_that_are_not_tensors_are_read_through_next() -> None:
    ragged = tf.ragged.constant([[1], [2, 3]])
    get = flat_getter(tf.data.Dataset.from_tensors(ragged).repeat(2))
    assert get()[0].to_list() == [[1], [2, 3]]
    assert get()[0].to_list() == [[1], [2, 3]]
    with pytest.raises(StopIteration):
        get()


def test_numpy_view_shares_an_eager_tensors_buffer_and_reads_others() -> None:
    tensor = tf.constant([1.0, 2.0])
    view = numpy_view(tensor)
    np.testing.assert_array_equal(view, [1.0, 2.0])
    assert view.ctypes.data == numpy_view(tensor).ctypes.data  # no copy per call
    np.testing.assert_array_equal(numpy_view(tf.Variable([3, 4])), [3, 4])

"""What the codec tests share: the codecs installed here and frame-like values."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from replay_service.backends.local.codecs import CODECS

SHAPE = (84, 84)


def installed(name: str) -> bool:
    """Whether codec `name`'s library imports here."""
    module = CODECS[name].module
    return module is None or importlib.util.find_spec(module.split(".")[0]) is not None


NAMES = [
    pytest.param(
        name, marks=pytest.mark.skipif(not installed(name), reason=f"{name} not installed")
    )
    for name in CODECS
]


def frames(count: int, seed: int = 0) -> np.ndarray:
    """Frame-like uint8 values: blocks of constant colour with a little noise, so that they
    compress, but each one different."""
    rng = np.random.default_rng(seed)
    values = np.repeat(np.repeat(rng.integers(0, 4, (count, 12, 12)), 7, 1), 7, 2) * 60
    noise = rng.random((count, *SHAPE)) < 0.02
    return np.where(noise, rng.integers(0, 256, (count, *SHAPE)), values).astype(np.uint8)

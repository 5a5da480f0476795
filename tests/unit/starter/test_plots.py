"""`starter.plots`: the summary PNG of a populate run, in both of its forms, and its errors."""

from __future__ import annotations

import os

import numpy as np
import pytest

from replay_service.errors import CheckpointError
from replay_service.starter.plots import _action_names, write_summary_plot
from replay_service.starter.results import StepRecorder

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def recorder(steps: int, action_size: int, time_of_day: bool) -> StepRecorder:
    """A recorder filled by hand: `steps` steps 15 minutes apart from 06:00."""
    made = StepRecorder(time_of_day)
    rng = np.random.default_rng(steps)
    made.rewards = list(rng.normal(size=steps))
    made.actions = list(rng.normal(size=(steps, action_size)))
    made.hours = [(6.0 + i * 0.25) % 24.0 for i in range(steps)] if time_of_day else []
    return made


@pytest.mark.parametrize(("time_of_day", "action_size"), [(True, 2), (False, 3)])
def test_the_plot_is_a_png_at_the_given_path(tmp_path, time_of_day, action_size):
    path = str(tmp_path / "b.summary.png")
    # The second env recorded nothing (left out of the actions); the third only a few steps.
    recorders = [recorder(n, action_size, time_of_day) for n in (40, 0, 7)]
    assert write_summary_plot(path, recorders, "title", time_of_day=time_of_day) == path
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    assert os.path.getsize(path) > 10_000  # two panels drawn, not an empty figure


def test_an_unwritable_path_is_a_checkpoint_error_naming_it(tmp_path):
    path = str(tmp_path / "missing_dir" / "p.png")
    with pytest.raises(
        CheckpointError, match="cannot write the summary plot '.*missing_dir/p.png'"
    ):
        write_summary_plot(path, [recorder(5, 2, True)], "t", time_of_day=True)
    assert not os.path.exists(path)


def test_action_names_use_the_known_names_only_when_they_fit():
    known = ("heating setpoint", "cooling setpoint")
    assert _action_names(2, known) == list(known)
    assert _action_names(1, known) == ["action"]
    assert _action_names(3, known) == ["action[0]", "action[1]", "action[2]"]

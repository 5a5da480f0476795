"""A save that lost a race with another save or an adoption is recognized and asked once more;
every other failure is raised as it came."""

from __future__ import annotations

import pytest

from replay_service.backends.reverb.platform.saves import (
    is_concurrent_save_error,
    retry_concurrent_save,
)

RACE = RuntimeError("/ckpt/checkpoints/2024-01-01T00:00:00 not found \n")


def test_only_a_runtime_error_ending_in_not_found_is_a_lost_race() -> None:
    assert is_concurrent_save_error(RACE)
    assert not is_concurrent_save_error(RuntimeError("not found: disk full"))
    assert not is_concurrent_save_error(FileNotFoundError("/ckpt not found"))


def test_a_lost_race_is_asked_again_once_and_its_answer_returned() -> None:
    answers: list[BaseException | str] = [RACE, "/ckpt/2"]

    def save() -> str:
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    assert retry_concurrent_save(save) == "/ckpt/2"
    assert answers == []


def test_a_second_lost_race_and_other_errors_are_raised() -> None:
    calls = []

    def racing() -> str:
        calls.append(1)
        raise RACE

    with pytest.raises(RuntimeError, match="not found"):
        retry_concurrent_save(racing)
    assert len(calls) == 2

    def full() -> str:
        calls.append(2)
        raise RuntimeError("No space left on device")

    with pytest.raises(RuntimeError, match="No space"):
        retry_concurrent_save(full)
    assert calls.count(2) == 1

"""`storage.checkpoint_format`: the registry of formats, and which one owns a checkpoint."""

from __future__ import annotations

import pytest

from replay_service.errors import CheckpointError
from replay_service.storage import checkpoint_format
from replay_service.storage.checkpoint_format import (
    backend_of_files,
    format_of,
    register,
    registered,
    verify_checkpoint,
)
from storage_fakes import SuffixFormat

LOCAL = SuffixFormat("local", ".safetensors", (3, {"t.safetensors": {"size": 1}}))
REVERB = SuffixFormat("reverb", ".tfrecord")


@pytest.fixture()
def registry(monkeypatch):
    """An empty registry, restored afterwards."""
    monkeypatch.setattr(checkpoint_format, "_REGISTERED", [])


def test_both_backends_are_registered_local_first():
    import replay_service.backends  # noqa: F401  (registers both)

    assert [f.backend for f in registered()] == ["local", "reverb"]


def test_register_adds_once_per_backend_and_replaces_in_place(registry):
    register(LOCAL)
    register(REVERB)
    newer = SuffixFormat("local", ".npz")
    register(newer)
    assert registered() == (newer, REVERB)
    assert isinstance(registered(), tuple)


def test_the_first_format_that_owns_the_files_is_their_format():
    both = SuffixFormat("both", ".tfrecord")
    assert format_of((LOCAL, REVERB, both), ["DONE", "x.tfrecord"]) is REVERB
    assert format_of((both, REVERB), ["x.tfrecord"]) is both
    assert format_of((LOCAL, REVERB), ["DONE"]) is None
    assert backend_of_files((LOCAL, REVERB), ["a.safetensors"]) == "local"
    assert backend_of_files((LOCAL, REVERB), []) is None
    assert backend_of_files((), ["a.safetensors"]) is None


def test_verify_checkpoint_asks_the_owner(tmp_path):
    (tmp_path / "t.safetensors").write_text("")
    assert verify_checkpoint((REVERB, LOCAL), str(tmp_path)) == LOCAL.verified


def test_an_unowned_checkpoint_is_incomplete_without_done_else_foreign(tmp_path):
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(CheckpointError, match=r"^checkpoint '.*' is incomplete \(no DONE file\)$"):
        verify_checkpoint((LOCAL, REVERB), str(tmp_path))
    (tmp_path / "DONE").write_text("")
    with pytest.raises(CheckpointError) as raised:
        verify_checkpoint((LOCAL, REVERB), str(tmp_path))
    assert str(raised.value) == (
        f"checkpoint {str(tmp_path)!r} holds no files of a known checkpoint format (local, "
        "reverb): ['DONE', 'notes.txt']"
    )
    with pytest.raises(CheckpointError, match=r"format \(none given\)"):
        verify_checkpoint((), str(tmp_path))


def test_a_checkpoint_that_cannot_be_listed_is_named(tmp_path):
    with pytest.raises(CheckpointError, match=r"^cannot list checkpoint '.*missing': "):
        verify_checkpoint((LOCAL,), str(tmp_path / "missing"))

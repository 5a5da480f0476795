"""Format tags: what each format reads, and how a tag it does not read is refused."""

from __future__ import annotations

import pytest

from replay_service.errors import CheckpointError, UnknownFormatError
from replay_service.storage import formats

pytestmark = pytest.mark.local


@pytest.mark.parametrize("file_format", formats.FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("digits", [2, 40, 5000])
def test_a_tag_of_a_far_newer_version_is_refused_as_newer(file_format, digits):
    """A version of any length is compared, never converted (Python refuses 4300+ digits)."""
    version = "9" * digits
    with pytest.raises(UnknownFormatError, match=f"version {version}, written by a newer"):
        file_format.check(f"{file_format.name}/{version}", "'f.json'")


@pytest.mark.parametrize("file_format", formats.FORMATS, ids=lambda f: f.name)
def test_versions_with_leading_zeros_compare_by_value(file_format):
    with pytest.raises(UnknownFormatError, match="version 2, written by a newer"):
        file_format.check(f"{file_format.name}/0002", "'f.json'")
    with pytest.raises(UnknownFormatError, match="does not know"):
        file_format.check(f"{file_format.name}/01", "'f.json'")  # never written: not read
    with pytest.raises(UnknownFormatError, match="does not know"):
        file_format.check(f"{file_format.name}/0", "'f.json'")


@pytest.mark.parametrize("found", [None, "", 1, 1.0, True, ["x/1"], {"a": 1}])
def test_a_missing_or_non_text_tag_is_damage(found):
    with pytest.raises(CheckpointError, match="no format tag") as raised:
        formats.EXPORT.check(found, "'f.json'")
    assert not isinstance(raised.value, UnknownFormatError)

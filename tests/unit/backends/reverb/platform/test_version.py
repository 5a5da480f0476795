"""Only the dm-reverb releases whose private formats were verified are accepted."""

from __future__ import annotations

import importlib.metadata

import pytest

from replay_service.backends.reverb.platform import version
from replay_service.errors import ServerError


def test_the_installed_reverb_is_supported() -> None:
    version.require_supported_reverb()


@pytest.mark.parametrize("installed", ["0.14.0", "0.13.1rc0"])
def test_verified_releases_pass(monkeypatch: pytest.MonkeyPatch, installed: str) -> None:
    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed)
    version.require_supported_reverb()


@pytest.mark.parametrize("installed", ["0.15.0", "0.1.3", "1.13.0"])
def test_other_releases_are_refused_naming_them(
    monkeypatch: pytest.MonkeyPatch, installed: str
) -> None:
    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed)
    expected = rf"dm-reverb {installed} is installed.*0\.13\.x / 0\.14\.x"
    with pytest.raises(ServerError, match=expected):
        version.require_supported_reverb()


def test_no_reverb_distribution_is_refused_as_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(ServerError, match="dm-reverb unknown is installed"):
        version.require_supported_reverb()

"""`backends.reverb.platform.inspect_patch`: the switch, the probe, patching and unpatching, and a
wrapper that answers only for wrapt proxies; in this process (the subprocess cases are in
tests/system/integrations/test_tf_compat.py)."""

from __future__ import annotations

import inspect

import pytest

from replay_service.backends.reverb.platform import inspect_patch
from replay_service.errors import ConfigError


def test_a_bad_switch_value_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"REPLAY_SERVICE_PATCH_INSPECT='maybe'"):
        inspect_patch.patch_enabled({inspect_patch.PATCH_ENV: "maybe"})
    assert inspect_patch.patch_enabled({}) is True
    assert inspect_patch.patch_enabled({inspect_patch.PATCH_ENV: " ON "}) is True
    assert inspect_patch.patch_enabled({inspect_patch.PATCH_ENV: "no"}) is False
    for setting in ("0", "off", "False"):
        assert inspect_patch.patch_enabled({inspect_patch.PATCH_ENV: setting}) is False, setting


def test_patching_is_idempotent_and_unpatch_restores_the_original() -> None:
    # This process imported replay_service's Reverb modules, so the patch is in place.
    assert inspect_patch.patch_inspect() is True
    patched = inspect._check_instance  # type: ignore[attr-defined]
    original = patched._replay_service_original
    try:
        assert inspect_patch.patch_inspect() is True
        assert inspect._check_instance is patched  # type: ignore[attr-defined]
        assert inspect_patch.unpatch_inspect() is True
        assert inspect._check_instance is original  # type: ignore[attr-defined]
        assert not inspect_patch.is_patched()
        assert inspect_patch.needs_patch(), "the probe no longer sees the failure this patch is for"
        assert inspect_patch.unpatch_inspect() is False
    finally:
        inspect_patch.patch_inspect()
    assert inspect_patch.is_patched() and not inspect_patch.needs_patch()


def test_the_patch_answers_only_for_wrapt_proxies() -> None:
    import wrapt

    class Plain:
        pass

    class Proxy(Plain, wrapt.ObjectProxy):
        pass

    proxy = Proxy({"key": 1})
    assert inspect.getattr_static(proxy, "key", "absent") == "absent"
    assert inspect.getattr_static(proxy, "__init__") is Proxy.__init__

    def failing(obj: object, attr: str) -> object:
        raise TypeError(f"not {attr}")

    wrapper = inspect_patch._make_wrapper(failing, wrapt.ObjectProxy)
    assert wrapper(proxy, "x") is inspect._sentinel  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="not x"):
        wrapper(Plain(), "x")


def test_the_switch_off_leaves_inspect_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    inspect_patch.patch_inspect()
    original = inspect._check_instance._replay_service_original  # type: ignore[attr-defined]
    monkeypatch.setenv(inspect_patch.PATCH_ENV, "off")
    try:
        assert inspect_patch.unpatch_inspect() is True
        assert inspect_patch.patch_inspect() is False
        assert inspect._check_instance is original  # type: ignore[attr-defined]
        monkeypatch.setenv(inspect_patch.PATCH_ENV, "sometimes")
        with pytest.raises(ConfigError, match=r"REPLAY_SERVICE_PATCH_INSPECT='sometimes'"):
            inspect_patch.patch_inspect()
    finally:
        monkeypatch.delenv(inspect_patch.PATCH_ENV)
        inspect_patch.patch_inspect()
    assert inspect_patch.is_patched()

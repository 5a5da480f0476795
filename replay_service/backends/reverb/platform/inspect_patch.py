"""The `inspect` patch that lets TF-Agents' `PolicySaver` save policies with the pinned stack.

What breaks: with tensorflow 2.14, wrapt 1.14's C `ObjectProxy` and typing_extensions >= 4.6
(torch 2.x requires it), `tf_agents.policies.policy_saver.PolicySaver(...)` fails while tracing
its functions with `TypeError: this __dict__ descriptor does not support '_DictWrapper' objects`
(TensorFlow issues #62217 and #63548, wrapt issue #231), and so does every TF-Agents training
script (`triggers.PolicySavedModelTrigger`, e.g. TF-Agents' distributed `sac_train.py`) and
sbsim's training. TensorFlow's tracing asks `isinstance(value, SupportsTracingProtocol)`, a
runtime-checkable `typing_extensions.Protocol`; since 4.6 that check reads attributes with
`inspect.getattr_static`, whose `inspect._check_instance` reads the instance `__dict__` with
`object.__getattribute__(obj, "__dict__")`. For TensorFlow's `_DictWrapper` (a Python class
mixed with wrapt's C `ObjectProxy`) that read raises `TypeError`, which `_check_instance` does
not catch (it catches `AttributeError`), and the check fails instead of answering.

What the patch does: it replaces `inspect._check_instance` with a wrapper that calls the original
and, only where the original raises `TypeError` for an instance of a wrapt `ObjectProxy` subclass,
answers "no instance attribute", as the original does when an object has no `__dict__` (what it
sees with wrapt's pure-Python proxy). Every other call, and every other error, is unchanged.

When it applies: `patch_inspect()` runs when `ReplayBufferManager` is imported (`from
replay_service import ReplayBufferManager`, before any buffer exists, so that a script may save
a policy first) and when a module of the Reverb backend or of the TF-Agents side is imported
(`replay_service.backends.reverb.backend`, `.liveness`, `replay_service.starter.policies`). It
imports no TensorFlow (the local backend's import path stays free of it) and patches only where
the failure occurs:
a probe checks a runtime-checkable `typing_extensions.Protocol` against a wrapt proxy of
`_DictWrapper`'s make-up and patches only if that raises the `TypeError` (so not with
typing_extensions < 4.6, nor with `WRAPT_DISABLE_EXTENSIONS=true`, nor once wrapt or
typing_extensions fix it). Applying it again does nothing.

How to turn it off: set `REPLAY_SERVICE_PATCH_INSPECT=0` (or false/no/off) before
replay_service's Reverb modules are imported; `unpatch_inspect()` undoes it in a running process.

Scripts that never import replay_service (TF-Agents' own examples) run with the patch as
`python -m replay_service.integrations.tf_compat SCRIPT [ARGS...]` (or `-m MODULE [ARGS...]`).
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from replay_service.errors import ConfigError

PATCH_ENV = "REPLAY_SERVICE_PATCH_INSPECT"
"""Set to 0 (or false/no/off) to leave `inspect` alone; 1/true/yes/on or unset patches."""

_OFF = frozenset({"0", "false", "no", "off"})
_ON = frozenset({"", "1", "true", "yes", "on"})
# Set on the wrapper; holds the function it replaced, so that any copy of this module (a
# `python -m` run imports it twice) recognises and undoes the patch.
_ORIGINAL_ATTR = "_replay_service_original"

_log = logging.getLogger(__name__)


def patch_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether `REPLAY_SERVICE_PATCH_INSPECT` allows the patch.

    Args:
      environ: The environment (default `os.environ`).

    Returns:
      False for 0/false/no/off, True when unset or 1/true/yes/on (any case).

    Raises:
      ConfigError: For any other value, naming the variable and the value.
    """
    environ = os.environ if environ is None else environ
    value = environ.get(PATCH_ENV, "")
    setting = value.strip().lower()
    if setting in _OFF:
        return False
    if setting in _ON:
        return True
    raise ConfigError(
        f"{PATCH_ENV}={value!r} is not a switch: use 0 (or false/no/off) to leave inspect "
        "alone, 1 (or true/yes/on, or leave it unset) to let PolicySaver work"
    )


def is_patched() -> bool:
    """Whether `inspect._check_instance` is this module's wrapper.

    Returns:
      True while the patch is in place.
    """
    return hasattr(getattr(inspect, "_check_instance", None), _ORIGINAL_ATTR)


def needs_patch() -> bool:
    """Whether TensorFlow's tracing check fails on a wrapt proxy in this process (see module docs).

    Probes a runtime-checkable `typing_extensions.Protocol` against an instance of a class that
    mixes a Python class with `wrapt.ObjectProxy`, as TensorFlow's `_DictWrapper` does.

    Returns:
      True if the check raises `TypeError` (always False once the patch is in place, and where
      wrapt or typing_extensions is not installed).
    """
    try:
        import typing_extensions
        import wrapt
    except ImportError:
        return False

    class _Trackable:
        pass

    class _ProxyLikeDictWrapper(_Trackable, wrapt.ObjectProxy):  # type: ignore[misc]
        pass

    @typing_extensions.runtime_checkable
    class _Probe(typing_extensions.Protocol):
        def replay_service_probe(self) -> None: ...

    try:
        isinstance(_ProxyLikeDictWrapper({}), _Probe)
    except TypeError:
        return True
    return False


def _make_wrapper(original: Callable[[Any, str], Any], proxy_type: type) -> Callable[..., Any]:
    """The replacement of `inspect._check_instance` (see module docs).

    Args:
      original: The `inspect._check_instance` it replaces.
      proxy_type: `wrapt.ObjectProxy`.

    Returns:
      A function with `original`'s signature and the original kept under `_ORIGINAL_ATTR`.
    """
    not_found = inspect._sentinel  # type: ignore[attr-defined]

    def _check_instance(obj: Any, attr: str) -> Any:
        try:
            return original(obj, attr)
        except TypeError:
            # type(), not isinstance(): a proxy answers isinstance for what it wraps.
            if not issubclass(type(obj), proxy_type):
                raise
            return not_found

    _check_instance.__doc__ = (
        "inspect._check_instance, answering 'no instance attribute' for a wrapt proxy whose "
        "__dict__ cannot be read (patched by replay_service.integrations.tf_compat)."
    )
    setattr(_check_instance, _ORIGINAL_ATTR, original)
    return _check_instance


def patch_inspect() -> bool:
    """Applies the patch if it is enabled and needed here; idempotent.

    Returns:
      Whether the patch is in place afterwards.

    Raises:
      ConfigError: If `REPLAY_SERVICE_PATCH_INSPECT` holds an unknown value.
    """
    if is_patched():
        return True
    if not patch_enabled() or not needs_patch():
        return False
    original = getattr(inspect, "_check_instance", None)
    if original is None or not hasattr(inspect, "_sentinel"):
        _log.warning(
            "TF-Agents' PolicySaver will fail here: this Python's inspect module has no "
            "_check_instance to patch (see replay_service.integrations.tf_compat)"
        )
        return False
    import wrapt

    inspect._check_instance = _make_wrapper(original, wrapt.ObjectProxy)  # type: ignore[attr-defined]
    _log.debug(
        "patched inspect._check_instance so that PolicySaver works (%s=0 turns it off)", PATCH_ENV
    )
    return True


def unpatch_inspect() -> bool:
    """Puts the original `inspect._check_instance` back.

    Returns:
      True if the patch was in place and is now undone, False if there was nothing to undo.
    """
    current = getattr(inspect, "_check_instance", None)
    original = getattr(current, _ORIGINAL_ATTR, None)
    if original is None:
        return False
    inspect._check_instance = original  # type: ignore[attr-defined]
    return True

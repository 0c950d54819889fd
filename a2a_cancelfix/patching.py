"""`patch()` and `unpatch()`: our handler's behaviour for every handler of the SDK's class.

For servers whose handler a framework builds (google-adk's ``to_a2a``, a2a-lite's subclass),
where swapping the import is not possible: call ``a2a_cancelfix.patch()`` once, early, and
every ``DefaultRequestHandlerV2`` (``DefaultRequestHandler``) built from then on, of the SDK's
class or of a subclass, defined before or after the call, behaves as
`a2a_cancelfix.DefaultRequestHandler` does. The swapped import stays the first choice: it
touches nothing outside your code. The shape is truststore's ``inject_into_ssl()``.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable
from typing import Any

from a2a.server.request_handlers import DefaultRequestHandlerV2

from a2a_cancelfix import _sdk
from a2a_cancelfix.handler import DefaultRequestHandler
from a2a_cancelfix.lifecycle import Settings

logger = logging.getLogger("a2a_cancelfix")

# What our handler overrides, and so what patch() puts on the SDK's class.
_METHODS = (
    "on_cancel_task",
    "on_message_send",
    "on_message_send_stream",
    "on_subscribe_to_task",
    "on_get_task",
    "aclose",
)
_ABSENT = object()  # An SDK class without the method (aclose on 1.0.x).

# The SDK class's own attributes that patch() replaced, while it is patched.
_replaced: dict[str, Any] | None = None


def patch(**options: Any) -> None:
    """Make every handler of the SDK's ``DefaultRequestHandlerV2`` class ours, from now on.

    Handlers built before the call keep the SDK's behaviour. A second call changes nothing
    (call `unpatch` first to change the options). On an a2a-sdk release whose internals this
    package cannot find, the SDK is left untouched, with one ``RuntimeWarning``.

    Args:
        options: our handler's keyword options (``cancel_grace_period``, ``on_parked``,
            ``on_canceled``, ``replica_poll_interval``, ``cancel_unwatched_after``,
            ``cancel_unwatched_parked``), for every handler.

    Raises:
        TypeError, ValueError: an option outside its documented values, or an unknown one.
    """
    global _replaced
    unknown = set(options) - set(Settings.__dataclass_fields__)
    if unknown:
        raise TypeError(f"patch() got unknown options: {', '.join(sorted(unknown))}")
    Settings(**options)  # Checked now, not at the first handler a framework builds.
    if _replaced is not None:
        return
    if not _sdk.SUPPORTED:
        message = (
            f"a2a_cancelfix.patch() left a2a-sdk {_sdk.SDK_VERSION} untouched: it lacks "
            f"{', '.join(_sdk.MISSING)}. Swap the handler's import instead."
        )
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        logger.warning(message)
        return
    sdk = DefaultRequestHandlerV2
    replaced = {name: sdk.__dict__.get(name, _ABSENT) for name in ("__init__", *_METHODS)}
    sdk_init = replaced["__init__"]

    @functools.wraps(sdk_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807 (the SDK class's, replaced)
        DefaultRequestHandler.__init__(self, *args, **{**options, **kwargs})

    sdk.__init__ = __init__  # type: ignore[method-assign]
    for name in _METHODS:
        setattr(sdk, name, _ours_if_built_so(DefaultRequestHandler.__dict__[name], replaced[name]))
    _replaced = replaced
    logger.info(
        "a2a_cancelfix patched a2a-sdk %s: every DefaultRequestHandlerV2 built from now on "
        "cancels as a2a_cancelfix.DefaultRequestHandler (%s)",
        _sdk.SDK_VERSION,
        ", ".join(("__init__", *_METHODS)),
    )


def unpatch() -> None:
    """Give the SDK's class its own methods back; handlers built meanwhile keep ours."""
    global _replaced
    if _replaced is None:
        return
    for name, method in _replaced.items():
        if method is _ABSENT:
            delattr(DefaultRequestHandlerV2, name)
        else:
            setattr(DefaultRequestHandlerV2, name, method)
    _replaced = None
    logger.info("a2a_cancelfix unpatched a2a-sdk %s", _sdk.SDK_VERSION)


def is_patched() -> bool:
    """Whether `patch()` is in force: a handler of the SDK's class built now is ours."""
    return _replaced is not None


def _ours_if_built_so(ours: Callable[..., Any], sdk: Any) -> Callable[..., Any]:
    """Our method for a handler our constructor built; the SDK's for one built before."""

    @functools.wraps(ours)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if "_lifecycle" in self.__dict__:
            return ours(self, *args, **kwargs)
        if sdk is _ABSENT:
            raise AttributeError(f"{type(self).__name__} has no attribute {ours.__name__!r}")
        return sdk(self, *args, **kwargs)

    return method

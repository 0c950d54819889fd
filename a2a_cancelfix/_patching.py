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
import inspect
import logging
import warnings
from collections.abc import Callable
from typing import Any

from a2a.server.request_handlers import DefaultRequestHandlerV2

from a2a_cancelfix import _sdk
from a2a_cancelfix._cancel.settings import Settings
from a2a_cancelfix._handler import DefaultRequestHandler

logger = logging.getLogger("a2a_cancelfix")

# What our handler overrides, and so what patch() puts on the SDK's class.
_METHODS = (
    "on_cancel_task",
    "on_message_send",
    "on_message_send_stream",
    "on_subscribe_to_task",
    "on_get_task",
    "on_delete_task_push_notification_config",
    "aclose",
)
_ABSENT = object()  # An SDK class without the method (aclose on 1.0.x).
_SDK_INIT = DefaultRequestHandlerV2.__dict__["__init__"]
# The options patch() takes: our handler's own keywords (not every field of `Settings`, whose
# ``timing`` is the testing kit's and would fail only at the first handler a framework builds).
_OPTIONS = tuple(
    parameter.name
    for parameter in inspect.signature(DefaultRequestHandler.__init__).parameters.values()
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY
)

# The options in force while patched; None while not.
_options: dict[str, Any] | None = None


def patch(**options: Any) -> None:
    """Make every handler of the SDK's ``DefaultRequestHandlerV2`` class ours, from now on.

    Handlers built before the call keep the SDK's behaviour; handlers built while patched
    keep ours for good, `unpatch` or not. A second call with the same options changes nothing;
    with other options it raises (call `unpatch` first: a handler built in between would keep
    the first ones). On an a2a-sdk release whose internals this package cannot find, the SDK is
    left untouched, with one ``RuntimeWarning``.

    Args:
        options: our handler's keyword options (``cancel_grace_period``, ``on_parked``,
            ``on_canceled``, ``replica_poll_interval``, ``cancel_unwatched_after``,
            ``cancel_unwatched_parked``, ``shutdown_drain_time``, ``lease_time``,
            ``sole_replica``), for every handler; checked here, as the handler checks them.

    Raises:
        TypeError, ValueError: an option outside its documented values, or an unknown one.
        RuntimeError: already patched with other options.
    """
    global _options
    unknown = set(options) - set(_OPTIONS)
    if unknown:
        raise TypeError(f"patch() got unknown options: {', '.join(sorted(unknown))}")
    settings = Settings(**options)  # Checked now, not at the first handler a framework builds.
    if _options is not None:
        if settings == Settings(**_options):
            return
        raise RuntimeError(
            f"a2a_cancelfix.patch() is in force with options {_options}: call unpatch() "
            f"before patch() with {options}"
        )
    if not _sdk.SUPPORTED:
        message = (
            f"a2a_cancelfix.patch() left a2a-sdk {_sdk.SDK_VERSION} untouched: it lacks "
            f"{', '.join(_sdk.MISSING)}. Swap the handler's import instead."
        )
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        logger.warning(message)
        return
    sdk = DefaultRequestHandlerV2
    # Put once, and left by unpatch(): a handler built while patched needs ours for good.
    for name in _METHODS:
        if not isinstance(sdk.__dict__.get(name), _Dispatch):
            setattr(
                sdk, name, _Dispatch(DefaultRequestHandler.__dict__[name], sdk.__dict__.get(name, _ABSENT))
            )

    @functools.wraps(_SDK_INIT)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807 (the SDK class's, replaced)
        DefaultRequestHandler.__init__(self, *args, **{**options, **kwargs})

    sdk.__init__ = __init__  # type: ignore[method-assign]
    _options = options
    logger.info(
        "a2a_cancelfix patched a2a-sdk %s: every DefaultRequestHandlerV2 built from now on "
        "cancels as a2a_cancelfix.DefaultRequestHandler (%s)",
        _sdk.SDK_VERSION,
        ", ".join(("__init__", *_METHODS)),
    )


def unpatch() -> None:
    """Give the SDK's class its own constructor back: a handler built from now on is the SDK's.

    Handlers built while patched keep ours (their methods on the SDK's class stay ours for
    them; for every other handler they are the SDK's own).
    """
    global _options
    if _options is None:
        return
    DefaultRequestHandlerV2.__init__ = _SDK_INIT  # type: ignore[method-assign]
    _options = None
    logger.info("a2a_cancelfix unpatched a2a-sdk %s", _sdk.SDK_VERSION)


def is_patched() -> bool:
    """Whether `patch()` is in force: a handler of the SDK's class built now is ours."""
    return _options is not None


class _Dispatch:
    """A method of the SDK's class once patched: ours for a handler our constructor built,
    the SDK's own (or none, where the SDK has none) for any other.

    Read on the class, it is a function that chooses so at each call: what wraps it (an
    instrumentation replacing the class's method) keeps both.
    """

    def __init__(self, ours: Callable[..., Any], sdk: Any) -> None:
        self.ours, self.sdk = ours, sdk
        self._unbound = _ours_if_built_so(ours, sdk)

    def __get__(self, handler: Any, owner: type | None = None) -> Any:
        if handler is None:
            return self._unbound
        if "_lifecycle" in handler.__dict__:
            return self.ours.__get__(handler, owner)
        if self.sdk is _ABSENT:
            raise AttributeError(f"{type(handler).__name__!r} object has no attribute {self.ours.__name__!r}")
        return self.sdk.__get__(handler, owner)


def _ours_if_built_so(ours: Callable[..., Any], sdk: Any) -> Callable[..., Any]:
    """Our method for a handler our constructor built; the SDK's for one built otherwise."""

    @functools.wraps(ours)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if "_lifecycle" in self.__dict__:
            return ours(self, *args, **kwargs)
        if sdk is _ABSENT:
            raise AttributeError(f"{type(self).__name__} has no attribute {ours.__name__!r}")
        return sdk(self, *args, **kwargs)

    return method

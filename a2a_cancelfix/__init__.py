"""Task cancellation that always ends, promptly and observably, for a2a-sdk 1.x servers."""

from a2a_cancelfix._executor import CancellableExecutor
from a2a_cancelfix._handler import DefaultRequestHandler
from a2a_cancelfix._patching import patch, unpatch
from a2a_cancelfix.checkpoints import (
    RunCancelled,
    cancel_requested,
    cancellable,
    checkpoint,
    on_cancel,
    shielded,
)
from a2a_cancelfix.store import FinalStateTaskStore

DefaultRequestHandlerV2 = DefaultRequestHandler

__all__ = [
    "CancellableExecutor",
    "DefaultRequestHandler",
    "DefaultRequestHandlerV2",
    "FinalStateTaskStore",
    "RunCancelled",
    "cancel_requested",
    "cancellable",
    "checkpoint",
    "on_cancel",
    "patch",
    "shielded",
    "unpatch",
]


def __getattr__(name: str) -> str:
    if name == "__version__":
        from importlib.metadata import version

        return version("a2a-cancelfix")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

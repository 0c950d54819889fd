"""What each handler does, per tested a2a-sdk release: the README's table, checked by tests."""

from __future__ import annotations

from a2a_cancelfix._sdk import SDK_VERSION

COLUMNS = ("1.0.0, 1.0.3", "1.1.2, 1.1.3", "1.1.5", "1.2.3, 1.3.0")


def column(version: str = SDK_VERSION) -> int:
    """The column of the README table that an a2a-sdk release belongs to."""
    release = tuple(int(part) for part in version.split(".")[:3])
    if release < (1, 1, 0):
        return 0
    if release < (1, 1, 4):
        return 1
    if release < (1, 2, 0):
        return 2
    return 3


def _same(outcome: str) -> tuple[str, str, str, str]:
    return (outcome,) * 4


# What the SDK's own DefaultRequestHandler does.
STOCK: dict[str, tuple[str, str, str, str]] = {
    "mid-run, cancel() empty": ("WORKING / WORKING",) * 2 + ("CANCELED / CANCELED",) * 2,
    "mid-run, blocking sender in flight": ("sender got WORKING",) * 2 + ("sender got CANCELED",) * 2,
    "mid-run, sender's stream": _same("stream ends on WORKING"),
    "mid-run, SubscribeToTask stream": _same("stream ends on WORKING"),
    "mid-run, two push configs": _same("a got WORKING, b got nothing"),
    "cancel retried": (
        "WORKING, then WORKING",
        "WORKING, then WORKING",
        "CANCELED, then CANCELED",
        "CANCELED, then TaskNotCancelable",
    ),
    "parked INPUT_REQUIRED": ("INPUT_REQUIRED / INPUT_REQUIRED, cancel() called",) * 2
    + ("CANCELED / CANCELED, cancel() called",) * 2,
    "no live run here (restart, other replica)": ("HANG",) * 3 + ("CANCELED / CANCELED",),
    "cancel() publishes CANCELED": _same("CANCELED / CANCELED"),
    "cancel() awaits I/O, then publishes": ("WORKING / WORKING",) * 2 + ("CANCELED / CANCELED",) * 2,
    "cancel() raises": _same("raised RuntimeError / FAILED"),
    "cancel() hangs": _same("HANG"),
    "execute() swallows CancelledError": _same("HANG"),
    "another user cancels": ("WORKING, owner sees WORKING, run killed",) * 2
    + ("TaskNotFound, owner sees WORKING, run untouched",) * 2,
    "another user subscribes": ("got WORKING",) * 2 + ("got TaskNotFoundError",) * 2,
    "unknown task id": _same("TaskNotFound"),
    "completed task": ("TaskNotCancelable", "COMPLETED", "COMPLETED", "TaskNotCancelable"),
    "caller disconnects mid-cancel": _same("task ends WORKING"),
    "two concurrent cancels": ("WORKING and WORKING",) * 2 + ("CANCELED and CANCELED",) * 2,
}

# Where the SDK's handler around a CancellableExecutor still differs from our handler;
# None: it does what our handler does.
WRAPPED: dict[str, tuple[str | None, str | None, str | None, str | None]] = {
    "cancel retried": (None, "CANCELED, then CANCELED", "CANCELED, then CANCELED", None),
    "another user cancels": ("CANCELED, owner sees WORKING, run killed",) * 2 + (None, None),
    "another user subscribes": ("got WORKING",) * 2 + (None, None),
    "completed task": (None, "COMPLETED", "COMPLETED", None),
    "caller disconnects mid-cancel": _same("task ends WORKING"),
    "cancel() raises": _same("raised RuntimeError / FAILED"),
}

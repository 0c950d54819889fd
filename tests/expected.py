"""What each handler does, per tested a2a-sdk release: the README's table, checked by tests."""

from __future__ import annotations

from a2a_cancelfix._sdk import SDK_VERSION

COLUMNS = ("1.0.0", "1.0.3", "1.1.2, 1.1.3", "1.1.5", "1.2.2", "1.2.3", "1.3.0")
_FIRST = ((1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 4), (1, 2, 0), (1, 2, 3), (1, 3, 0))
"""The first release of each column's range."""


def column(version: str = SDK_VERSION) -> int:
    """The column of the README table that an a2a-sdk release belongs to."""
    release = tuple(int(part) for part in version.split(".")[:3])
    return max(index for index, first in enumerate(_FIRST) if release >= first)


def _same(outcome: str) -> tuple[str, ...]:
    return (outcome,) * len(COLUMNS)


def _split(first: str, before: str | None, after: str | None) -> tuple[str | None, ...]:
    """``before`` in the columns left of ``first``, ``after`` from it on."""
    changed = COLUMNS.index(first)
    return (before,) * changed + (after,) * (len(COLUMNS) - changed)


def _until_1_1_4(before: str | None, after: str | None) -> tuple[str | None, ...]:
    """``before`` up to a2a-sdk 1.1.3, ``after`` from 1.1.4 (upstream's cancel fix) on."""
    return _split("1.1.5", before, after)


def _until_1_2(before: str | None, after: str | None) -> tuple[str | None, ...]:
    """``before`` up to a2a-sdk 1.1.5, ``after`` from 1.2.0 (a terminal task refused first) on."""
    return _split("1.2.2", before, after)


# What the SDK's own DefaultRequestHandler does, as its clients see it (over JSON-RPC, or
# gRPC where the scenario says so).
STOCK: dict[str, tuple[str | None, ...]] = {
    "mid-run, cancel() empty": _until_1_1_4("WORKING / WORKING", "CANCELED / CANCELED"),
    "mid-run, blocking sender in flight": _until_1_1_4("sender got WORKING", "sender got CANCELED"),
    "mid-run, sender's stream": _same("stream ends on WORKING"),
    "mid-run, SubscribeToTask stream": _same("stream ends on WORKING"),
    "mid-run, two push configs": _same("a got WORKING, b got nothing"),
    "cancel retried": ("WORKING, then WORKING",) * 3
    + ("CANCELED, then CANCELED",)
    + ("CANCELED, then TaskNotCancelable",) * 3,
    "parked INPUT_REQUIRED": _until_1_1_4(
        "INPUT_REQUIRED / INPUT_REQUIRED, cancel() called", "CANCELED / CANCELED, cancel() called"
    ),
    "no live run here (restart, other replica)": _until_1_2("HANG", "CANCELED / CANCELED"),
    "cancel() publishes CANCELED": _same("CANCELED / CANCELED"),
    "cancel() awaits I/O, then publishes": _until_1_1_4("WORKING / WORKING", "CANCELED / CANCELED"),
    "cancel() raises": _same("Internal / FAILED"),
    "cancel() hangs": _same("HANG"),
    "execute() swallows CancelledError": _same("HANG"),
    "another user cancels": _until_1_1_4(
        "WORKING, owner sees WORKING, run killed", "TaskNotFound, owner sees WORKING, run untouched"
    ),
    "another user subscribes": _until_1_1_4("got WORKING", "got TaskNotFoundError"),
    "unknown task id": _same("TaskNotFound"),
    "completed task": _same("TaskNotCancelable"),
    "completed, execute() still returning": _until_1_2(
        "COMPLETED / COMPLETED", "TaskNotCancelable / COMPLETED"
    ),
    "client leaves mid-cancel, JSON-RPC": _until_1_1_4("task ends WORKING", "task ends CANCELED"),
    "client leaves mid-cancel, gRPC": _same("task ends WORKING"),
    "two concurrent cancels": _until_1_1_4("WORKING and WORKING", "CANCELED and CANCELED"),
    "two clients cancel at once": (
        "HANG and HANG, task WORKING",
        "WORKING and WORKING, task WORKING",
        "WORKING and WORKING, task WORKING",
        "CANCELED and CANCELED, task CANCELED",
        "CANCELED and TaskNotCancelable, task CANCELED",
        "CANCELED and CANCELED, task CANCELED",
        "CANCELED and HANG, task CANCELED",
    ),
    "second cancel while the first saves CANCELED": (
        "HANG",
        "HANG",
        "WORKING and HANG, task WORKING",
        "CANCELED and HANG, task CANCELED",
        "CANCELED and CANCELED, task CANCELED",
        "CANCELED and CANCELED, task CANCELED",
        "CANCELED and CANCELED, task CANCELED",
    ),
    "client leaves, nobody comes back": _same("task WORKING, cancel() not called"),
}

# Where the SDK's handler around a CancellableExecutor still differs from our handler;
# None: it does what our handler does.
WRAPPED: dict[str, tuple[str | None, ...]] = {
    "cancel retried": (None, None, "CANCELED, then CANCELED", "CANCELED, then CANCELED", None, None, None),
    "another user cancels": _until_1_1_4("CANCELED, owner sees WORKING, run killed", None),
    "another user subscribes": _until_1_1_4("got WORKING", None),
    "completed, execute() still returning": _until_1_2("COMPLETED / COMPLETED", None),
    "client leaves mid-cancel, gRPC": _same("task ends WORKING"),
    "second cancel while the first saves CANCELED": _until_1_1_4("HANG", None),
    "client leaves, nobody comes back": _same("task WORKING, cancel() not called"),  # An option of ours.
}

# What the same calls made straight on the stock handler show, where that is not what its clients
# see (the README says why `check` goes over a socket).
STOCK_IN_PROCESS: dict[str, tuple[str | None, ...]] = {
    "client leaves mid-cancel, JSON-RPC": _same("task ends WORKING"),
    "two clients cancel at once": _until_1_1_4(
        "WORKING and WORKING, task WORKING", "CANCELED and CANCELED, task CANCELED"
    ),
    "cancel() raises": _same("raised RuntimeError / FAILED"),
}

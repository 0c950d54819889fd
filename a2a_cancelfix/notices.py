"""Cancels pushed to every replica at once: PostgreSQL's NOTIFY, or Redis pub/sub.

A replica that records CANCELED in the shared store announces the task id; every replica
listens, and the one running the task reads the store once and cancels the run there. The
store stays the truth: a notice only says "look now", so a lost, late or doubled notice costs
a read, never a wrong state. While a replica listens it does not poll; when its listening
connection drops it polls again, reconnects, and looks once at every task it runs, so a
cancel announced during the gap is not lost.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import AsyncIterator
from typing import Any

__all__ = ["CancelNotices"]

CHANNEL = "a2a_cancelfix_cancels"


class CancelNotices(abc.ABC):
    """How replicas tell each other of a cancel: announce a task id, listen for them."""

    channel: str = CHANNEL

    async def announce_in(self, session: Any, task_id: str) -> None:
        """Announce in the transaction that records the cancel (``session``): delivered on commit."""

    async def announce(self, task_id: str) -> None:
        """Announce once the transaction that recorded the cancel has committed."""

    @abc.abstractmethod
    def listen(self) -> contextlib.AbstractAsyncContextManager[AsyncIterator[str | None]]:
        """Listen on one connection: the task ids announced, and None each time listening
        (re)starts, after which nothing announced before is still on its way. Raises when the
        connection is lost for good."""

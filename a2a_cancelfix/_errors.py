"""The A2A errors the handler answers a message with, where the SDK's own would not do."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NoReturn

from a2a.types import InternalError, SendMessageRequest, UnsupportedOperationError

from a2a_cancelfix import _sdk
from a2a_cancelfix._executor import raised_by_execute

if TYPE_CHECKING:
    from a2a.server.context import ServerCallContext

    from a2a_cancelfix._lifecycle import Lifecycle

logger = logging.getLogger("a2a_cancelfix")


def raise_for(task_id: str, error: Exception) -> NoReturn:
    """Raise what a caller gets for ``error``: the executor's own exception, passed on as the
    SDK's handler does; anything else (the task store's driver, say) as `failed` makes it."""
    if raised_by_execute(error):
        raise error
    raise failed(task_id, error) from error


def failed(task_id: str, error: Exception) -> InternalError:
    """What a stream or a sender gets for a failure that is not an A2A error, nor the executor's
    own (the task store's connection killed mid-save, say): an A2A error, as a transport would
    make it, never the driver's exception."""
    logger.warning("a request on task %s failed", task_id or "(new)", exc_info=error)
    return InternalError(message=f"The request failed: {type(error).__name__}")


def ended_first(params: SendMessageRequest, state: int) -> UnsupportedOperationError:
    return UnsupportedOperationError(
        message=f"Task {params.message.task_id} reached {_sdk.state_name(state)} before this message "
        "was processed; it was not processed"
    )


def ended(params: SendMessageRequest) -> UnsupportedOperationError:
    return UnsupportedOperationError(message=f"Task {params.message.task_id} has ended or is being canceled")


def shutting_down() -> UnsupportedOperationError:
    return UnsupportedOperationError(message="The server is shutting down; it takes no new messages")


async def refuse_if_ended(
    lifecycle: Lifecycle, params: SendMessageRequest, context: ServerCallContext
) -> bool:
    """Refuse a message to a task being canceled or already terminal, as the spec says; else
    whether the task is the caller's (only then does its sender watch it).

    Checked before the SDK sees the message: for a terminal task it would set up a run whose
    queues it never closes (1.0.0-1.3.0 leak two asyncio tasks per such message). Read first,
    as the caller: a task that is not the caller's is none of its business.
    """
    task_id = params.message.task_id
    task = await lifecycle.read(task_id, context)
    if task is None:
        return False  # The SDK answers TaskNotFoundError its own way.
    if task_id in lifecycle.cancellations or task.status.state in _sdk.TERMINAL_STATES:
        raise ended(params)
    return True

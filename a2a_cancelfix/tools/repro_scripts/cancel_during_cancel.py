import asyncio

from a2a.types import SendMessageConfiguration, SendMessageRequest, Task, TaskState

from .prelude import BOUND, Agent, Server, Store, as_user, message, outcome, settle


class SlowCancelSave(Store):
    """A store whose write of a CANCELED task waits until ``go`` is set, as a database write
    takes a while."""

    def __init__(self) -> None:
        super().__init__()
        self.saving, self.go, self.read = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def get(self, *args, **kwargs):
        self.read.set()
        return await super().get(*args, **kwargs)

    async def save(self, task: Task, *args, **kwargs) -> None:
        if task.status.state == TaskState.TASK_STATE_CANCELED:
            self.saving.set()
            await self.go.wait()
        await super().save(task, *args, **kwargs)


async def scenario() -> str:
    """A second client cancels a task (started with returnImmediately) while the first client's
    cancel is saving CANCELED: the run has stopped, the store still says WORKING."""
    store = SlowCancelSave()
    server = Server(Agent(), store=store)
    request = SendMessageRequest(
        message=message(), configuration=SendMessageConfiguration(return_immediately=True)
    )
    await outcome(server.handler.on_message_send(request, as_user("alice")))
    await server.working()
    first = asyncio.ensure_future(server.cancel())
    await asyncio.wait(
        {first, asyncio.ensure_future(store.saving.wait())},
        timeout=BOUND,
        return_when=asyncio.FIRST_COMPLETED,
    )
    store.read.clear()
    second = asyncio.ensure_future(server.cancel())
    read = asyncio.ensure_future(store.read.wait())  # The second cancel has reached the handler...
    await asyncio.wait({second, read}, timeout=BOUND, return_when=asyncio.FIRST_COMPLETED)
    await settle()  # ...and got as far as it can.
    store.go.set()  # Now the first one's CANCELED is saved.
    answers = await asyncio.gather(first, second)
    return f"{' and '.join(answers)}, task {await server.stored()}"

import asyncio

from a2a.types import SendMessageConfiguration, SendMessageRequest

from .prelude import BOUND, Agent, Server, as_user, message, outcome


async def scenario() -> str:
    """Two clients cancel a task started with returnImmediately; cancel() is empty. The second
    request reaches the handler a little after the first (its connection is accepted first):
    here, once the first has ended the run."""
    server = Server(Agent())
    request = SendMessageRequest(
        message=message(), configuration=SendMessageConfiguration(return_immediately=True)
    )
    await outcome(server.handler.on_message_send(request, as_user("alice")))
    await server.working()
    first = asyncio.ensure_future(server.cancel())
    await asyncio.wait(
        {first, asyncio.ensure_future(server.agent.stopped.wait())},
        timeout=BOUND,
        return_when=asyncio.FIRST_COMPLETED,
    )
    second = asyncio.ensure_future(server.cancel())
    answers = await asyncio.gather(first, second)
    return f"{' and '.join(answers)}, task {await server.stored()}"

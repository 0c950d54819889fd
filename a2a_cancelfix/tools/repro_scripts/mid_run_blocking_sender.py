import asyncio

from .prelude import BOUND, NO_ANSWER, Agent, Server


async def scenario() -> str:
    """Cancel a task while its blocking SendMessage waits for the answer."""
    server = Server(Agent())
    sender = asyncio.ensure_future(server.send())
    await server.working()
    canceller = asyncio.ensure_future(server.cancel())
    await asyncio.wait({sender}, timeout=BOUND)
    canceller.cancel()
    return sender.result() if sender.done() else f"sender: {NO_ANSWER}"

import asyncio

from .prelude import NO_ANSWER, Agent, Server


async def scenario() -> str:
    """Cancel a task while a SubscribeToTask stream of it is open."""
    server = Server(Agent())
    await server.start()
    subscriber = server.subscribe()
    await subscriber.changes.until(lambda: subscriber.states or subscriber.task.done())
    canceller = asyncio.ensure_future(server.cancel())
    ended = await subscriber.ended()
    canceller.cancel()
    return (
        f"stream ends on {subscriber.last}" if ended else f"stream open after {subscriber.last}: {NO_ANSWER}"
    )

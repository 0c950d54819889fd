import asyncio

from .prelude import NO_ANSWER, Agent, Server


async def scenario() -> str:
    """Cancel a task while its sender reads the SendStreamingMessage stream."""
    server = Server(Agent())
    stream = await server.start()
    canceller = asyncio.ensure_future(server.cancel())
    ended = await stream.ended()
    canceller.cancel()
    return f"stream ends on {stream.last}" if ended else f"stream open after {stream.last}: {NO_ANSWER}"

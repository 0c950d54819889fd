import asyncio

from .prelude import Agent, Server


async def scenario() -> str:
    """Two cancels of one task at once; cancel() awaits I/O."""
    server = Server(Agent(cancel="io"))
    await server.start()
    return " and ".join(await asyncio.gather(server.cancel(), server.cancel()))

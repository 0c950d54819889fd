from .prelude import Agent, Server, settle


async def scenario() -> str:
    """Cancel a task mid-run, and once that has run its course, cancel it again."""
    server = Server(Agent())
    await server.start()
    first = await server.cancel()
    await settle()
    return f"{first}, then {await server.cancel()}"

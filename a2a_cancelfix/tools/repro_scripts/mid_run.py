from .prelude import Agent, Server, settle


async def scenario() -> str:
    """Cancel a task mid-run; cancel() is empty, as for an agent with nothing to stop."""
    server = Server(Agent())
    await server.start()
    returned = await server.cancel()
    await settle()
    return f"{returned} / {await server.stored()}"

from .prelude import Agent, Server, settle


async def scenario() -> str:
    """Cancel a task mid-run; cancel() raises."""
    server = Server(Agent(cancel="raise"))
    await server.start()
    returned = await server.cancel()
    await settle()
    return f"{returned} / {await server.stored()}"

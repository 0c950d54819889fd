from .prelude import Agent, Server, settle


async def scenario() -> str:
    """Cancel a task mid-run; cancel() publishes CANCELED."""
    server = Server(Agent(cancel="publish"))
    await server.start()
    returned = await server.cancel()
    await settle()
    return f"{returned} / {await server.stored()}"

from .prelude import Agent, Server, settle


async def scenario() -> str:
    """Cancel a task mid-run; cancel() never returns."""
    server = Server(Agent(cancel="hang"))
    await server.start()
    returned = await server.cancel()
    await settle()
    return f"{returned} / {await server.stored()}"

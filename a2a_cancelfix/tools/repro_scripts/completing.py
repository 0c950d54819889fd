from .prelude import Agent, Server, settle, within


async def scenario() -> str:
    """Cancel a task the store holds COMPLETED while its execute() is still returning."""
    server = Server(Agent(linger=True))
    await server.start()
    server.agent.release.set()
    await within(server.agent.completed.wait(), "execute() never completed")
    await server.saved("COMPLETED")
    returned = await server.cancel()
    server.agent.finish.set()
    await settle()
    return f"{returned} / {await server.stored()}"

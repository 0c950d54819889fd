from .prelude import Agent, Server, settle


async def scenario() -> str:
    """Cancel a task parked in INPUT_REQUIRED (its execute() has returned)."""
    server = Server(Agent(park=True))
    await server.start()
    returned = await server.cancel()
    called = "cancel() called" if server.agent.cancel_called.is_set() else "cancel() not called"
    await settle()
    return f"{returned} / {await server.stored()}, {called}"

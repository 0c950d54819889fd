from .prelude import Agent, Server, settle


async def scenario() -> str:
    """Another user (mallory) cancels alice's task."""
    server = Server(Agent())
    await server.start()
    returned = await server.cancel(user="mallory")
    await settle()
    run = "run killed" if server.agent.stopped.is_set() else "run untouched"
    return f"{returned}, owner sees {await server.stored()}, {run}"

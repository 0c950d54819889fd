from .prelude import Agent, Server


async def scenario() -> str:
    """Another user (mallory) subscribes to alice's task."""
    server = Server(Agent())
    await server.start()
    spy = server.subscribe("mallory")
    await spy.changes.until(lambda: spy.states or spy.task.done())
    spy.task.cancel()
    return f"got {spy.last}"

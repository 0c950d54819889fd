from .prelude import Agent, Server


async def scenario() -> str:
    """Cancel a task id nobody has."""
    return await Server(Agent()).cancel("no-such-task")

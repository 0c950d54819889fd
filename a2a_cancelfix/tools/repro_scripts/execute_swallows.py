from .prelude import Agent, Server


async def scenario() -> str:
    """Cancel a task whose execute() swallows CancelledError (as a broad `except` does)."""
    server = Server(Agent(swallow=True))
    try:
        await server.start()
        returned = await server.cancel()
        return f"{returned} / {await server.stored()}"
    finally:
        server.agent.release.set()

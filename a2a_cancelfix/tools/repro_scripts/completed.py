from a2a.types import SendMessageRequest

from .prelude import Agent, Server, as_user, message, outcome, settle


async def scenario() -> str:
    """Cancel a task that has completed."""
    server = Server(Agent())
    server.agent.release.set()
    await outcome(server.handler.on_message_send(SendMessageRequest(message=message()), as_user("alice")))
    await settle()
    return await server.cancel()

import asyncio

from .prelude import BOUND, NO_ANSWER, Agent, Server, settle, within


async def scenario() -> str:
    """The client that cancels goes away while cancel() awaits I/O."""
    server = Server(Agent(cancel="io"))
    await server.start()
    request = asyncio.ensure_future(server.cancel())
    await within(server.agent.cancel_called.wait(), "cancel() was never called")
    # The client goes away: a JSON-RPC server behind uvicorn lets the handler's call run on.
    await asyncio.wait({request}, timeout=BOUND)
    await asyncio.wait({asyncio.ensure_future(server.agent.stopped.wait())}, timeout=BOUND)
    if not server.agent.stopped.is_set():
        return f"run still going: {NO_ANSWER}"
    await settle()
    return f"task ends {await server.stored()}"

from .prelude import Agent, Server


async def scenario() -> str:
    """Cancel a task on a second handler sharing the store, with no run of it (another replica,
    or the same server after a restart)."""
    first = Server(Agent(park=True))
    await first.start()
    replica = Server(Agent(park=True), store=first.store)
    task_id = first.agent.task_id
    returned = await replica.cancel(task_id)
    return f"{returned} / {await replica.stored(task_id)}"

from a2a.types import TaskPushNotificationConfig

from .prelude import Agent, Server, as_user


async def scenario() -> str:
    """Cancel a task with two push configs: one given with the message, one added later."""
    server = Server(Agent())
    urls = {"a": "http://push.invalid/a", "b": "http://push.invalid/b"}
    await server.start(push_url=urls["a"])
    config = TaskPushNotificationConfig(task_id=server.agent.task_id, url=urls["b"], id="b")
    await server.handler.on_create_task_push_notification_config(config, as_user("alice"))
    await server.cancel()

    def last(url: str) -> str:
        return (server.push.received.get(url) or ["nothing"])[-1]

    await server.push.changes.until(lambda: all(last(url) == "CANCELED" for url in urls.values()))
    return ", ".join(f"{name} got {last(url)}" for name, url in urls.items())

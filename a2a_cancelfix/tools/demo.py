"""`a2a-cancelfix demo`: a real A2A server (JSON-RPC and REST) with our handler and an agent
that works in steps, so you can watch what each cancel does."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from a2a.helpers import new_task
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events.event_queue import EventQueue
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
    Message,
    Part,
    Role,
    TaskState,
)

from a2a_cancelfix import DefaultRequestHandler, cancellable, on_cancel, shielded

logger = logging.getLogger("a2a_cancelfix.demo")

STEPS = 5
STEP_SECONDS = 2.0
WRITE_SECONDS = 1.5


class DemoAgent(AgentExecutor):
    """Work five steps, write a report in a shielded section; ask for input if told "ask".

    Args:
        step_seconds, write_seconds: how long a step and the report take (by default, the
            module's ``STEP_SECONDS`` and ``WRITE_SECONDS``).
    """

    def __init__(self, step_seconds: float | None = None, write_seconds: float | None = None) -> None:
        self.step_seconds, self.write_seconds = step_seconds, write_seconds

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        task_id, context_id = context.task_id or "", context.context_id or ""
        updater = TaskUpdater(event_queue, task_id, context_id)
        if context.current_task is None:
            history = [context.message] if context.message else []
            await event_queue.enqueue_event(
                new_task(task_id, context_id, TaskState.TASK_STATE_SUBMITTED, history=history)
            )
        if "ask" in context.get_user_input().lower() and context.current_task is None:
            await updater.requires_input(_say("Which format do you want? (cancel me, or answer)"))
            logger.info("task %s parked for input", task_id)
            return
        on_cancel(lambda: logger.info("task %s: cancel arrived, aborting the current step", task_id))
        await updater.start_work()
        for step in range(1, STEPS + 1):
            await self.work(updater, step)
        await self.write_report(updater, task_id)
        await updater.complete(_say("Report ready."))

    @cancellable
    async def work(self, updater: TaskUpdater, step: int) -> None:
        await updater.update_status(TaskState.TASK_STATE_WORKING, _say(f"step {step}/{STEPS}"))
        await asyncio.sleep(self.step_seconds or STEP_SECONDS)  # Stands in for an LLM or tool call.

    async def write_report(self, updater: TaskUpdater, task_id: str) -> None:
        async with shielded():
            logger.info("task %s: writing the report (shielded)", task_id)
            await asyncio.sleep(self.write_seconds or WRITE_SECONDS)  # A write that must not be cut.
            logger.info("task %s: report written", task_id)

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        logger.info("task %s: DemoAgent.cancel() releases what it holds", context.task_id)


def _say(text: str) -> Message:
    return Message(role=Role.ROLE_AGENT, message_id=f"agent-{id(text)}", parts=[Part(text=text)])


def build_app(host: str, port: int):
    """The Starlette app: agent card, JSON-RPC at ``/``, REST under ``/rest``."""
    from a2a.server.routes import (
        create_agent_card_routes,
        create_jsonrpc_routes,
        create_rest_routes,
    )
    from starlette.applications import Starlette

    url = f"http://{host}:{port}"
    card = AgentCard(
        name="a2a-cancelfix demo",
        description="Works in steps with checkpoints; cancel it at any time.",
        version="1.0.0",
        capabilities=AgentCapabilities(streaming=True),
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        supported_interfaces=[
            AgentInterface(url=url, protocol_binding="JSONRPC", protocol_version="1.0"),
            AgentInterface(url=f"{url}/rest", protocol_binding="HTTP+JSON", protocol_version="1.0"),
        ],
        skills=[
            AgentSkill(
                id="report",
                name="Write a report",
                description="Works in five steps, then writes a report; say 'ask' to be asked first.",
                tags=["demo"],
            )
        ],
    )
    handler = DefaultRequestHandler(DemoAgent(), InMemoryTaskStore(), card, cancel_grace_period=3.0)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        aclose = getattr(handler, "aclose", None)  # The SDK's shutdown hook, 1.1.2+.
        if aclose is not None:
            await aclose()

    routes = [
        *create_agent_card_routes(card),
        *create_rest_routes(handler, path_prefix="/rest"),
        *create_jsonrpc_routes(handler, rpc_url="/"),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


def instructions(url: str) -> str:
    """Ready-to-paste commands for the demo server at ``url``."""
    message = '{"role":"ROLE_USER","messageId":"m-%s","parts":[{"text":"%s"}]}'
    rpc = (
        "curl -sN %s/ -H 'Content-Type: application/json' -H 'A2A-Version: 1.0' "
        '-d \'{"jsonrpc":"2.0","id":1,"method":"%s","params":{"message":%s%s}}\''
    )
    return "\n".join(
        [
            f"a2a-cancelfix demo: an A2A server at {url} (JSON-RPC at /, REST under /rest)",
            "",
            "Start a task and get its id at once:",
            "  "
            + rpc
            % (
                url,
                "SendMessage",
                message % (1, "write a report"),
                ',"configuration":{"returnImmediately":true}',
            ),
            "Start a task and stream it (the last event of a cancelled one is CANCELED):",
            "  " + rpc % (url, "SendStreamingMessage", message % (2, "write a report"), ""),
            "Start a task that parks for input:",
            "  " + rpc % (url, "SendMessage", message % (3, "ask me first"), ""),
            "Then, with TASK_ID from the answer:",
            f"  curl -sN {url}/rest/tasks/TASK_ID:subscribe -H 'A2A-Version: 1.0'     # subscribe",
            f"  curl -s -X POST {url}/rest/tasks/TASK_ID:cancel -H 'A2A-Version: 1.0'  # cancel",
            f"  curl -s {url}/rest/tasks/TASK_ID -H 'A2A-Version: 1.0'                 # get",
            "",
            "Each cancel logs one line (path, outcome, time). Ctrl-C stops the server.",
        ]
    )


def run(host: str, port: int) -> int:
    """Serve the demo until Ctrl-C."""
    try:
        import sse_starlette  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as missing:
        print(
            f"The demo needs {missing.name}: pip install 'a2a-cancelfix[demo]'",
        )
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("a2a").setLevel(logging.WARNING)
    print(instructions(f"http://{host}:{port}"), flush=True)
    uvicorn.run(build_app(host, port), host=host, port=port, log_level="warning")
    return 0

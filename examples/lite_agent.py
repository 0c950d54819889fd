"""An a2a-lite agent whose task skill calls a fake model: no network, no key.

From this folder, ``a2a-cancelfix sweep lite_agent:executor`` sweeps the executor a2a-lite's
own server runs. a2a-lite (1.2.1) reports any ``CancelledError`` in a run as a shutdown and
publishes FAILED after the cancel: the sweep names it on each row where the cancel reaches
the run, and under our handler every observer still sees CANCELED (docs/frameworks.md).
"""

from __future__ import annotations

import asyncio

from a2a.server.agent_execution import AgentExecutor
from a2a_lite import Agent

agent = Agent(name="Researcher", description="Looks a topic up, then answers.")


async def fake_model(prompt: str) -> str:
    await asyncio.sleep(0.001)  # Stands in for the model's round trip.
    return f"notes on {prompt}"


@agent.skill("research", tags=["research"], task=True)
async def research(message: str) -> str:
    notes = await fake_model(message)
    return await fake_model(notes)


def executor(of: Agent = agent) -> AgentExecutor:
    """What a2a-lite's server runs for agent ``of``: the executor of the handler it builds (its
    ``_build_request_handler``, private in a2a-lite 1.2.1, is what ``agent.run()`` serves)."""
    handler = of._build_request_handler(of.build_agent_card())
    return handler.agent_executor

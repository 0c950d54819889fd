"""An ADK agent behind ADK's own A2A executor, with a scripted model: no network, no key.

From this folder, ``a2a-cancelfix sweep adk_agent:executor`` sweeps ADK's ``A2aAgentExecutor``
as it is, ``a2a-cancelfix sweep adk_agent:wrapped`` what ``to_a2a(agent(),
agent_executor_factory=factory)`` serves.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from google.adk.a2a.executor.a2a_agent_executor import A2aAgentExecutor
from google.adk.agents import LlmAgent
from google.adk.models import BaseLlm, LlmRequest, LlmResponse
from google.adk.runners import InMemoryRunner, Runner
from google.genai import types

from a2a_cancelfix import CancellableExecutor


class ScriptedModel(BaseLlm):
    """Stands in for Gemini: asks for the weather tool once, then answers with what it said."""

    model: str = "scripted"

    async def generate_content_async(
        self, llm_request: LlmRequest, stream: bool = False
    ) -> AsyncGenerator[LlmResponse, None]:
        await asyncio.sleep(0.001)  # Stands in for the model's latency.
        last = llm_request.contents[-1].parts[0] if llm_request.contents else None
        if last is not None and last.function_response is not None:
            answer = types.Part(text=f"It is {last.function_response.response['result']}.")
        else:
            answer = types.Part(function_call=types.FunctionCall(name="weather", args={"city": "Paris"}))
        yield LlmResponse(content=types.Content(role="model", parts=[answer]))


async def weather(city: str) -> str:
    """The weather in ``city``."""
    await asyncio.sleep(0.001)  # Stands in for the weather service.
    return "sunny"


def agent() -> LlmAgent:
    return LlmAgent(name="weather_agent", model=ScriptedModel(), tools=[weather])


def executor() -> A2aAgentExecutor:
    """ADK's executor for the agent: what `to_a2a(agent())` serves."""
    return A2aAgentExecutor(runner=InMemoryRunner(agent(), app_name="weather"))


def factory(runner: Runner) -> Any:
    """For ``to_a2a(agent(), agent_executor_factory=factory)``: ADK's executor, wrapped."""
    return CancellableExecutor(A2aAgentExecutor(runner=runner))


def wrapped() -> Any:
    """What ``to_a2a(agent(), agent_executor_factory=factory)`` serves, to sweep."""
    return factory(InMemoryRunner(agent(), app_name="weather"))

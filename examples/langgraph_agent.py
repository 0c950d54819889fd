"""A LangGraph ReAct agent behind a2a-adapter, with a fake chat model: no network, no key.

From this folder, ``a2a-cancelfix sweep langgraph_agent:executor`` sweeps it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from a2a_adapter import LangGraphAdapter
from a2a_adapter.executor import AdapterAgentExecutor
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langgraph.prebuilt import create_react_agent


class ScriptedModel(GenericFakeChatModel):
    """Stands in for a chat model: asks for the weather tool once, then answers."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> ScriptedModel:
        return self


@tool
async def weather(city: str) -> str:
    """The weather in ``city``."""
    await asyncio.sleep(0.001)  # Stands in for the weather service.
    return "sunny"


def graph() -> Any:
    replies = iter(
        [
            AIMessage("", tool_calls=[{"name": "weather", "args": {"city": "Paris"}, "id": "call-1"}]),
            AIMessage("It is sunny."),
        ]
    )
    return create_react_agent(ScriptedModel(messages=replies), [weather])


def executor() -> AdapterAgentExecutor:
    """a2a-adapter's executor for the graph: what its `to_a2a(LangGraphAdapter(graph))` serves."""
    return AdapterAgentExecutor(LangGraphAdapter(graph=graph()))

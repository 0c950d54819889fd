"""Real frameworks' executors, with fake models, swept: every row holds (issue 26).

Run by `nox -s frameworks`, which installs google-adk, a2a-adapter, LangGraph and (with
a2a-sdk 1.2.2+) a2a-lite at pinned versions; skipped where they are not installed (the main
matrix).
"""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import pytest
from a2a.types import SendMessageRequest

from a2a_cancelfix.testing import Stream, cancel, make_server, message, state_of, stored, sweep, within

from .support import told

EXAMPLES = Path(__file__).parent.parent / "examples"
PAGE = (Path(__file__).parent.parent / "docs" / "frameworks.md").read_text()
GRACE = 0.2

# ADK marks its A2A support experimental, with a warning at each use.
pytestmark = pytest.mark.filterwarnings("ignore:.*EXPERIMENTAL.*:UserWarning")


@pytest.fixture(autouse=True)
def examples(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))


@pytest.mark.asyncio
@pytest.mark.parametrize("factory", ["executor", "wrapped"])
async def test_an_adk_agent_sweeps_clean(factory: str) -> None:
    """ADK's A2aAgentExecutor as it is, and as to_a2a's agent_executor_factory wraps it."""
    pytest.importorskip("google.adk")
    import adk_agent

    report = await sweep(getattr(adk_agent, factory), grace_period=GRACE)
    assert report.ok, told(report)
    kinds = {row.point.kind for row in report.rows[1:] if row.point}
    assert {"publish", "published", "ended"} <= kinds
    rows, folded = documented(r"google-adk 2\.13\.0: (\d+) rows,\s+and (\d+) more")
    assert (len(report.rows), report.folded) == (rows, folded)  # What docs/frameworks.md says.


def documented(pattern: str) -> tuple[int, ...]:
    """The numbers docs/frameworks.md gives where ``pattern`` matches."""
    found = re.search(pattern, PAGE)
    assert found, pattern
    return tuple(int(number) for number in found.groups())


@pytest.mark.asyncio
async def test_a_langgraph_agent_behind_a2a_adapter_sweeps_clean() -> None:
    pytest.importorskip("a2a_adapter")
    pytest.importorskip("langgraph")
    import langgraph_agent

    report = await sweep(langgraph_agent.executor, grace_period=GRACE)
    assert report.ok, told(report)
    assert (len(report.rows),) == documented(r"LangGraph 1\.2\.24: (\d+) rows")


@pytest.mark.asyncio
async def test_the_kit_names_what_a2a_lite_publishes_after_a_cancel() -> None:
    """a2a-lite's runtime reports any CancelledError as a shutdown, publishing FAILED after
    the cancel: each row where the cancel reaches the run fails on exactly that, while every
    observer still sees CANCELED under our handler."""
    pytest.importorskip("a2a_lite", reason="a2a-lite needs a2a-sdk 1.2.2 or newer")
    import lite_agent

    report = await sweep(lite_agent.executor, grace_period=GRACE)
    assert report.rows[0].ok  # Uncancelled, it completes.
    assert report.failures, told(report)
    assert (len(report.failures), len(report.rows)) == documented(r"fails (\d+) of\s+its (\d+) rows")
    named = "publishing FAILED after it had seen the cancel"
    observers = ("store", "stream", "subscriber", "push")
    for row in report.failures:
        assert row.failures and all(named in failure for failure in row.failures), row
        assert {row.seen[observer] for observer in observers} == {"CANCELED"}, row
        assert row.answer in ("CANCELED", "client left"), row


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["stock", "ours"])
async def test_an_a2a_lite_task_cancelled_mid_model_call(kind: str) -> None:
    """Cancelled while its skill waits for the model: stock answers CANCELED, then a2a-lite's
    FAILED ("interrupted by shutdown") lands after it, in the store and at the end of the
    stream; ours keeps CANCELED everywhere."""
    pytest.importorskip("a2a_lite", reason="a2a-lite needs a2a-sdk 1.2.2 or newer")
    import lite_agent
    from a2a_lite import Agent

    agent = Agent(name="Slow", description="Waits for its model.")
    thinking = asyncio.Event()

    @agent.skill("think", tags=["think"], task=True)
    async def think(message: str) -> str:
        thinking.set()
        await asyncio.Event().wait()  # A model that takes its time: the cancel lands here.
        return message  # pragma: no cover

    server = make_server(kind, lite_agent.executor(agent))
    stream = Stream(server.calls.send_stream(SendMessageRequest(message=message()), "alice"))
    await within(thinking.wait())
    await stream.until(lambda: stream.last == "WORKING")
    task_id = stream.events[0].id
    assert await within(cancel(server, task_id)) == "CANCELED"
    assert await stream.ended()
    states = [state for event in stream.events if (state := state_of(event))]
    if kind == "stock":
        assert states[-2:] == ["CANCELED", "FAILED"]
        assert await stored(server, task_id) == "FAILED"
        return
    assert states[-1] == "CANCELED" and "FAILED" not in states
    assert await stored(server, task_id) == "CANCELED"


def teardown_module() -> None:
    for name in ("adk_agent", "langgraph_agent", "lite_agent"):
        sys.modules.pop(name, None)


@pytest.mark.asyncio
async def test_an_adk_server_under_patch_cancels_as_ours_over_json_rpc() -> None:
    """google-adk's ``to_a2a`` builds the SDK's handler itself, at startup; after ``patch()``
    that handler is ours, and a cancel mid-run over JSON-RPC answers CANCELED once the model
    call was interrupted, the sender's stream ending on CANCELED."""
    pytest.importorskip("google.adk")
    import asyncio
    import gc

    import adk_agent
    from a2a.server.request_handlers import DefaultRequestHandlerV2
    from a2a.types import CancelTaskRequest, SendMessageRequest, TaskState
    from google.adk.a2a.utils.agent_to_a2a import to_a2a
    from google.adk.agents import LlmAgent

    import a2a_cancelfix
    from a2a_cancelfix.testing import Stream, _wire, message, within
    from a2a_cancelfix.testing.servers import _payload

    thinking, interrupted = asyncio.Event(), asyncio.Event()

    class SlowModel(adk_agent.ScriptedModel):
        async def generate_content_async(self, llm_request, stream=False):  # type: ignore[override]
            thinking.set()
            try:
                await asyncio.Event().wait()  # A model that takes its time: the cancel lands here.
            except asyncio.CancelledError:
                interrupted.set()
                raise
            yield  # pragma: no cover

    async def payloads(responses):
        async for response in responses:
            yield _payload(response)

    a2a_cancelfix.patch(cancel_grace_period=GRACE)
    try:
        listener = _wire.free_socket()
        port = listener.getsockname()[1]
        app = to_a2a(LlmAgent(name="slow", model=SlowModel()), host="127.0.0.1", port=port)
        # The app builds its handler (ours, now) at startup, in its lifespan.
        async with app.router.lifespan_context(app), _wire.uvicorn_serving(app, listener):
            built = [each for each in gc.get_objects() if isinstance(each, DefaultRequestHandlerV2)]
            assert built and all("_lifecycle" in each.__dict__ for each in built)  # ADK's handler is ours.
            endpoint = _wire.Endpoint("jsonrpc", f"http://127.0.0.1:{port}/", frozenset, asyncio.Event())
            async with _wire.connect(endpoint) as client, _wire.connect(endpoint) as canceller:
                sent = Stream(payloads(client.send_message(SendMessageRequest(message=message()))))
                await within(thinking.wait())
                await sent.until(lambda: sent.last == "WORKING")
                task_id = sent.events[0].id if hasattr(sent.events[0], "id") else sent.events[0].task_id
                answer = await within(canceller.cancel_task(CancelTaskRequest(id=task_id)), 5.0)
                assert interrupted.is_set()  # The work stopped before the answer.
                assert answer.status.state == TaskState.TASK_STATE_CANCELED
                assert await sent.ended() and sent.last == "CANCELED"
    finally:
        a2a_cancelfix.unpatch()

"""`patch()`: handlers that someone else builds, of the SDK's class or a subclass of it, get ours."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from a2a.server.request_handlers import DefaultRequestHandlerV2
from a2a.server.tasks import DatabaseTaskStore, InMemoryTaskStore
from a2a.types import SendMessageRequest, UnsupportedOperationError
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

import a2a_cancelfix
from a2a_cancelfix import FinalStateTaskStore, _sdk
from a2a_cancelfix import _handler as handler_module
from a2a_cancelfix._cancel.settings import DEFAULT_GRACE_PERIOD, Timing
from a2a_cancelfix.testing import (
    ScriptedExecutor,
    Server,
    _wire,
    cancel,
    make_server,
    message,
    start,
    stored,
    within,
)
from a2a_cancelfix.testing.servers import GRACE, OverTheWire
from a2a_cancelfix.testing.waits import eventually
from a2a_cancelfix.tools.scenarios import SCENARIOS, UNWATCHED_AFTER, Scenario, run_scenario

ids = [scenario.name for scenario in SCENARIOS]


class FrameworkHandler(DefaultRequestHandlerV2):
    """A subclass a framework defines at import, before anyone could patch (as a2a-lite does)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.framework = True


@pytest.fixture
def patched() -> Iterator[None]:
    a2a_cancelfix.patch(cancel_grace_period=GRACE)
    try:
        yield
    finally:
        a2a_cancelfix.unpatch()


def served(handler: DefaultRequestHandlerV2, executor: ScriptedExecutor) -> Server:
    """A server of the testing kit around a handler built by someone else."""
    server = make_server("stock", executor)
    return Server(handler, executor, handler.task_store, server.push, type(server.calls)(handler))


async def stream_after_cancel(server: Server) -> str:
    """Cancel mid-run, with an empty ``cancel()``: how the sender's stream ends (stock: WORKING)."""
    stream = await start(server)
    await within(cancel(server, server.executor.task_id))
    assert await stream.ended()
    return stream.last


def arguments(executor: ScriptedExecutor, *, told: bool = False) -> dict:
    """A handler's arguments; ``told``: its store tells the kit of its saves (the SDK's own
    handler does not guard its store, so it is given a guarded one: nothing here saves over
    an ended task, the only save a guard refuses)."""
    card = make_server("stock", executor).handler._agent_card
    store = FinalStateTaskStore(InMemoryTaskStore()) if told else InMemoryTaskStore()
    return {"agent_executor": executor, "task_store": store, "agent_card": card}


@pytest.mark.asyncio
async def test_a_subclass_defined_before_patch_gets_ours(patched: None) -> None:
    """A framework's subclass of the SDK's handler, defined at import (as a2a-lite's is), cancels
    as ours does over JSON-RPC: the sender's stream ends on CANCELED (stock's, on WORKING)."""
    executor = ScriptedExecutor()
    handler = FrameworkHandler(**arguments(executor))
    assert handler.framework and handler.cancel_grace_period == GRACE
    server = served(handler, executor)
    async with _wire.serve(handler, "jsonrpc") as endpoint:
        server = dataclasses.replace(server, calls=OverTheWire(handler, endpoint))
        assert await stream_after_cancel(server) == "CANCELED"


@pytest.mark.asyncio
async def test_a_handler_a_helper_module_builds_gets_ours(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module that imported the SDK's class by name before patch() builds ours after it."""
    (tmp_path / "builds_handlers.py").write_text(
        "from a2a.server.request_handlers import DefaultRequestHandler\n\n"
        "def build(**arguments):\n"
        "    return DefaultRequestHandler(**arguments)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import builds_handlers  # type: ignore[import-not-found]

    a2a_cancelfix.patch(cancel_grace_period=GRACE)
    try:
        executor = ScriptedExecutor()
        handler = builds_handlers.build(**arguments(executor))
        assert await stream_after_cancel(served(handler, executor)) == "CANCELED"
    finally:
        a2a_cancelfix.unpatch()
        sys.modules.pop("builds_handlers")


@pytest.mark.asyncio
async def test_unpatch_restores_the_sdks_own_handler() -> None:
    """After unpatch(), the SDK's class builds its own handlers again: their stream ends on
    WORKING, and they have an ``aclose`` where the SDK's class has one (1.1.2 on)."""
    init = DefaultRequestHandlerV2.__init__
    a2a_cancelfix.patch(cancel_grace_period=GRACE)
    a2a_cancelfix.unpatch()
    assert DefaultRequestHandlerV2.__init__ is init
    executor = ScriptedExecutor()
    handler = DefaultRequestHandlerV2(**arguments(executor, told=True))
    assert not hasattr(handler, "cancel_grace_period")
    assert hasattr(handler, "aclose") == (handler_module._sdk_close is not None)
    assert await stream_after_cancel(served(handler, executor)) == "WORKING"


@pytest.mark.asyncio
async def test_handlers_built_under_patch_stay_ours_after_unpatch() -> None:
    """Two handlers a framework built under patch(), then unpatch(): they keep our behaviour
    and options. The owner's cancel answers CANCELED, the store keeps it, a second cancel
    returns it (``on_canceled="return"``); a stranger's cancel is TaskNotFound and leaves the
    owner's run running. (The SDK's methods, put back under them, answered WORKING and kept it
    up to 1.1.3 and let the stranger's cancel stop the run; a second cancel raised
    TaskNotCancelable on every release.)"""
    owners, strangers = ScriptedExecutor(), ScriptedExecutor()
    a2a_cancelfix.patch(cancel_grace_period=GRACE, on_canceled="return")
    try:
        first = served(DefaultRequestHandlerV2(**arguments(owners, told=True)), owners)
        second = served(DefaultRequestHandlerV2(**arguments(strangers, told=True)), strangers)
    finally:
        a2a_cancelfix.unpatch()
    stream = await start(first)
    await start(second)
    assert await within(cancel(first, owners.task_id or "")) == "CANCELED"
    assert await within(stored(first, owners.task_id or "")) == "CANCELED"
    assert await within(stream.ended()) and stream.last == "CANCELED"
    assert await within(cancel(first, owners.task_id or "")) == "CANCELED"
    assert await within(cancel(second, strangers.task_id or "", owner="mallory")) == "TaskNotFound"
    assert not strangers.stopped.is_set() and not strangers.cancel_called.is_set()
    strangers.step.open()
    assert await within(strangers.completed.wait())

    async def completed() -> bool:
        return await stored(second, strangers.task_id or "") == "COMPLETED"

    # The SDK's consumer saves COMPLETED after execute() enqueued it, not before enqueue_event
    # returns: on Python 3.13 its queue (asyncio.Queue, culsans before) hands the event over
    # without yielding, so the run can end a few loop turns before the save, under stock too.
    await eventually(completed)


@pytest.mark.asyncio
async def test_a_handler_built_before_patch_keeps_the_sdks_behaviour() -> None:
    """patch() changes the handlers built after it: one built before stays the SDK's, unbroken."""
    executor = ScriptedExecutor()
    before = DefaultRequestHandlerV2(**arguments(executor, told=True))
    a2a_cancelfix.patch(cancel_grace_period=GRACE)
    try:
        assert await stream_after_cancel(served(before, executor)) == "WORKING"
    finally:
        a2a_cancelfix.unpatch()


def test_patch_is_idempotent_checks_its_options_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    """Twice with the same options is once, logged once with the SDK's release; bad options fail
    at the call; unpatch twice is fine."""
    sdk_init = DefaultRequestHandlerV2.__init__
    with pytest.raises(ValueError, match="cancel_grace_period"):
        a2a_cancelfix.patch(cancel_grace_period=0)
    with pytest.raises(TypeError, match="grace"):
        a2a_cancelfix.patch(grace=1.0)
    assert DefaultRequestHandlerV2.__init__ is sdk_init
    with caplog.at_level(logging.INFO, logger="a2a_cancelfix"):
        a2a_cancelfix.patch()
        init = DefaultRequestHandlerV2.__init__
        a2a_cancelfix.patch()
        a2a_cancelfix.patch(cancel_grace_period=DEFAULT_GRACE_PERIOD)  # The same options, spelt out.
        assert DefaultRequestHandlerV2.__init__ is init
        a2a_cancelfix.unpatch()
        a2a_cancelfix.unpatch()
    patched = [r.getMessage() for r in caplog.records if r.getMessage().startswith("a2a_cancelfix patched")]
    assert len(patched) == 1 and _sdk.SDK_VERSION in patched[0]


def test_patch_takes_the_handlers_options_and_checks_them_at_the_call() -> None:
    """Every keyword option of the handler, each named in patch()'s docstring, checked at the
    call as the handler checks it. ``timing``, which the settings have but the handler does not
    take, is refused at the call: it passed, and failed at the first handler a framework built."""
    sdk_init = DefaultRequestHandlerV2.__init__
    with pytest.raises(TypeError, match="timing"):
        a2a_cancelfix.patch(timing=Timing())
    with pytest.raises(ValueError, match="lease_time"):
        a2a_cancelfix.patch(lease_time=30, cancel_grace_period=20.0)
    assert DefaultRequestHandlerV2.__init__ is sdk_init
    keywords = [
        parameter.name
        for parameter in inspect.signature(a2a_cancelfix.DefaultRequestHandler.__init__).parameters.values()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    assert [name for name in keywords if f"``{name}``" not in (a2a_cancelfix.patch.__doc__ or "")] == []
    a2a_cancelfix.patch(lease_time=60.0, sole_replica=False)
    try:
        assert DefaultRequestHandlerV2(**arguments(ScriptedExecutor()))._lifecycle.settings.lease_time == 60.0
    finally:
        a2a_cancelfix.unpatch()


def test_patch_with_other_options_while_patched_is_refused() -> None:
    """A second patch() with other options raises, naming both, and changes nothing: it was
    ignored, so a handler built after it silently had the first call's options."""
    a2a_cancelfix.patch()
    try:
        with pytest.raises(RuntimeError, match=r"unpatch\(\).*cancel_grace_period"):
            a2a_cancelfix.patch(cancel_grace_period=2.0)
        handler = DefaultRequestHandlerV2(**arguments(ScriptedExecutor()))
        assert handler.cancel_grace_period == DEFAULT_GRACE_PERIOD
    finally:
        a2a_cancelfix.unpatch()
    a2a_cancelfix.patch(cancel_grace_period=2.0)  # After unpatch(), as the error says.
    try:
        assert DefaultRequestHandlerV2(**arguments(ScriptedExecutor())).cancel_grace_period == 2.0
    finally:
        a2a_cancelfix.unpatch()


def test_an_unknown_sdk_is_left_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the SDK's internals are not found, patch() warns once and changes nothing."""
    monkeypatch.setattr(_sdk, "SUPPORTED", False)
    monkeypatch.setattr(_sdk, "MISSING", ["ActiveTask._is_finished"])
    init = DefaultRequestHandlerV2.__init__
    with pytest.warns(RuntimeWarning, match="untouched"):
        a2a_cancelfix.patch()
    assert DefaultRequestHandlerV2.__init__ is init
    a2a_cancelfix.unpatch()


@pytest.mark.parametrize("scenario", SCENARIOS, ids=ids)
def test_the_sdks_own_handler_holds_the_contract_under_patch(scenario: Scenario, patched: None) -> None:
    """Every scenario, run on the SDK's own handler class over the wire, ends as ours does (one
    that shows an option, patched with it)."""
    if scenario.opt_in:
        a2a_cancelfix.unpatch()
        a2a_cancelfix.patch(cancel_grace_period=GRACE, **{scenario.opt_in: UNWATCHED_AFTER})
    assert run_scenario(scenario, "stock") == scenario.expected


@pytest.mark.parametrize("streamed", [False, True], ids=["blocking", "streaming"])
@pytest.mark.asyncio
async def test_a_message_to_an_ended_task_is_refused_under_patch(patched: None, streamed: bool) -> None:
    """The SDK's class runs our overrides under patch(), and they call only what patch() puts
    there: a message to a task that has completed is refused with UnsupportedOperationError,
    as ours refuses it (they called a method of our class alone: AttributeError)."""
    executor = ScriptedExecutor()
    server = served(DefaultRequestHandlerV2(**arguments(executor)), executor)
    first = await start(server)
    executor.step.open()
    assert await within(first.ended()) and first.last == "COMPLETED"
    request = SendMessageRequest(message=message("and then?", executor.task_id or ""))

    async def send() -> None:
        if streamed:
            async for _event in server.calls.send_stream(request, "alice"):
                pass
        else:
            await server.calls.send(request, "alice")

    with pytest.raises(UnsupportedOperationError):
        await within(send())


def test_patch_puts_every_method_our_handler_overrides() -> None:
    """Each request method our handler overrides (the push config deletion, which starts the
    unwatched clock, among them) is what a patched SDK handler runs too."""
    from a2a_cancelfix import _patching as patching

    ours = handler_module.DefaultRequestHandler.__dict__
    overridden = {
        name for name in ours if (name.startswith("on_") or name == "aclose") and callable(ours[name])
    }
    assert overridden == set(patching._METHODS)


@pytest.mark.parametrize("streamed", [False, True], ids=["blocking", "streaming"])
@pytest.mark.asyncio
async def test_a_handler_built_under_patch_over_a_database_store_leases_its_runs(
    patched: None, streamed: bool, tmp_path: Path
) -> None:
    """Under patch() the SDK's class, over a database store, begins its lease at its first
    request and serves it (it called a method of our class alone: AttributeError, an
    InternalError to the client): a run streamed is leased, read and cancelled; a blocking
    one completes."""
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'tasks.db'}")
    executor = ScriptedExecutor()
    handler = DefaultRequestHandlerV2(**{**arguments(executor), "task_store": DatabaseTaskStore(engine)})
    server = served(handler, executor)
    try:
        if not streamed:
            executor.step.open()
            sent = await within(server.calls.send(SendMessageRequest(message=message("go")), "alice"))
            assert _sdk.state_name(sent.status.state) == "COMPLETED"
            return
        stream = await start(server)
        task_id = executor.task_id or ""
        async with engine.connect() as connection:
            leased = (await connection.execute(text("SELECT task_id FROM a2a_cancelfix_runs"))).scalars()
            assert leased.all() == [task_id]
        assert (await within(server.calls.get(task_id, "alice"))).id == task_id
        assert await cancel(server, task_id) == "CANCELED"
        assert await within(stream.ended()) and stream.last == "CANCELED"
    finally:
        await within(handler.aclose())
        await engine.dispose()

"""A task store of the user's own (docs/stores.md), stock beside ours: what holds with its
``save_unless_final`` (everything the guard promises, across replicas), what holds without it
(within one process), and the one line our handler logs at construction.

Two such stores (tests/own_stores.py): one over a dict, one on SQLAlchemy with a schema of its
own, on SQLite and PostgreSQL; each with its compare-and-set save ("cas") and without ("plain").
Replicas are handlers each given a store object of its own over one backend (one dict, one
database), as processes would be.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from a2a.server.request_handlers import DefaultRequestHandlerV2
from a2a.types import AgentCard, Task, TaskState, TaskStatus

from a2a_cancelfix import DefaultRequestHandler, FinalStateTaskStore, _sdk
from a2a_cancelfix.testing import (
    ScriptedExecutor,
    caller,
    cancel,
    make_server,
    start,
    stored,
    wait_all_tasks_blocked,
    within,
)
from a2a_cancelfix.testing.waits import eventually

from . import expected
from .own_stores import CasDictStore, CasSqlStore, DictStore, SqlStore
from .test_docs import blocks
from .test_replicas import PollingExecutor
from .test_store import open_database

COMPLETED = TaskState.TASK_STATE_COMPLETED
CANCELED = TaskState.TASK_STATE_CANCELED
WORKING = TaskState.TASK_STATE_WORKING


@dataclass
class Backend:
    """One backend of a store of one's own; ``replica()`` is a replica's store object over it."""

    where: str
    cas: bool
    replica: Callable[[], Any]


@contextlib.asynccontextmanager
async def backend(where: str, cas: bool, tmp_path: Path) -> AsyncIterator[Backend]:
    if where == "dict":
        shared: dict[tuple[str, str], bytes] = {}
        kind = CasDictStore if cas else DictStore
        yield Backend(where, cas, lambda: kind(shared))
        return
    async with open_database(where, tmp_path) as database:
        sql = CasSqlStore if cas else SqlStore
        await sql(database.engine()).create()
        yield Backend(where, cas, lambda: sql(database.engine()))


BACKENDS = [
    pytest.param((where, cas), id=f"{where}-{'cas' if cas else 'plain'}")
    for where in ("dict", "sqlite", "postgresql")
    for cas in (True, False)
]


@pytest_asyncio.fixture(params=BACKENDS)
async def own(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    where, cas = request.param
    async with backend(where, cas, tmp_path) as opened:
        yield opened


async def outcome_within(call: Any, seconds: float = 1.0) -> str:
    """The call's outcome, or HANG if it has none within ``seconds`` (stock's, before 1.2)."""
    try:
        return str(await asyncio.wait_for(call, seconds))
    except TimeoutError:
        return "HANG"


async def closed(*servers: Any) -> None:
    for server in servers:
        server.executor.step.open()
        server.executor.released.set()
        aclose = getattr(server.handler, "aclose", None)
        if aclose is not None:
            await within(aclose())


CARD = AgentCard(name="own", description="a store of one's own", version="1")
WITHOUT = (
    "task store {name} has no save_unless_final(task, context): a task's end is final within this "
    "process only, a save from another replica can overwrite it{leases}. Implement save_unless_final "
    "to guard it across replicas (docs/stores.md)"
)
WITH = "task store {name} is guarded through its save_unless_final{leases} (docs/stores.md)"
LEASES = (
    "; leases are off (they need the SDK's DatabaseTaskStore): the tasks of a replica that dies "
    "stay as stored"
)


@pytest.mark.asyncio
@pytest.mark.parametrize("store", [DictStore, CasDictStore, "sql", "cas-sql"])
@pytest.mark.parametrize(
    "options", [{}, {"lease_time": None}, {"sole_replica": True}], ids=["default", "no leases", "sole"]
)
async def test_the_handler_serves_it_and_says_what_is_off_in_one_line(
    store: Any, options: dict[str, Any], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """Ours and stock both take the store without raising; ours logs one line at construction
    naming what is off (a WARNING without save_unless_final: the guard across replicas; leases
    unless turned off), or, with it and leases off, nothing."""
    async with contextlib.AsyncExitStack() as stack:
        if isinstance(store, str):
            opened = await stack.enter_async_context(backend("sqlite", store == "cas-sql", tmp_path))
            given = opened.replica()
        else:
            given = store()
        cas = hasattr(given, "save_unless_final")
        stock = DefaultRequestHandlerV2(ScriptedExecutor(), given, CARD)
        with caplog.at_level(logging.DEBUG, logger="a2a_cancelfix"):
            ours = DefaultRequestHandler(ScriptedExecutor(), given, CARD, **options)
        lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "a2a_cancelfix"]
        leases = "" if options.get("lease_time", 30) is None else LEASES
        if options.get("sole_replica"):
            leases += ", and sole_replica ends none at start"
        said = (WITH if cas else WITHOUT).format(name=type(given).__name__, leases=leases)
        if cas and not leases:
            assert lines == []
        else:
            assert lines == [(logging.INFO if cas else logging.WARNING, said)]
        assert isinstance(ours.task_store, FinalStateTaskStore) and ours.task_store.wrapped is given
        assert ours._lifecycle.leases is None
        await within(ours.aclose())
        if hasattr(stock, "aclose"):
            await within(stock.aclose())


def test_the_docs_show_the_line_as_it_is_logged() -> None:
    """docs/stores.md's example of the line is the one a store without the method gets."""
    (shown,) = [block for block in blocks("text") if block.page.name == "stores.md"]
    assert shown.code == WITHOUT.format(name="MyTaskStore", leases=LEASES) + "\n"


@pytest.mark.asyncio
async def test_final_state_task_store_guards_through_the_method_or_says_which_to_implement(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``FinalStateTaskStore(store)``: through ``save_unless_final``, a save over an end is
    refused, logged and told as the SDK stores' are; a store without it is a TypeError naming
    the method; one that breaks its contract is told so."""
    with pytest.raises(
        TypeError, match=r"DictStore has none.*save_unless_final|save_unless_final.*DictStore"
    ):
        FinalStateTaskStore(DictStore())
    store = CasDictStore()
    guard = FinalStateTaskStore(store)
    refused: list[str] = []
    guard.subscribe(refused=lambda task_id, context: refused.append(task_id))
    alice = caller("alice")
    with caplog.at_level(logging.DEBUG, logger="a2a_cancelfix"):
        await guard.save(Task(id="t", context_id="c", status=TaskStatus(state=CANCELED)), alice)
        await guard.save(Task(id="t", context_id="c", status=TaskStatus(state=COMPLETED)), alice)
    assert (await guard.get("t", alice)).status.state == CANCELED
    assert refused == ["t"] and store.saves == 2
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused save")] == [
        "refused save task=t stored=TASK_STATE_CANCELED refused=TASK_STATE_COMPLETED: a terminal state is final"
    ]

    class Broken(CasDictStore):
        async def save_unless_final(self, task: Task, context: Any) -> int | None:
            return WORKING

    with pytest.raises(TypeError, match=f"returned {WORKING} for task t"):
        await FinalStateTaskStore(Broken()).save(Task(id="t", status=TaskStatus(state=WORKING)), alice)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["stock", "ours"])
async def test_a_mid_run_cancel_ends_canceled_in_the_store_as_answered(kind: str, own: Backend) -> None:
    """A mid-run cancel, the executor's cancel() empty. Ours: answered CANCELED, the store holds
    CANCELED, the sender's stream ends on it, the run stopped; with or without the method.
    Stock on the same store: as on its own stores (WORKING / WORKING before 1.1.4), and its
    stream never shows CANCELED."""
    server = make_server(kind, ScriptedExecutor(), store=own.replica())
    stream = await start(server)
    task_id = server.executor.task_id or ""
    answered = await within(cancel(server, task_id))
    held = await within(stored(server, task_id))
    if kind == "stock":
        assert f"{answered} / {held}" == expected.STOCK["mid-run, cancel() empty"][expected.column()]
        await closed(server)
        return
    assert answered == held == "CANCELED"
    assert await within(stream.ended()) and stream.last == "CANCELED"
    assert server.executor.stopped.is_set() and server.executor.cancel_called.is_set()
    assert not server.executor.completed.is_set()
    await closed(server)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["stock", "ours"])
async def test_a_late_completion_after_another_replicas_cancel(kind: str, own: Backend) -> None:
    """Replica A's COMPLETED is on its way to the store (its slow write held) when replica B
    records CANCELED; then A's write goes on. With save_unless_final, ours refuses it: the store
    keeps CANCELED, as B answered, and A's stream ends on it. Without it (the limit the log line
    names), A's write lands over B's: the store says COMPLETED where B answered CANCELED. Stock
    lands it either way (it never calls the method)."""
    mine = own.replica()
    options = {"replica_poll_interval": 3600} if kind == "ours" else {}
    a = make_server(kind, ScriptedExecutor(), store=mine, **options)
    b = make_server(kind, ScriptedExecutor(), store=own.replica(), **options)
    sent = await start(a)
    task_id = a.executor.task_id or ""
    held = mine.hold(COMPLETED)
    a.executor.step.open()  # A completes; its write waits on its way to the store.
    await within(held.reached.wait())
    answered = await outcome_within(cancel(b, task_id))
    held.open()
    await within(a.executor.stopped.wait())
    await within(sent.ended())
    now = await within(stored(b, task_id))
    if kind == "stock":
        assert answered == ("CANCELED" if _sdk.SDK_CANCELS_WHERE_NOT_LIVE else "HANG")
        assert now == "COMPLETED"
    elif own.cas:
        assert answered == now == sent.last == "CANCELED"
        assert await within(stored(a, task_id)) == "CANCELED"
    else:
        assert (answered, now) == ("CANCELED", "COMPLETED")
    await closed(a, b)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["stock", "ours"])
@pytest.mark.parametrize("where", ["dict", "sqlite"])
async def test_without_the_method_an_end_is_final_within_one_process(
    kind: str, where: str, tmp_path: Path
) -> None:
    """Two handlers of one process on one store object without save_unless_final. A's COMPLETED
    is mid-write (past its read) when B's cancel writes CANCELED. Ours holds B's write until
    A's has landed, and refuses it over COMPLETED: B's answer is what the store holds. Stock
    answers CANCELED, then A's write lands: the store says COMPLETED."""
    async with backend(where, False, tmp_path) as opened:
        store = opened.replica()
        a = make_server(kind, ScriptedExecutor(), store=store, replica_poll_interval=3600)
        b = make_server(kind, ScriptedExecutor(), store=store, replica_poll_interval=3600)
        sent = await start(a)
        task_id = a.executor.task_id or ""
        held = store.hold(COMPLETED)
        a.executor.step.open()
        await within(held.reached.wait())
        cancelling = asyncio.ensure_future(outcome_within(cancel(b, task_id)))
        if kind == "stock":
            await within(asyncio.wait({cancelling}))  # Stock's cancel waits for nothing of A's.
        else:
            await wait_all_tasks_blocked()  # B's write waits for A's.
        held.open()
        answered = await within(cancelling)
        await within(sent.ended())
        now = await within(stored(b, task_id))
        if kind == "stock":
            assert (answered, now) == ("CANCELED" if _sdk.SDK_CANCELS_WHERE_NOT_LIVE else "HANG", "COMPLETED")
        else:
            assert (answered, now, sent.last) == ("TaskNotCancelable", "COMPLETED", "COMPLETED")
        await closed(a, b)


@pytest.mark.asyncio
async def test_a_cancel_on_another_replica_stops_the_run(own: Backend) -> None:
    """B records CANCELED in the shared store; A's run reads it at a checkpoint (polling: a
    store of one's own has no notices but what you give it), runs cancel(), stops, and its
    stream ends on CANCELED; with or without the method."""
    a = make_server("ours", PollingExecutor(), store=own.replica(), replica_poll_interval=0.01)
    b = make_server("ours", ScriptedExecutor(), store=own.replica(), replica_poll_interval=0.01)
    stream = await start(a)
    task_id = a.executor.task_id or ""
    assert await within(cancel(b, task_id)) == "CANCELED"
    await within(a.executor.stopped.wait())
    assert a.executor.cancel_called.is_set()
    assert await within(stream.ended()) and stream.last == "CANCELED"
    assert await within(stored(a, task_id)) == "CANCELED"
    await closed(a, b)


class FailingReads(DictStore):
    """A store of one's own whose reads fail while ``failing`` (a blip), its saves landing."""

    failing = False

    async def get(self, task_id: str, context: Any) -> Task | None:
        if self.failing:
            raise ConnectionError("the store's read failed")
        return await super().get(task_id, context)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["stock", "ours"])
async def test_a_read_that_fails_does_not_fail_the_save_it_guards(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Without save_unless_final, ours reads a task before each save of it; a read that fails
    then (the store's blip) does not fail the save, which stock makes without reading: the run's
    COMPLETED is stored under ours as under stock, and ours says it saved it unchecked."""
    store = FailingReads()
    server = make_server(kind, ScriptedExecutor(), store=store)
    sent = await start(server)
    task_id = server.executor.task_id or ""
    store.failing = True
    server.executor.step.open()
    await within(sent.ended())
    store.failing = False
    assert sent.last == "COMPLETED"
    await eventually(lambda: _stored_is(server, task_id, "COMPLETED"))
    unchecked = [r for r in caplog.records if "saved unchecked" in r.getMessage()]
    assert bool(unchecked) == (kind == "ours")


async def _stored_is(server: Any, task_id: str, state: str) -> bool:
    return await stored(server, task_id) == state

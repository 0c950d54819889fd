"""A cancel in a trace: the SDK's request spans, kept; our attributes, step events and metrics.

Recorded with the OpenTelemetry SDK's in-memory exporter and reader, over each transport, for
the stock handler and ours on the same installed a2a-sdk.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from a2a.server.request_handlers import DefaultRequestHandlerV2
from a2a.server.tasks import InMemoryTaskStore
from a2a.types import SendMessageRequest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace import SpanKind, StatusCode

from a2a_cancelfix import FinalStateTaskStore
from a2a_cancelfix._cancel.settings import Timing
from a2a_cancelfix.testing import (
    Bench,
    ScriptedExecutor,
    cancel,
    make_server,
    message,
    outcome,
    start,
    within,
)
from a2a_cancelfix.tools import scenarios

from .support import logged

TRANSPORTS = ("jsonrpc", "rest", "grpc")
SDK_SPAN = f"{DefaultRequestHandlerV2.__module__}.{DefaultRequestHandlerV2.__name__}"
LOCAL_STEPS = ["callbacks_fired", "cancel_returned", "work_stopped", "terminal_published"]


class _Armed(Sampler):
    """Records spans only while a test here runs: the rest of the suite pays nothing."""

    on = False

    def should_sample(self, parent_context: Any, trace_id: int, name: str, *args: Any, **kwargs: Any) -> Any:
        return SamplingResult(Decision.RECORD_AND_SAMPLE if self.on else Decision.DROP)

    def get_description(self) -> str:
        return "armed"


class _Spans(SpanExporter):
    """The finished spans, in memory, with no lock: OpenTelemetry's InMemorySpanExporter holds a
    plain Lock while it stores them. On Python 3.12+, where the suite leaves the collector on (see
    conftest.py), a collection inside that store may close a traced coroutine of the SDK, whose
    span ends there and is exported again, in the same thread: it waited for its own lock, and
    the test hung (seen once on 3.13.5). A list's extend is one step under the GIL: no lock."""

    def __init__(self) -> None:
        self._spans: list[ReadableSpan] = []

    def export(self, spans: Any) -> SpanExportResult:
        self._spans.extend(spans)
        return SpanExportResult.SUCCESS

    def get_finished_spans(self) -> tuple[ReadableSpan, ...]:
        return tuple(self._spans)

    def clear(self) -> None:
        self._spans.clear()


class Recorder:
    """The process's tracer and meter providers (set once), read per test."""

    def __init__(self) -> None:
        self.sampler = _Armed()
        self.exporter = _Spans()
        tracing = TracerProvider(sampler=self.sampler)
        tracing.add_span_processor(SimpleSpanProcessor(self.exporter))
        trace.set_tracer_provider(tracing)
        delta = AggregationTemporality.DELTA
        self.reader = InMemoryMetricReader(preferred_temporality={Counter: delta, Histogram: delta})
        metrics.set_meter_provider(MeterProvider(metric_readers=[self.reader]))

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        self.exporter.clear()
        self.reader.get_metrics_data()  # Deltas from here on.
        self.sampler.on = True
        try:
            yield
        finally:
            self.sampler.on = False

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def counts(self) -> dict[str, dict[frozenset[tuple[str, Any]], float]]:
        """Each of our metrics: its value (a counter) or count (a histogram), by attributes."""
        found: dict[str, dict[frozenset[tuple[str, Any]], float]] = {}
        data = self.reader.get_metrics_data()
        for resource in data.resource_metrics if data else []:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        value = getattr(point, "value", None)
                        value = point.count if value is None else value
                        key = frozenset(dict(point.attributes or {}).items())
                        found.setdefault(metric.name, {})[key] = value
        return found


_recorder: Recorder | None = None


@pytest.fixture
def recorder() -> Recorder:
    global _recorder
    if _recorder is None:  # A process gets one provider of each kind.
        _recorder = Recorder()
    return _recorder


Scenario = Callable[[Bench], Awaitable[str]]


async def recorded(
    recorder: Recorder, kind: str, transport: str, scenario: Scenario
) -> tuple[str, list[ReadableSpan], dict[str, Any]]:
    """Run ``scenario`` on ``kind``'s handler over ``transport``; what it answered, its spans
    and metrics, once its servers are stopped."""
    with recorder.armed():
        async with Bench(kind, transport) as bench:
            outcome = await within(scenario(bench))
        return outcome, recorder.spans(), recorder.counts()


def named(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name]


def the(spans: list[ReadableSpan], name: str) -> ReadableSpan:
    found = named(spans, name)
    assert len(found) == 1, f"{len(found)} spans named {name}: {[span.name for span in spans]}"
    return found[0]


def lineage(span: ReadableSpan, spans: list[ReadableSpan]) -> list[tuple[str, Any]]:
    """The names and kinds of ``span``'s ancestors in this process, root first, and its own."""
    by_id = {each.context.span_id: each for each in spans}
    chain = []
    while span is not None:
        chain.append((span.name, span.kind))
        span = by_id.get(span.parent.span_id) if span.parent else None
    return chain[::-1]


async def stock_lineage(recorder: Recorder, transport: str, scenario: Scenario) -> Any:
    """The lineage of the stock handler's cancel span in ``scenario``."""
    _, spans, _ = await recorded(recorder, "stock", transport, scenario)
    return lineage(the(spans, f"{SDK_SPAN}.on_cancel_task"), spans)


def steps(span: ReadableSpan) -> list[str]:
    return [event.name.removeprefix("a2a_cancelfix.") for event in span.events]


def ours(span: ReadableSpan) -> dict[str, Any]:
    return {
        key.removeprefix("a2a_cancelfix."): value
        for key, value in (span.attributes or {}).items()
        if key.startswith("a2a_cancelfix.")
    }


# The scenarios, each returning what the client got.


async def local(bench: Bench) -> str:
    server = await bench.server(ScriptedExecutor())
    await start(server)
    return await cancel(server, server.executor.task_id or "")


async def parked(bench: Bench) -> str:
    server = await bench.server(ScriptedExecutor(park=True))
    await start(server)
    return await cancel(server, server.executor.task_id or "")


async def message_to_finished(bench: Bench) -> str:
    server = await bench.server(ScriptedExecutor())
    stream = await start(server)
    server.executor.step.open()
    await stream.ended()
    request = SendMessageRequest(message=message(task_id=server.executor.task_id or ""))
    return await outcome(server.calls.send(request, "alice"))


async def remote(bench: Bench) -> str:
    """Replica B cancels; replica A's run learns of it as it is about to complete."""
    store = FinalStateTaskStore(InMemoryTaskStore())
    a = await bench.server(ScriptedExecutor(), store=store, replica_poll_interval=3600)
    b = await bench.server(ScriptedExecutor(), store=store, replica_poll_interval=3600)
    stream = await start(a)
    answered = await cancel(b, a.executor.task_id or "")
    a.executor.step.open()
    await within(stream.ended())
    return f"{answered}, A's stream ends {stream.last}"


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_cancel_keeps_the_span_the_sdk_gives_it(recorder: Recorder, transport: str) -> None:
    """Ours and stock answer an unknown id in the same span: name, kind, parents and status."""
    spans = {}
    for kind in ("stock", "ours"):
        outcome, recorded_spans, _ = await recorded(recorder, kind, transport, scenarios.unknown_id)
        assert outcome == "TaskNotFound"
        span = the(recorded_spans, f"{SDK_SPAN}.on_cancel_task")
        spans[kind] = (lineage(span, recorded_spans), span.status.status_code, span)
    assert spans["ours"][:2] == spans["stock"][:2]
    assert spans["ours"][0][-1] == (f"{SDK_SPAN}.on_cancel_task", SpanKind.SERVER)
    assert spans["ours"][1] == StatusCode.ERROR
    assert ours(spans["ours"][2]) == {
        "task_id": "no-such-task",
        "cancel.path": "unknown task",
        "cancel.outcome": "TaskNotFound",
        "cancel.grace_exhausted": False,
        "cancel.duration_s": 0.0,
    }


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_local_cancel_shows_its_steps_in_order(recorder: Recorder, transport: str) -> None:
    """Mid-run: the cancel span, placed as stock places it, says the path and outcome, has one
    event per lifecycle step, and is the parent of the SDK's queue spans of its CANCELED."""
    outcome, spans, counts = await recorded(recorder, "ours", transport, local)
    assert outcome == "CANCELED"
    span = the(spans, f"{SDK_SPAN}.on_cancel_task")
    assert lineage(span, spans) == await stock_lineage(recorder, transport, local)
    attributes = ours(span)
    assert (attributes["cancel.path"], attributes["cancel.outcome"]) == ("live", "CANCELED")
    assert attributes["cancel.grace_exhausted"] is False and attributes["cancel.duration_s"] > 0
    assert steps(span) == LOCAL_STEPS
    assert span.status.status_code == StatusCode.OK
    assert len(named(spans, f"{SDK_SPAN}.on_message_send_stream")) == 1  # Not one more inside ours.
    children = [each.name for each in spans if each.parent and each.parent.span_id == span.context.span_id]
    assert any(name.endswith(".enqueue_event") for name in children), children
    live = frozenset({("path", "live"), ("outcome", "CANCELED")})
    assert counts["a2a_cancelfix.cancels"] == {live: 1}
    assert counts["a2a_cancelfix.cancel.duration"] == {live: 1}
    assert "a2a_cancelfix.cancel.grace_exhausted" not in counts


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_parked_cancel_has_no_work_to_stop(recorder: Recorder, transport: str) -> None:
    outcome, spans, counts = await recorded(recorder, "ours", transport, parked)
    assert outcome == "CANCELED"
    span = the(spans, f"{SDK_SPAN}.on_cancel_task")
    assert lineage(span, spans) == await stock_lineage(recorder, transport, parked)
    assert ours(span)["cancel.path"] == "parked"
    assert steps(span) == ["callbacks_fired", "cancel_returned", "terminal_published"]
    assert counts["a2a_cancelfix.cancels"] == {frozenset({("path", "parked"), ("outcome", "CANCELED")}): 1}


@pytest.mark.asyncio
async def test_a_hanging_cancel_is_cut_off_in_the_trace(recorder: Recorder) -> None:
    async def hangs(bench: Bench) -> str:
        server = await bench.server(ScriptedExecutor(cancel="hang"), cancel_grace_period=0.05)
        await start(server)
        return await cancel(server, server.executor.task_id or "")

    outcome, spans, counts = await recorded(recorder, "ours", "jsonrpc", hangs)
    assert outcome == "CANCELED"
    span = the(spans, f"{SDK_SPAN}.on_cancel_task")
    assert steps(span) == ["callbacks_fired", "cancel_cut_off", "work_stopped", "terminal_published"]
    assert ours(span)["cancel.grace_exhausted"] is True
    assert counts["a2a_cancelfix.cancel.grace_exhausted"] == {
        frozenset({("path", "live"), ("outcome", "CANCELED")}): 1
    }


@pytest.mark.asyncio
async def test_a_raising_cancel_is_an_error_in_the_trace(recorder: Recorder) -> None:
    async def raises(bench: Bench) -> str:
        server = await bench.server(ScriptedExecutor(cancel="raise"))
        await start(server)
        return await cancel(server, server.executor.task_id or "")

    outcome, spans, _ = await recorded(recorder, "ours", "jsonrpc", raises)
    assert outcome == "Internal"
    span = the(spans, f"{SDK_SPAN}.on_cancel_task")
    assert steps(span)[:2] == ["callbacks_fired", "cancel_raised"]
    assert span.events[1].attributes == {"error": "RuntimeError"}
    assert ours(span)["cancel.outcome"] == "FAILED" and span.status.status_code == StatusCode.ERROR


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_refused_cancel_is_an_error_span_as_stock_makes_it(
    recorder: Recorder, transport: str
) -> None:
    found = {}
    for kind in ("stock", "ours"):
        outcome, spans, counts = await recorded(recorder, kind, transport, scenarios.completed)
        assert outcome == "TaskNotCancelable"
        span = the(spans, f"{SDK_SPAN}.on_cancel_task")
        found[kind] = (lineage(span, spans), span.status.status_code)
    assert found["ours"] == found["stock"] and found["ours"][1] == StatusCode.ERROR
    assert counts["a2a_cancelfix.cancels"] == {
        frozenset({("path", "already terminal"), ("outcome", "TaskNotCancelable")}): 1
    }


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_message_to_a_finished_task_has_the_sdk_span(recorder: Recorder, transport: str) -> None:
    """Refused before the SDK sees it, the message still gets the span stock gives it: same
    name, kind, parents, error status and exception events (two up to a2a-sdk 1.1.x)."""
    found = {}
    for kind in ("stock", "ours"):
        outcome, spans, _ = await recorded(recorder, kind, transport, message_to_finished)
        assert outcome in ("UnsupportedOperation", "InvalidParams")  # Stock, before 1.2.0: the latter.
        span = the(spans, f"{SDK_SPAN}.on_message_send")
        found[kind] = (lineage(span, spans), span.status.status_code, [event.name for event in span.events])
    assert found["ours"] == found["stock"]
    assert found["ours"][0][-1][1] == SpanKind.SERVER and found["ours"][1] == StatusCode.ERROR


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_remote_cancel_is_noticed_in_a_span_of_its_own(recorder: Recorder, transport: str) -> None:
    """B's cancel span says the task was not live there; A's notice has a span with the
    lifecycle's steps, and the metrics count the notice and its latency. (Stock's cancel of a
    task not live here hangs up to 1.1.5: its span is compared on an unknown id above.)"""
    outcome, spans, counts = await recorded(recorder, "ours", transport, remote)
    assert outcome == "CANCELED, A's stream ends CANCELED"
    asked = the(spans, f"{SDK_SPAN}.on_cancel_task")
    assert ours(asked)["cancel.path"] in ("not live here", "not live here (SDK)")
    noticed = the(spans, "a2a_cancelfix.remote_cancel")
    assert steps(noticed) == ["remote_cancel_noticed", *LOCAL_STEPS]
    assert 0 <= noticed.events[0].attributes["latency_s"] < 60
    assert counts["a2a_cancelfix.remote_cancels_noticed"] == {frozenset(): 1}
    assert counts["a2a_cancelfix.remote_cancel.notice_latency"] == {frozenset(): 1}
    # A's own CANCELED finds B's stored: the guarded store refuses it, and says so.
    assert counts["a2a_cancelfix.saves_refused"] == {
        frozenset({("stored", "TASK_STATE_CANCELED"), ("refused", "TASK_STATE_CANCELED")}): 1
    }


@pytest.mark.asyncio
async def test_a_forced_teardown_is_a_span_under_the_cancel(
    recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    """An execute() that swallows the cancel holds its run after the answer; the run's forced
    close, behind the answer, is recorded under the cancel's span."""

    async def swallows(bench: Bench) -> str:
        server = await bench.server(
            ScriptedExecutor(swallow=True), cancel_grace_period=0.05, timing=Timing(patience=0.05)
        )
        await start(server)
        try:
            with caplog.at_level(logging.DEBUG, "a2a_cancelfix"), logged("force-closed") as forced:
                answer = await cancel(server, server.executor.task_id or "")
                await within(forced.wait())
            return answer
        finally:
            server.executor.released.set()

    outcome, spans, counts = await recorded(recorder, "ours", "jsonrpc", swallows)
    assert outcome == "CANCELED"
    cancel_span = the(spans, f"{SDK_SPAN}.on_cancel_task")
    assert steps(cancel_span)[-2:] == ["work_stopped", "terminal_published"]
    assert cancel_span.events[-2].attributes == {"abandoned": True}
    forced = the(spans, "a2a_cancelfix.teardown_forced")
    assert forced.parent is not None and forced.parent.span_id == cancel_span.context.span_id
    assert counts["a2a_cancelfix.teardowns_forced"] == {frozenset(): 1}


# A cancel mid-run in a process of its own, with a tracer and a meter set up: what it answered,
# how many spans it recorded, how many metrics.
_ALONE = """
import asyncio, sys
if sys.argv[1] == "uninstalled":
    sys.modules["opentelemetry"] = None  # As if it were not installed: imports fail.
else:
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
    tracing = TracerProvider()
    tracing.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(tracing)
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
from a2a_cancelfix.testing import Bench, ScriptedExecutor, cancel, start

async def main():
    async with Bench("ours", "in-process") as bench:
        server = await bench.server(ScriptedExecutor())
        await start(server)
        return await cancel(server, server.executor.task_id)

answer = asyncio.run(main())
if sys.argv[1] == "uninstalled":
    print(answer, 0, 0)
else:
    data = reader.get_metrics_data()
    print(answer, len(exporter.get_finished_spans()), len(data.resource_metrics) if data else 0)
"""


@pytest.mark.parametrize(
    ("how", "switch", "shows"),
    [
        ("installed", "true", None),
        ("installed", "false", ["CANCELED", "0", "0"]),
        ("uninstalled", "true", ["CANCELED", "0", "0"]),
    ],
)
def test_off_when_the_sdk_is_off(how: str, switch: str, shows: list[str] | None) -> None:
    """With OTEL_INSTRUMENTATION_A2A_SDK_ENABLED=false, or without OpenTelemetry, we record
    nothing (as the SDK records nothing) and cancel as ever; on, the same cancel records."""
    environment = {**os.environ, "OTEL_INSTRUMENTATION_A2A_SDK_ENABLED": switch}
    alone = [sys.executable, "-c", _ALONE, how]
    shown = subprocess.run(alone, env=environment, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    answer, spans, meters = shown.stdout.split()
    if shows is None:
        assert answer == "CANCELED" and int(spans) > 0 and int(meters) > 0
    else:
        assert [answer, spans, meters] == shows


@pytest.mark.asyncio
async def test_a_task_nobody_watches_is_cancelled_in_a_span_of_its_own(recorder: Recorder) -> None:
    """``cancel_unwatched_after``: no request asked for the cancel, so it has a span of its own,
    with path ``unwatched``, the lifecycle's steps, and the cancel metrics by that path."""
    outcome, spans, counts = await recorded(recorder, "ours", "jsonrpc", scenarios.nobody_comes_back)
    assert outcome == "task CANCELED, cancel() called"
    span = the(spans, "a2a_cancelfix.unwatched_cancel")
    assert ours(span)["cancel.path"] == "unwatched" and ours(span)["cancel.outcome"] == "CANCELED"
    assert ours(span)["unwatched_after_s"] == scenarios.UNWATCHED_AFTER
    assert steps(span) == LOCAL_STEPS
    assert counts["a2a_cancelfix.cancels"] == {frozenset({("path", "unwatched"), ("outcome", "CANCELED")}): 1}


@pytest.mark.asyncio
async def test_a_run_still_going_at_shutdown_is_cancelled_in_a_span_of_its_own(recorder: Recorder) -> None:
    """``aclose()``'s cancel of a run still going after ``shutdown_drain_time``: no request asked
    for it, so it has a span of its own, with path ``shutdown`` and the lifecycle's steps."""
    with recorder.armed():
        server = make_server("ours", ScriptedExecutor(), shutdown_drain_time=0.1, timing=Timing(margin=0.1))
        await start(server)
        await within(server.handler.aclose())
        spans, counts = recorder.spans(), recorder.counts()
    span = the(spans, "a2a_cancelfix.shutdown_cancel")
    assert ours(span)["cancel.path"] == "shutdown" and ours(span)["cancel.outcome"] == "CANCELED"
    assert steps(span) == LOCAL_STEPS
    assert counts["a2a_cancelfix.cancels"] == {frozenset({("path", "shutdown"), ("outcome", "CANCELED")}): 1}


@pytest.mark.asyncio
async def test_a_lost_lease_and_a_lapsed_one_each_have_a_span_of_their_own(
    recorder: Recorder, tmp_path: Path
) -> None:
    """A replica that cannot renew its lease cancels its run in a span of its own (path
    ``lease_lost``); a survivor's end of a task whose replica's lease lapsed is a span of its
    own too, with its outcome, and counted."""
    from .test_liveness import BOUND, LEASE, Cut, Reader, replica, until
    from .test_store import open_database

    async with open_database("sqlite", tmp_path) as database:
        with recorder.armed():
            engine = database.engine()
            cut = Cut(engine)
            runner, survivor = replica("ours", engine), replica("ours", database.engine())
            await start(runner)
            lapsed = await _a_dead_replicas_task(Reader(database), LEASE)
            await survivor.calls.get(lapsed, "alice")
            cut.on = True

            def ended() -> list[ReadableSpan]:
                spans = named(recorder.spans(), "a2a_cancelfix.lease_lapsed")
                return [span for span in spans if ours(span)["task_id"] == lapsed]

            assert await until(ended, BOUND)
            assert await until(lambda: named(recorder.spans(), "a2a_cancelfix.lease_lost_cancel"), BOUND)
            spans, counts = recorder.spans(), recorder.counts()
            cut.on = False
            for server in (runner, survivor):
                await server.handler.aclose()
    lost = the(spans, "a2a_cancelfix.lease_lost_cancel")
    assert ours(lost)["cancel.path"] == "lease_lost" and ours(lost)["cancel.outcome"] == "CANCELED"
    assert steps(lost) == LOCAL_STEPS
    (end,) = (span for span in named(spans, "a2a_cancelfix.lease_lapsed") if ours(span)["task_id"] == lapsed)
    assert ours(end)["lease.outcome"] == "FAILED" and ours(end)["lease.replica_id"] == "gone"
    assert counts["a2a_cancelfix.lease_lapsed"] == {frozenset(): 1}


async def _a_dead_replicas_task(reader: Any, lease: float) -> str:
    """A task WORKING in the store, leased by a replica whose lease is never renewed."""
    import uuid

    import sqlalchemy as sa
    from a2a.types import Task, TaskState, TaskStatus

    from a2a_cancelfix._lease_tables import REPLICAS, RUNS
    from a2a_cancelfix.testing import caller

    task_id = uuid.uuid4().hex
    working = Task(id=task_id, context_id="ctx", status=TaskStatus(state=TaskState.TASK_STATE_WORKING))
    await reader.store.save(working, caller("alice"))
    async with reader.engine.begin() as connection:
        await connection.run_sync(lambda sync: _lease_tables().create_all(sync))
        await connection.execute(
            sa.text(f"INSERT INTO {REPLICAS} (replica_id, beat, lease_ms) VALUES ('gone', 0, :ms)"),
            {"ms": round(lease * 1000)},
        )
        await connection.execute(
            sa.text(
                f"INSERT INTO {RUNS} (store, task_id, replica_id, owner) VALUES ('tasks', :t, 'gone', 'alice')"
            ),
            {"t": task_id},
        )
    return task_id


def _lease_tables() -> Any:
    from a2a_cancelfix._databases import DIALECTS
    from a2a_cancelfix._lease_tables import LeaseTables

    return LeaseTables(DIALECTS["sqlite"]).metadata

"""What a cancel looks like to OpenTelemetry: the SDK's request spans, our steps on them, metrics.

The handler's overrides carry the span the SDK's ``trace_class`` gives its own methods (same
name, same kind, same status on error), so swapping the import changes no dashboard. What we
add is named ``a2a_cancelfix.*``: attributes of the cancel, an event per lifecycle step, and
metrics. All of it is off, and costs one attribute read, when OpenTelemetry is not installed
or the SDK's switch ``OTEL_INSTRUMENTATION_A2A_SDK_ENABLED`` is not ``true``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from a2a.server.request_handlers import DefaultRequestHandlerV2
from a2a.utils.telemetry import SpanKind, trace_function

PREFIX = "a2a_cancelfix"
F = TypeVar("F", bound=Callable[..., Any])

try:
    from opentelemetry import metrics, trace
except ImportError:  # The SDK's telemetry extra is not installed.
    ENABLED = False
else:  # The SDK reads its switch the same way, once, at import.
    ENABLED = os.getenv("OTEL_INSTRUMENTATION_A2A_SDK_ENABLED", "true").lower() == "true"

if ENABLED:
    _meter = metrics.get_meter(PREFIX)
    _tracer = trace.get_tracer(PREFIX)
    _duration = _meter.create_histogram(
        f"{PREFIX}.cancel.duration", unit="s", description="From a cancel's request to its answer"
    )
    _cancels = _meter.create_counter(
        f"{PREFIX}.cancels", description="Cancels answered or refused, by path and outcome"
    )
    _grace_exhausted = _meter.create_counter(
        f"{PREFIX}.cancel.grace_exhausted", description="Cancels that used up their grace period"
    )
    _saves_refused = _meter.create_counter(
        f"{PREFIX}.saves_refused", description="Saves over a terminal state, refused by FinalStateTaskStore"
    )
    _remote_noticed = _meter.create_counter(
        f"{PREFIX}.remote_cancels_noticed", description="Cancels recorded by another replica, noticed here"
    )
    _notice_latency = _meter.create_histogram(
        f"{PREFIX}.remote_cancel.notice_latency",
        unit="s",
        description="From the CANCELED another replica stored to this replica noticing it",
    )
    _lapsed_ended = _meter.create_counter(
        f"{PREFIX}.lease_lapsed",
        description="Tasks ended FAILED here because the replica running them stopped renewing its lease",
    )
    _teardowns_forced = _meter.create_counter(
        f"{PREFIX}.teardowns_forced", description="Runs that did not close after a cancel and were closed"
    )


def traced_as_sdk(method: F) -> F:
    """Give an override of ours the span the SDK's handler gives its own method of that name."""
    name = f"{DefaultRequestHandlerV2.__module__}.{DefaultRequestHandlerV2.__name__}.{method.__name__}"
    return trace_function(span_name=name, kind=SpanKind.SERVER)(method)  # type: ignore[no-any-return]


def current_span() -> Any:
    """The span our steps go on now (None when off): a request's, or the run's."""
    return trace.get_current_span() if ENABLED else None


def step(span: Any, name: str, **attributes: Any) -> None:
    """Record a lifecycle step as an event on ``span``.

    A step after ``span`` ended (a run torn down behind the answer, a save refused once the
    request returned) becomes a short span of its own, child of ``span``.
    """
    if span is None:
        return
    if span.is_recording():
        span.add_event(f"{PREFIX}.{name}", attributes)
    elif span.get_span_context().is_valid:
        under = trace.set_span_in_context(span)
        with _tracer.start_as_current_span(f"{PREFIX}.{name}", under, attributes=attributes) as late:
            late.add_event(f"{PREFIX}.{name}", attributes)


def cancel_answered(task_id: str, path: str, outcome: str, took: float, late: bool) -> None:
    """The attributes of the request's cancel span, and the cancel metrics."""
    if not ENABLED:
        return
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes(
            {
                f"{PREFIX}.task_id": task_id,
                f"{PREFIX}.cancel.path": path,
                f"{PREFIX}.cancel.outcome": outcome,
                f"{PREFIX}.cancel.grace_exhausted": late,
                f"{PREFIX}.cancel.duration_s": took,
            }
        )
    kinds = {"path": path, "outcome": outcome}
    _cancels.add(1, kinds)
    _duration.record(took, kinds)
    if late:
        _grace_exhausted.add(1, kinds)


def remote_cancel_span(task_id: str, stored_at: float | None) -> Any:
    """Start the span of a cancel noticed from another replica (None when off).

    ``stored_at``: when the other replica stored CANCELED (epoch seconds), if it says.
    """
    if not ENABLED:
        return None
    latency = None if stored_at is None else max(time.time() - stored_at, 0.0)
    span = _tracer.start_span(f"{PREFIX}.remote_cancel", attributes={f"{PREFIX}.task_id": task_id})
    step(span, "remote_cancel_noticed", **({} if latency is None else {"latency_s": latency}))
    _remote_noticed.add(1)
    if latency is not None:
        _notice_latency.record(latency)
    return span


def unwatched_span(task_id: str, after: float) -> Any:
    """Start the span of a cancel of a task nobody watched for ``after`` seconds (None when off)."""
    if not ENABLED:
        return None
    span = _tracer.start_span(f"{PREFIX}.unwatched_cancel")
    span.set_attributes({f"{PREFIX}.task_id": task_id, f"{PREFIX}.unwatched_after_s": after})
    return span


def shutdown_span(task_id: str) -> Any:
    """Start the span of a cancel of a run still going at the server's shutdown (None when off)."""
    if not ENABLED:
        return None
    return _tracer.start_span(f"{PREFIX}.shutdown_cancel", attributes={f"{PREFIX}.task_id": task_id})


def lease_lost_span(task_id: str) -> Any:
    """Start the span of a cancel of a run here whose replica lost its lease (None when off)."""
    if not ENABLED:
        return None
    span = _tracer.start_span(f"{PREFIX}.lease_lost_cancel")
    span.set_attribute(f"{PREFIX}.task_id", task_id)
    return span


def lease_lapsed_span(task_id: str, replica_id: str) -> Any:
    """Start the span of a task ended here because ``replica_id``, which ran it, stopped
    renewing its lease (None when off)."""
    if not ENABLED:
        return None
    span = _tracer.start_span(f"{PREFIX}.lease_lapsed")
    span.set_attributes({f"{PREFIX}.task_id": task_id, f"{PREFIX}.lease.replica_id": replica_id})
    return span


def lease_lapsed(span: Any, outcome: str) -> None:
    """The end of a lapsed lease's task: FAILED here, or left as it was (parked, ended, taken
    by another replica)."""
    if not ENABLED:
        return
    if span is not None and span.is_recording():
        span.set_attribute(f"{PREFIX}.lease.outcome", outcome)
    if outcome == "FAILED":
        _lapsed_ended.add(1)


@contextlib.contextmanager
def current(span: Any) -> Iterator[None]:
    """Make ``span`` the current one (where `cancel_answered` records) inside the block."""
    if span is None:
        yield
        return
    with trace.use_span(span, end_on_exit=False):
        yield


def end(span: Any) -> None:
    if span is not None:
        span.end()


def save_refused(task_id: str, stored: str, refused: str) -> None:
    if not ENABLED:
        return
    step(trace.get_current_span(), "save_refused", task_id=task_id, stored=stored, refused=refused)
    _saves_refused.add(1, {"stored": stored, "refused": refused})


def teardown_forced(task_id: str, span: Any = None) -> None:
    """A run was force-closed; recorded under ``span``, by default the current one."""
    if not ENABLED:
        return
    step(span if span is not None else trace.get_current_span(), "teardown_forced", task_id=task_id)
    _teardowns_forced.add(1)

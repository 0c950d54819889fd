"""The suite's own footing: what conftest.py does so that a worker survives CPython's faults."""

from __future__ import annotations

import ast
import contextvars
import gc
import traceback
from pathlib import Path


class _LogsATracebackAsItCloses:
    """Garbage in a cycle, as the SDK's leaked dispatch tasks are: its finalizer formats a
    traceback, as OpenTelemetry's "Failed to detach context" does."""

    def __init__(self) -> None:
        self.cycle = self

    def __del__(self) -> None:
        try:
            (lambda: 1 / 0)()
        except ZeroDivisionError:
            traceback.format_exc()


def test_a_finalizer_formatting_a_traceback_does_not_break_a_parse() -> None:
    """cpython#106905: without conftest.py's guard, on 3.11.7, the parse raises ``SystemError:
    AST constructor recursion depth mismatch`` (in a worker: a crash)."""
    source = Path(ast.__file__).read_text() * 3
    thresholds, enabled = gc.get_threshold(), gc.isenabled()
    gc.set_threshold(50)  # The collector runs inside the parse, as it can anywhere.
    gc.enable()  # Here, where nothing sets a context variable (see the next test).
    try:
        for _ in range(10):
            for _ in range(200):
                _LogsATracebackAsItCloses()
            assert isinstance(ast.parse(source), ast.Module)
    finally:
        if not enabled:
            gc.disable()
        gc.set_threshold(*thresholds)
        gc.collect()


_variable: contextvars.ContextVar[object] = contextvars.ContextVar("variable")
_padding = [contextvars.ContextVar(f"padding_{index}") for index in range(24)]


class _SetsAContextVariableAsItCloses:
    """Garbage in a cycle, as the SDK's leaked tasks are: its finalizer sets a context variable,
    as a coroutine closed by the collector does when its ``finally`` detaches an OpenTelemetry
    context."""

    def __init__(self) -> None:
        self.cycle = self

    def __del__(self) -> None:
        _variable.set(object())


def test_the_collector_never_runs_inside_a_context_variable_set() -> None:
    """cpython#148891: without conftest.py's guard, on 3.11.7, this segfaults 9 times in 10
    per round (in a worker: "node down")."""
    for variable in _padding:  # A context deep enough that setting a variable allocates nodes.
        variable.set(object())
    thresholds = gc.get_threshold()
    gc.set_threshold(1)  # Were the collector on, it would run inside each set.
    try:
        for _ in range(3):
            for index in range(100_000):
                _SetsAContextVariableAsItCloses()
                _padding[index % len(_padding)].set(object())
    finally:
        gc.set_threshold(*thresholds)
        gc.collect()  # Called from here, nothing is being set: the finalizers' sets are safe.
    assert _variable.get(None) is not None  # The finalizers ran, in the collection above.

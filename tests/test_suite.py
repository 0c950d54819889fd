"""The suite's own footing: what conftest.py does so that a worker survives CPython's faults."""

from __future__ import annotations

import ast
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
    thresholds = gc.get_threshold()
    gc.set_threshold(50)  # The collector runs inside the parse, as it can anywhere.
    try:
        for _ in range(10):
            for _ in range(200):
                _LogsATracebackAsItCloses()
            assert isinstance(ast.parse(source), ast.Module)
    finally:
        gc.set_threshold(*thresholds)
        gc.collect()

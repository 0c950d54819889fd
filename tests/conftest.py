import gc
import importlib.metadata
import sys

import pytest


def pytest_report_header() -> str:
    versions = ", ".join(
        f"{name} {importlib.metadata.version(name)}"
        for name in ("a2a-sdk", "a2a-cancelfix", "wrapt", "protobuf")
    )
    return f"python {sys.version.split()[0]}; {versions}"


pytest_plugins = ["pytester"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "edges_only: run by nox on the oldest and newest a2a-sdk release only; the code path it "
        "adds does not differ between releases (noxfile.py says which and why)",
    )


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    """Report a failure with the collector held off.

    CPython 3.11's AST builder keeps its depth count in one place per process (cpython#106905).
    The collector can run finalizers in the middle of pytest's ``ast.parse`` of the failing
    source: a stock handler's leaked dispatch task, closed there, logs OpenTelemetry's "Failed
    to detach context" with its traceback, whose formatting parses too. The outer parse then
    raises ``SystemError``, the xdist worker crashes, and the failure itself is never shown.
    """
    if call.excinfo is None:
        return (yield)
    gc.collect()  # Those finalizers run now, on their own.
    gc.disable()
    try:
        return (yield)
    finally:
        gc.enable()

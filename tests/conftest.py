import importlib.metadata
import sys
import traceback

import pytest


def pytest_report_header() -> str:
    versions = ", ".join(
        f"{name} {importlib.metadata.version(name)}"
        for name in ("a2a-sdk", "a2a-cancelfix", "wrapt", "protobuf")
    )
    return f"python {sys.version.split()[0]}; {versions}"


pytest_plugins = ["pytester"]

# CPython 3.11 and 3.12 keep the AST builder's depth count in one place per interpreter
# (cpython#106905), and their tracebacks parse each line to place the carets. A finalizer that
# formats a traceback while some other code parses (pytest rewriting a module, reporting a
# failure, another traceback) makes the outer parse raise SystemError; in an xdist worker that
# is a crash ("node down: Not properly terminated"). The SDK's dispatch tasks, left pending by
# every bench and collected at any time, log OpenTelemetry's "Failed to detach context" with
# its traceback as they close. Without the parse, tracebacks mark the whole expression.
if sys.version_info < (3, 13):
    traceback._extract_caret_anchors_from_line_segment = lambda segment: None  # type: ignore[attr-defined]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "edges_only: run by nox on the oldest and newest a2a-sdk release only; the code path it "
        "adds does not differ between releases (noxfile.py says which and why)",
    )

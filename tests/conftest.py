import gc
import importlib.metadata
import sys
import traceback
from collections.abc import Iterator

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


# CPython up to 3.11 frees a context's variables while it is still inserting into them when
# the collector runs inside a ContextVar.set and a finalizer sets a variable of the same
# context (cpython#148891): a segfault ("Fatal Python error", exit -11; in an xdist worker,
# "node down"). The SDK's tasks that a bench leaves pending are such garbage: closed by the
# collector, their frames detach OpenTelemetry contexts, and OpenTelemetry sets one on every
# span's end. So, in the suite's processes, the collector never runs on its own there: it runs
# after each test, between tests, where nothing sets a context variable (the young objects
# after each, everything after every ``FULL_EVERY``th: the imports make a full pass slow).
COLLECT_BETWEEN_TESTS = sys.version_info < (3, 12)
FULL_EVERY = 25
if COLLECT_BETWEEN_TESTS:
    gc.disable()
_tests_run = 0


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    global _tests_run
    try:
        return (yield)
    finally:
        if COLLECT_BETWEEN_TESTS:
            _tests_run += 1
            gc.collect(2 if _tests_run % FULL_EVERY == 0 else 1)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "edges_only: run by nox on the oldest and newest a2a-sdk release only; the code path it "
        "adds does not differ between releases (noxfile.py says which and why)",
    )
    config.addinivalue_line(
        "markers",
        "soak: a minute of chaos, run alone after the newest release's other tests (noxfile.py)",
    )
    config.addinivalue_line(
        "markers",
        "frameworks: needs the frameworks `nox -s frameworks` installs (that session runs them)",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test's MariaDB case runs on the edges only: what it adds to the same test's SQLite and
    PostgreSQL cases, on every release, is our own SQL of `_databases.py` (noxfile.py)."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "mysql" in callspec.params.values():
            item.add_marker(pytest.mark.edges_only)

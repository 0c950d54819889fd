"""``a2a-cancelfix check --repro``: a script to attach to an upstream bug report.

For a scenario the installed stock a2a-sdk fails, a standalone script (a2a-sdk and the standard
library only) that makes the scenario's calls straight on the SDK's own ``DefaultRequestHandler``
and asserts what the scenario expects, so it fails while the defect is there. Every wait in it
is bounded: a call that never answers fails the assertion as "no answer within 2.5 s".

The script's code is in ``repro_scripts/``, as modules that ruff and mypy check: the prelude,
then the module the scenario names by its ``script``, joined here under a header and above the
lines that run it.
"""

from __future__ import annotations

import ast
import itertools
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

from a2a_cancelfix._sdk import SDK_VERSION
from a2a_cancelfix.testing.waits import BOUND
from a2a_cancelfix.tools import repro_scripts, scenarios
from a2a_cancelfix.tools.repro_scripts import prelude
from a2a_cancelfix.tools.scenarios import NOT_RUN, Scenario

__all__ = ["NoRepro", "script_for"]


class NoRepro(Exception):
    """Why there is no script for a scenario on the installed a2a-sdk."""


def script_for(name: str) -> str:
    """Run scenario ``name`` on the stock handler; return its script if stock fails it.

    Raises:
        NoRepro: the name is unknown, the scenario could not run here, or stock passes it.
    """
    scenario = next((scenario for scenario in scenarios.SCENARIOS if scenario.name == name), None)
    if scenario is None:
        names = "\n".join(f"  {scenario.name}" for scenario in scenarios.SCENARIOS)
        raise NoRepro(f"no scenario is named {name!r}; the scenarios are:\n{names}")
    if scenario.opt_in:
        raise NoRepro(
            f"{name!r} shows a2a-cancelfix's {scenario.opt_in}, not a defect of a2a-sdk: nothing to report"
        )
    stock = scenarios.run_scenario(scenario, "stock")
    if stock.startswith(NOT_RUN):
        raise NoRepro(f"{name!r} cannot run here: {stock}")
    if stock == scenario.expected:
        raise NoRepro(f"stock a2a-sdk {SDK_VERSION} passes {name!r} ({stock}): there is nothing to reproduce")
    script = _script(scenario, stock)
    # The script makes the calls in process: one that does not fail on stock here proves nothing.
    if not _fails(script):
        raise NoRepro(
            f"stock a2a-sdk {SDK_VERSION} fails {name!r} over {_TRANSPORTS[scenario.transport]} "
            f"({stock}), but its standalone script, whose calls are made in process, does not "
            "reproduce it here: report what `a2a-cancelfix check` shows instead"
        )
    return script


def _fails(script: str) -> bool:
    """Whether ``script``, run on its own, ends on its assertion (it shows the defect)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "repro.py"
        path.write_text(script)
        try:
            ran = subprocess.run(
                [sys.executable, str(path)], capture_output=True, text=True, timeout=_SCRIPT_BOUND
            )
        except subprocess.TimeoutExpired:
            return False
    lines = ran.stderr.strip().splitlines()
    return ran.returncode == 1 and bool(lines) and lines[-1].startswith("AssertionError")


# A script runs its scenario up to TRIES times, each bounded by BOUND, plus its imports.
_SCRIPT_BOUND = prelude.TRIES * BOUND + 60


def _script(scenario: Scenario, stock: str) -> str:
    """The script for ``scenario``, whose stock outcome here is ``stock``."""
    transport = _TRANSPORTS[scenario.transport]
    header = f'''"""{scenario.name}: a cancel on a2a-sdk's DefaultRequestHandler.

Expected: {scenario.expected}
a2a-sdk {SDK_VERSION}, as `a2a-cancelfix check` saw it over {transport}: {stock}

Made by `a2a-cancelfix check --repro "{scenario.name}"`; needs only a2a-sdk. The calls are
made straight on the handler, in one process, as the SDK's {transport} server code makes them.
Every wait is bounded ({BOUND} s; HANG above is no answer within it). Run: python this_file.py
(it exits with an AssertionError while the defect is there).
"""
'''
    footer = f"""

EXPECTED = {scenario.expected!r}

if __name__ == "__main__":
    reproduce(scenario, EXPECTED)
"""
    return header + "\n" + _code("prelude") + "\n\n" + _code(scenario.script, imports=False) + footer


def _code(name: str, imports: bool = True) -> str:
    """The code of ``repro_scripts/{name}.py`` after its docstring, and after its imports unless
    ``imports`` (a scenario's part imports what the prelude does, and from the prelude)."""
    source = resources.files(repro_scripts).joinpath(f"{name}.py").read_text()
    tree = ast.parse(source)
    head = tree.body[: 1 if ast.get_docstring(tree) else 0]
    if not imports:
        rest = tree.body[len(head) :]
        head += itertools.takewhile(lambda node: isinstance(node, (ast.Import, ast.ImportFrom)), rest)
    start = head[-1].end_lineno if head else 0
    return "".join(source.splitlines(keepends=True)[start:]).lstrip("\n")


_TRANSPORTS = {"jsonrpc": "JSON-RPC", "rest": "REST", "grpc": "gRPC"}

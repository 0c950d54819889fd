"""The package's layout: the runtime apart from the tools and the testing kit, and public names
that are the documented ones."""

from __future__ import annotations

import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import a2a_cancelfix

README = (Path(__file__).parents[1] / "README.md").read_text()

PUBLIC = {
    "a2a_cancelfix": {
        "CancellableExecutor",
        "DefaultRequestHandler",
        "DefaultRequestHandlerV2",
        "FinalStateTaskStore",
        "RunCancelled",
        "cancel_requested",
        "cancellable",
        "checkpoint",
        "on_cancel",
        "patch",
        "shielded",
        "unpatch",
    },
    "a2a_cancelfix.checkpoints": {
        "Probe",
        "RunCancelled",
        "cancel_requested",
        "cancellable",
        "checkpoint",
        "on_cancel",
        "shielded",
    },
    "a2a_cancelfix.store": {"FinalStateTaskStore"},
    "a2a_cancelfix.notices": {"CancelNotices", "PostgresNotices", "RedisNotices"},
    "a2a_cancelfix.testing": {
        "BOUND",
        "IN_PROCESS",
        "ORIGINS",
        "Bench",
        "Changes",
        "Gate",
        "Point",
        "PushReceiver",
        "Report",
        "Row",
        "ScriptedExecutor",
        "Server",
        "Stream",
        "caller",
        "cancel",
        "make_server",
        "message",
        "outcome",
        "play",
        "reached_step",
        "start",
        "state_of",
        "stored",
        "sweep",
        "wait_all_tasks_blocked",
        "within",
    },
    "a2a_cancelfix.testing.examples": {"Pipeline", "claim_released"},
}
"""Every public module and the names it exports; each named in the README."""

RUNTIME = sorted(
    f"a2a_cancelfix.{module.name}"
    for module in pkgutil.iter_modules(a2a_cancelfix.__path__)
    if not module.ispkg and module.name != "__main__"
)
"""What a server imports: every module of the package itself, none of its subpackages."""


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_a_public_module_exports_exactly_its_documented_names(module: str) -> None:
    """``__all__`` is the set the README documents, and every name in it resolves."""
    exported = importlib.import_module(module).__all__
    assert set(exported) == PUBLIC[module]
    assert all(getattr(importlib.import_module(module), name) is not None for name in exported)
    # Named in the text or the examples: `name`, `module.name`, or imported.
    undocumented = [name for name in exported if not re.search(rf"[`.\s,(]{name}\b", README)]
    assert not undocumented, f"{module} exports names the README does not name: {undocumented}"


@pytest.mark.edges_only  # Its own interpreter, for what runs in process on every release (see noxfile.py).
def test_the_runtime_imports_none_of_the_tools_nor_the_testing_kit() -> None:
    """Importing every runtime module, in a fresh interpreter, loads nothing of tools/ or testing/."""
    code = (
        "import importlib, sys\n"
        f"for name in {RUNTIME!r}: importlib.import_module(name)\n"
        "apart = ('a2a_cancelfix.tools', 'a2a_cancelfix.testing')\n"
        "print(sorted(module for module in sys.modules if module.startswith(apart)))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "a2a_cancelfix.handler" in RUNTIME and "a2a_cancelfix._sdk" in RUNTIME
    assert loaded.stdout.strip() == "[]"


@pytest.mark.edges_only  # Its own interpreter, for what runs in process on every release (see noxfile.py).
def test_python_dash_m_runs_the_command() -> None:
    """``python -m a2a_cancelfix`` is the ``a2a-cancelfix`` command."""
    shown = subprocess.run(
        [sys.executable, "-m", "a2a_cancelfix", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert shown.stdout.startswith("usage: a2a-cancelfix")

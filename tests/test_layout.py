"""The package's layout: the runtime apart from the tools and the testing kit, and public names
that are the documented ones."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import a2a_cancelfix

ROOT = Path(__file__).parents[1]
DOCS = "\n".join(page.read_text() for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
"""The README and docs/, where every public name is documented."""

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
    "a2a_cancelfix.testing.examples": {"Pipeline", "card", "claim_released"},
}
"""Every public module and the names it exports; each named in the README or docs/."""

RUNTIME = sorted(
    f"a2a_cancelfix.{module.name}"
    for module in pkgutil.iter_modules(a2a_cancelfix.__path__)
    if not module.ispkg and module.name != "__main__"
)
"""What a server imports: every module of the package itself, none of its subpackages."""


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_a_public_module_exports_exactly_its_documented_names(module: str) -> None:
    """``__all__`` is the set the docs document, and every name in it resolves."""
    exported = importlib.import_module(module).__all__
    assert set(exported) == PUBLIC[module]
    assert all(getattr(importlib.import_module(module), name) is not None for name in exported)
    # Named in the text or the examples: `name`, `module.name`, or imported.
    undocumented = [name for name in exported if not re.search(rf"[`.\s,(]{name}\b", DOCS)]
    assert not undocumented, f"{module} exports names the docs do not name: {undocumented}"


def test_every_runtime_module_that_is_not_public_is_named_private() -> None:
    """The layout says what is API: a runtime module or package is public, with its ``__all__``,
    or its name starts with ``_``."""
    modules = {
        f"a2a_cancelfix.{module.name}"
        for module in pkgutil.iter_modules(a2a_cancelfix.__path__)
        if module.name not in ("__main__", "tools")
    }
    unmarked = sorted(m for m in modules if m not in PUBLIC and not m.rsplit(".", 1)[1].startswith("_"))
    assert unmarked == []


def test_the_handlers_constructor_has_no_test_hook() -> None:
    """Only the SDK's arguments and our documented options: the kit's hooks are private."""
    options = set(inspect.signature(a2a_cancelfix.DefaultRequestHandler.__init__).parameters)
    assert options == {
        "self",
        "agent_executor",
        "args",
        "kwargs",
        "cancel_grace_period",
        "on_parked",
        "on_canceled",
        "replica_poll_interval",
        "cancel_unwatched_after",
        "cancel_unwatched_parked",
        "shutdown_drain_time",
        "lease_time",
        "sole_replica",
    }


def test_no_module_of_the_testing_kit_is_over_600_lines() -> None:
    """One home per concept: a module of the kit that grows past this holds more than one."""
    kit = Path(a2a_cancelfix.__file__).parent / "testing"
    lines = {path.name: len(path.read_text().splitlines()) for path in sorted(kit.glob("*.py"))}
    assert {name: count for name, count in lines.items() if count > 600} == {}


def test_no_runtime_module_is_over_about_600_lines() -> None:
    """The same for the runtime; but _sdk.py, the one module that may touch the SDK's insides."""
    package = Path(a2a_cancelfix.__file__).parent
    lines = {
        str(path.relative_to(package)): len(path.read_text().splitlines())
        for path in sorted([*package.glob("*.py"), *package.glob("_cancel/*.py")])
        if path.name != "_sdk.py"
    }
    assert {name: count for name, count in lines.items() if count > 640} == {}


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
    assert "a2a_cancelfix._handler" in RUNTIME and "a2a_cancelfix._sdk" in RUNTIME
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


# Every attribute the package assigns on an object other than ``self`` or ``cls``, by module:
# each on an object its own module defines or builds (and, in _patching.py, the SDK's class,
# which is what patch() is for; in _exit_signal.py, sse-starlette's switch that ends streams). A new one fails here, so that an object is given what it
# needs when it is built, not configured from another module afterwards.
ASSIGNED_ELSEWHERE = {
    ("_sdk.py", "canceled.status.state"),  # a Task it has just copied
    ("checkpoints.py", "run.unwinding"),  # Run
    ("_executor.py", "proxy._self_lifecycle"),  # the proxy its _of() builds
    ("_cancel/queues.py", "run.task_ended"),  # Work, by its RunQueue
    ("_patching.py", "sdk.__init__"),
    ("_patching.py", "setattr(sdk, ...)"),
    ("_patching.py", "DefaultRequestHandlerV2.__init__"),
    ("store.py", "VersionedFinalStateTaskStore.__qualname__"),  # the class it makes
    ("testing/_probe.py", "probe._in_enqueue"),  # Probe
    ("testing/servers.py", "server.calls"),  # Server
    ("testing/sweep.py", "row.point"),  # Row
    ("testing/sweep.py", "row.expected"),
    ("testing/_origins.py", "row.answer"),
    ("_unwatched.py", "sender.task_id"),  # Observer
    ("_exit_signal.py", "self._status.should_exit"),  # sse-starlette's AppStatus, as its docs say
    ("testing/_probe.py", "driven.__name__"),  # The coroutine it made, named as the one it drives
    ("testing/_probe.py", "driven.__qualname__"),
}


def _assigned_elsewhere(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
        ):
            found.add(f"{node.func.id}({ast.unparse(node.args[0])}, ...)")
        for target in targets:
            for part in ast.walk(target):
                mine = isinstance(part, ast.Attribute) and ast.unparse(part.value) in ("self", "cls")
                if (
                    isinstance(part, ast.Attribute)
                    and isinstance(part.ctx, (ast.Store, ast.Del))
                    and not mine
                ):
                    found.add(ast.unparse(part))
    return found


def test_no_module_assigns_the_attributes_of_another_modules_objects() -> None:
    """The attributes assigned on objects other than ``self`` are the known ones above."""
    root = Path(a2a_cancelfix.__file__).parent
    assigned = {
        (path.relative_to(root).as_posix(), target)
        for path in sorted(root.rglob("*.py"))
        for target in _assigned_elsewhere(ast.parse(path.read_text()))
    }
    assert assigned == ASSIGNED_ELSEWHERE


def test_a_docstring_names_our_modules_as_they_are_named() -> None:
    """A `module.name` in our code's text names one of our modules by its name (`_replicas`,
    not `replicas`) and something that module has."""
    package = Path(a2a_cancelfix.__file__).parent
    modules: dict[str, list[str]] = {}
    for module in pkgutil.walk_packages(a2a_cancelfix.__path__, "a2a_cancelfix."):
        modules.setdefault(module.name.rsplit(".", 1)[1], []).append(module.name)

    def resolves(first: str, rest: str) -> bool:
        for name in modules.get(first, ()):
            found: object = importlib.import_module(name)
            for part in rest.split("."):
                found = getattr(found, part, None)
            if found is not None:
                return True
        return False

    stale = [
        f"{path.relative_to(package)}: `{first}.{rest}`"
        for path in sorted(package.rglob("*.py"))
        for first, rest in re.findall(r"(?<![`\w])`([A-Za-z_]\w*)\.([\w.]+)`(?!`)", path.read_text())
        if (first in modules or f"_{first}" in modules) and not resolves(first, rest)
    ]
    assert stale == []

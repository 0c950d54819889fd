"""`a2a-cancelfix check --repro`: a standalone script for each scenario the stock SDK fails here."""

import ast
import fnmatch
import importlib
import inspect
import pkgutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from a2a_cancelfix.testing import BOUND
from a2a_cancelfix.tools import cli, repro, repro_scripts, scenarios
from a2a_cancelfix.tools.repro_scripts import prelude
from a2a_cancelfix.tools.scenarios import SCENARIOS

from .expected import COLUMNS, STOCK, column
from .support import PYPROJECT, ROOT, noxfile_list

SCRIPT_TIMEOUT = 60
"""Seconds a script may take: its own waits are bounded at 2.5 s each."""
FORKS = f"""
import os, runpy, signal, sys

class NoCancelfix:
    \"\"\"Refuse a2a_cancelfix, installed or not: the script must stand alone.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "a2a_cancelfix":
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)")
        return None

sys.meta_path.insert(0, NoCancelfix())
import a2a.server.request_handlers, a2a.server.tasks, a2a.types, httpx  # What the scripts import.

for line in sys.stdin:
    script = line.rstrip("\\n")
    child = os.fork()
    if child == 0:  # The script's interpreter: it runs the script, then exits as one does.
        signal.alarm({SCRIPT_TIMEOUT})
        os.chdir(os.path.dirname(script))
        for fd, suffix in ((1, ".out"), (2, ".err")):
            os.dup2(os.open(script + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.argv = [script]
        runpy.run_path(script, run_name="__main__")
        sys.exit(0)
    print(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]), flush=True)
"""
"""Read script paths, one a line; run each in a fork of this isolated interpreter (-I), which has
imported what the scripts import and where a2a_cancelfix cannot be imported; print its exit status
(its stdout and stderr are in SCRIPT.out and SCRIPT.err)."""
ALLOWED = {"a2a", "httpx"}  # httpx: a2a-sdk's own dependency, for its push sender

# Where stock fails a scenario over the wire only, by the README's column: its in-process
# script passes (on 1.1.5 the second cancel hangs only when it comes over a connection; on
# 1.2.2 it is refused only when it comes over a connection of its own).
WIRE_ONLY = {
    COLUMNS.index("1.1.5"): ("second cancel while the first saves CANCELED",),
    COLUMNS.index("1.2.2"): ("two clients cancel at once",),
}
FAILED_BY_STOCK = [s for s in SCENARIOS if STOCK[s.name][column()] != s.expected and not s.opt_in]
"""The scenarios the stock handler fails on the installed a2a-sdk, as the README table says."""


@pytest.fixture(scope="module")
def standalone() -> Iterator[Callable[[Path], subprocess.CompletedProcess[str]]]:
    """Run a script as on its own: in a fork of an interpreter that imported a2a-sdk once (each
    fresh interpreter spent over a second of CPU on it), a2a_cancelfix blocked."""
    forks = subprocess.Popen(
        [sys.executable, "-I", "-c", FORKS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert forks.stdin is not None and forks.stdout is not None

    def run(script: Path) -> subprocess.CompletedProcess[str]:
        forks.stdin.write(f"{script}\n")
        forks.stdin.flush()
        status = forks.stdout.readline()  # The fork's alarm bounds the wait.
        assert status, "the interpreter that forks the scripts is gone"
        output, errors = (Path(f"{script}{suffix}").read_text() for suffix in (".out", ".err"))
        return subprocess.CompletedProcess(str(script), int(status), output, errors)

    try:
        yield run
    finally:
        forks.stdin.close()
        forks.wait(SCRIPT_TIMEOUT)


def ends_on_its_assertion(result: subprocess.CompletedProcess[str]) -> bool:
    """Whether a script exited 1 on an AssertionError (as `check --repro` wants it to)."""
    lines = result.stderr.strip().splitlines()
    return result.returncode == 1 and bool(lines) and lines[-1].startswith("AssertionError: ")


@pytest.mark.parametrize("scenario", FAILED_BY_STOCK, ids=[s.name for s in FAILED_BY_STOCK])
def test_each_script_fails_on_stock_on_its_assertion(
    scenario, standalone, capsys, monkeypatch, tmp_path: Path
) -> None:
    """For a scenario stock fails here, the printed script imports only a2a-sdk and the standard
    library, runs where a2a_cancelfix cannot be imported, and fails on its assertion, with no
    deprecated call of the SDK's on the way."""
    if scenarios._wire.missing(scenario.transport):
        pytest.skip(f"{scenario.transport} is not installed: check does not run the scenario")
    runs: list[subprocess.CompletedProcess[str]] = []

    def fails_standalone(script: str) -> bool:
        # check runs its script to see it fail: here that run is the standalone one, so each
        # script runs once (a hang's bounded waits each time). The next test runs check's own.
        path = tmp_path / "repro.py"
        path.write_text(script)
        runs.append(standalone(path))
        return ends_on_its_assertion(runs[-1])

    monkeypatch.setattr(repro, "_fails", fails_standalone)
    if cli.main(["check", "--repro", scenario.name]) == 2:
        # Stock fails it over the wire only, where no in-process script can show it: a reason.
        assert "does not reproduce it here" in capsys.readouterr().err
        assert scenario.name in WIRE_ONLY.get(column(), ()), scenario.name
        return
    script = tmp_path / "repro.py"
    assert capsys.readouterr().out.strip() == script.read_text().strip()  # The one it ran.
    imported = {
        (node.module if isinstance(node, ast.ImportFrom) else alias.name).partition(".")[0]
        for node in ast.walk(ast.parse(script.read_text()))
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0)
        for alias in node.names
    }
    assert imported - {"__future__"} <= set(sys.stdlib_module_names) | ALLOWED
    assert f"\nEXPECTED = {scenario.expected!r}\n" in script.read_text()
    (result,) = runs
    # "AssertionError: expected '...', got '...'"; on a loaded machine, maybe an earlier bounded wait's.
    assert ends_on_its_assertion(result), result.stderr
    assert "ModuleNotFoundError" not in result.stderr and "ImportError" not in result.stderr
    assert "deprecated" not in result.stderr and "no longer uses" not in result.stderr, result.stderr


def test_check_prints_a_script_only_once_it_saw_it_fail_on_its_assertion(capsys) -> None:
    """`check --repro`'s own run of its script (patched out above): a script that fails on its
    assertion is printed; one that passes, or fails otherwise, proves nothing."""
    # Stock ends the sender's stream on WORKING on every release.
    assert cli.main(["check", "--repro", "mid-run, sender's stream"]) == 0
    assert "\nEXPECTED = " in capsys.readouterr().out
    assert repro._fails("assert False, 'the defect'\n")
    assert not repro._fails("print('no defect here')\n")
    assert not repro._fails("raise RuntimeError('not the assertion')\n")


def test_a_script_that_imports_a2a_cancelfix_is_caught(standalone, tmp_path: Path) -> None:
    """The self-containment check works: a script importing a2a_cancelfix fails to import it."""
    script = tmp_path / "leans_on_us.py"
    script.write_text("import a2a_cancelfix\n")
    result = standalone(script)
    assert result.returncode == 1 and "No module named 'a2a_cancelfix' (blocked)" in result.stderr


def test_an_unknown_scenario_is_refused_with_the_names(capsys) -> None:
    """--repro of a name no scenario has exits 2 and lists the scenarios."""
    assert cli.main(["check", "--repro", "no such scenario"]) == 2
    error = capsys.readouterr().err
    assert "no scenario is named 'no such scenario'" in error and "  cancel() hangs" in error


def test_a_scenario_stock_passes_has_no_script(capsys) -> None:
    """--repro of a scenario the installed stock SDK passes exits 2 and says so."""
    assert cli.main(["check", "--repro", "unknown task id"]) == 2
    captured = capsys.readouterr()
    assert (
        captured.out == ""
        and "passes 'unknown task id' (TaskNotFound): there is nothing to reproduce" in captured.err
    )


def test_a_scenario_that_cannot_run_has_no_script(monkeypatch, capsys) -> None:
    """--repro of a scenario whose transport is not installed exits 2 and says what to install."""
    hint = "pip install 'a2a-sdk[grpc]'"
    monkeypatch.setattr(scenarios._wire, "missing", lambda transport: hint if transport == "grpc" else None)
    assert cli.main(["check", "--repro", "client leaves mid-cancel, gRPC"]) == 2
    assert f"cannot run here: NOT RUN ({hint})" in capsys.readouterr().err


def test_every_scenario_names_its_part_of_a_script() -> None:
    """A scenario added to the list gets a script too, whichever release it fails on: each one but
    an opt-in names its module of repro_scripts/ by its ``script``, and every module there is named."""
    named = {scenario.script for scenario in SCENARIOS if not scenario.opt_in}
    assert "" not in named and not any(scenario.script for scenario in SCENARIOS if scenario.opt_in)
    assert named == {module.name for module in pkgutil.iter_modules(repro_scripts.__path__)} - {"prelude"}


def test_the_scripts_are_files_that_ruff_and_mypy_check() -> None:
    """repro_scripts/ lies within what `nox -s lint` checks and [tool.mypy]'s files, excluded from
    neither, and mypy checks it plainly, as the tools: the scripts are the user's to read and edit."""
    scripts = Path(repro_scripts.__file__).parent.relative_to(ROOT)
    ruff, mypy = PYPROJECT["tool"]["ruff"], PYPROJECT["tool"]["mypy"]
    assert any(scripts.is_relative_to(path) for path in noxfile_list("LINTED"))
    assert not {"exclude", "extend-exclude"} & set(ruff)
    assert any(scripts.is_relative_to(path) for path in mypy["files"]) and "exclude" not in mypy
    (plain,) = (
        override
        for override in mypy["overrides"]
        if any(fnmatch.fnmatch(prelude.__name__, module) for module in override["module"])
    )
    assert plain["disallow_untyped_defs"] is False


def test_a_script_is_the_prelude_then_its_scenarios_part_less_its_imports() -> None:
    """What a part imports, which its script leaves out, the prelude has or imports too; each
    script defines what it runs, waits within the scenarios' bound and imports nothing of ours."""
    made = imports(inspect.getsource(prelude))
    for scenario in (scenario for scenario in SCENARIOS if scenario.script):
        part = importlib.import_module(f"{repro_scripts.__name__}.{scenario.script}")
        assert {(m, name) for m, name in imports(inspect.getsource(part)) if m != ".prelude"} <= made
        script = repro._script(scenario, "HANG")
        defined = {node.name for node in ast.parse(script).body if isinstance(node, ast.AsyncFunctionDef)}
        assert "scenario" in defined, scenario.script
        packages = {(module or name).partition(".")[0] for module, name in imports(script)}
        assert packages <= {"__future__", *ALLOWED, *sys.stdlib_module_names}, scenario.script
    assert prelude.BOUND == BOUND


def imports(source: str) -> set[tuple[str, str]]:
    """What a module imports at its top: (module, name), or ("", module) for ``import module``."""
    found = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            found |= {("", alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found |= {("." * node.level + (node.module or ""), alias.name) for alias in node.names}
    return found

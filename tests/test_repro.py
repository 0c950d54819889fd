"""`a2a-cancelfix check --repro`: a standalone script for each scenario the stock SDK fails here."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from a2a_cancelfix.tools import cli, repro, scenarios
from a2a_cancelfix.tools.scenarios import SCENARIOS

from .expected import COLUMNS, STOCK, column

STANDALONE = """
import runpy, sys

class NoCancelfix:
    \"\"\"Refuse a2a_cancelfix, installed or not: the script must stand alone.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "a2a_cancelfix":
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)")
        return None

sys.meta_path.insert(0, NoCancelfix())
runpy.run_path(sys.argv[1], run_name="__main__")
"""
"""Run a script (argv[1]) where a2a_cancelfix cannot be imported."""
SCRIPT_TIMEOUT = 60.0
"""Seconds a script may take: its own waits are bounded at 2.5 s each."""
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


def run_standalone(script: Path) -> subprocess.CompletedProcess[str]:
    """Run ``script`` isolated (-I: no cwd, no PYTHONPATH, no user site) with a2a_cancelfix blocked."""
    return subprocess.run(
        [sys.executable, "-I", "-c", STANDALONE, str(script)],
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT,
        cwd=script.parent,
    )


def printed_script(name: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> Path:
    assert cli.main(["check", "--repro", name]) == 0
    script = tmp_path / "repro.py"
    script.write_text(capsys.readouterr().out)
    return script


def ends_on_its_assertion(result: subprocess.CompletedProcess[str]) -> bool:
    """Whether a script exited 1 on an AssertionError (as `check --repro` wants it to)."""
    lines = result.stderr.strip().splitlines()
    return result.returncode == 1 and bool(lines) and lines[-1].startswith("AssertionError: ")


@pytest.mark.parametrize("scenario", FAILED_BY_STOCK, ids=[s.name for s in FAILED_BY_STOCK])
def test_each_script_fails_on_stock_on_its_assertion(scenario, capsys, monkeypatch, tmp_path: Path) -> None:
    """For a scenario stock fails here, the printed script imports only a2a-sdk and the standard
    library, runs where a2a_cancelfix cannot be imported, and fails on its assertion."""
    if scenarios._wire.missing(scenario.transport):
        pytest.skip(f"{scenario.transport} is not installed: check does not run the scenario")
    runs: list[subprocess.CompletedProcess[str]] = []

    def fails_standalone(script: str) -> bool:
        # check runs its script to see it fail: here that run is the standalone one, so each
        # script runs once (an interpreter importing a2a-sdk, and for a hang its bounded waits).
        # The test after this one runs check's own.
        path = tmp_path / "repro.py"
        path.write_text(script)
        runs.append(run_standalone(path))
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


def test_check_prints_a_script_only_once_it_saw_it_fail_on_its_assertion(capsys) -> None:
    """`check --repro`'s own run of its script (patched out above): a script that fails on its
    assertion is printed; one that passes, or fails otherwise, proves nothing."""
    # Stock ends the sender's stream on WORKING on every release.
    assert cli.main(["check", "--repro", "mid-run, sender's stream"]) == 0
    assert "\nEXPECTED = " in capsys.readouterr().out
    assert repro._fails("assert False, 'the defect'\n")
    assert not repro._fails("print('no defect here')\n")
    assert not repro._fails("raise RuntimeError('not the assertion')\n")


def test_a_script_that_imports_a2a_cancelfix_is_caught(tmp_path: Path) -> None:
    """The self-containment check works: a script importing a2a_cancelfix fails to import it."""
    script = tmp_path / "leans_on_us.py"
    script.write_text("import a2a_cancelfix\n")
    result = run_standalone(script)
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


def test_every_scenario_has_a_script() -> None:
    """A scenario added to the list gets a script too, whichever release it fails on."""
    assert set(repro._BODIES) == {scenario.name for scenario in SCENARIOS if not scenario.opt_in}

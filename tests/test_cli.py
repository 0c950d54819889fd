"""The `a2a-cancelfix check` command: table, JSON, verdict and exit status."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from a2a_cancelfix import __main__ as cli
from a2a_cancelfix import scenarios


@pytest.fixture
def two_scenarios(monkeypatch):
    """Run a short list of scenarios, so the command's wiring is tested quickly."""
    chosen = tuple(s for s in scenarios.SCENARIOS if s.name in ("mid-run, cancel() empty", "cancel() hangs"))
    monkeypatch.setattr(scenarios, "SCENARIOS", chosen)
    return chosen


def test_check_prints_json_and_succeeds(two_scenarios, capsys) -> None:
    """--json lists each scenario with stock, wrapped and our outcome, and exits 0 when ours hold."""
    assert cli.main(["check", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [row["scenario"] for row in report["scenarios"]] == [s.name for s in two_scenarios]
    assert all(row["holds"] and row["ours"] == row["expected"] for row in report["scenarios"])
    assert report["scenarios"][1]["stock"] == "HANG"
    assert report["needed"] is True and "still needs a2a-cancelfix" in report["verdict"]


def test_check_table_ends_with_the_verdict(two_scenarios, capsys) -> None:
    """The table has a column per handler and one verdict line at the end."""
    assert cli.main(["check"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "stock + CancellableExecutor" in lines[0] and "a2a-cancelfix handler" in lines[0]
    assert lines[-1].startswith("a2a-sdk ") and "still needs a2a-cancelfix" in lines[-1]


def test_check_fails_when_a_scenario_does_not_hold(two_scenarios, monkeypatch, capsys) -> None:
    """If our handler misses a scenario, the command says so and exits non-zero."""
    broken = (replace(two_scenarios[0], expected="something else"),)
    monkeypatch.setattr(scenarios, "SCENARIOS", broken)
    assert cli.main(["check"]) == 1
    assert "does NOT fix every scenario" in capsys.readouterr().out


def test_runs_as_a_module() -> None:
    """`python -m a2a_cancelfix` is the same command."""
    result = subprocess.run(
        [sys.executable, "-m", "a2a_cancelfix", "check", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "--json" in result.stdout


def test_check_says_when_the_package_can_go(monkeypatch, capsys) -> None:
    """When the stock handler passes every scenario, the verdict says to remove the package."""
    fine = tuple(s for s in scenarios.SCENARIOS if s.name == "cancel() publishes CANCELED")
    monkeypatch.setattr(scenarios, "SCENARIOS", fine)
    assert cli.main(["check"]) == 0
    assert "you can remove a2a-cancelfix" in capsys.readouterr().out.strip().splitlines()[-1]


def test_a_transport_not_installed_is_named_and_keeps_the_package(monkeypatch, capsys) -> None:
    """Without the packages for a scenario's transport, its row says NOT RUN and what to install,
    and the verdict does not tell the user to remove the package on the rows that did run."""
    chosen = ("cancel() publishes CANCELED", "client leaves mid-cancel, gRPC")
    monkeypatch.setattr(scenarios, "SCENARIOS", tuple(s for s in scenarios.SCENARIOS if s.name in chosen))
    hint = "pip install 'a2a-sdk[grpc]'"
    monkeypatch.setattr(scenarios._wire, "missing", lambda transport: hint if transport == "grpc" else None)
    assert cli.main(["check"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    grpc_row = next(line for line in lines if line.startswith("client leaves mid-cancel, gRPC"))
    assert grpc_row.count("NOT RUN (pip install 'a2a-sdk[grpc]')") == 3
    assert "passes the 1 scenarios that ran" in lines[-1] and "a2a-sdk[grpc]" in lines[-1]
    assert "you can remove" not in lines[-1]

"""The `a2a-cancelfix check` command: table, JSON, verdict and exit status."""

import json
import subprocess
import sys
from dataclasses import replace
from importlib.metadata import version

import pytest

import a2a_cancelfix
from a2a_cancelfix.tools import check, cli, scenarios
from a2a_cancelfix.tools.check import EXIT_CODES

GRPC_HINT = "pip install 'a2a-sdk[grpc]'"


@pytest.fixture
def two_scenarios(monkeypatch):
    """Run a short list of scenarios, so the command's wiring is tested quickly."""
    chosen = tuple(s for s in scenarios.SCENARIOS if s.name in ("mid-run, cancel() empty", "cancel() hangs"))
    monkeypatch.setattr(scenarios, "SCENARIOS", chosen)
    return chosen


@pytest.fixture
def one_stock_passes(monkeypatch):
    """Run one scenario the stock handler passes on every release."""
    fine = tuple(s for s in scenarios.SCENARIOS if s.name == "cancel() publishes CANCELED")
    monkeypatch.setattr(scenarios, "SCENARIOS", fine)
    return fine


@pytest.fixture
def grpc_missing(monkeypatch):
    """One scenario stock passes and the gRPC one, with the gRPC packages said to be missing."""
    chosen = ("cancel() publishes CANCELED", "client leaves mid-cancel, gRPC")
    monkeypatch.setattr(scenarios, "SCENARIOS", tuple(s for s in scenarios.SCENARIOS if s.name in chosen))
    monkeypatch.setattr(
        scenarios._wire, "missing", lambda transport: GRPC_HINT if transport == "grpc" else None
    )


def verdict_lines(output: str) -> list[str]:
    """What follows the table: the verdict and the lines under it."""
    lines = output.strip().splitlines()
    return lines[lines.index("") + 1 :]


PASSES = {"stock": "CANCELED", "wrapped": "CANCELED", "ours": "CANCELED"}
GRPC_NOT_RUN = check.ScenarioOutcomes(
    "client leaves mid-cancel, gRPC", dict.fromkeys(PASSES, f"NOT RUN ({GRPC_HINT})"), "task ends CANCELED"
)


def report_on(monkeypatch, *rows: check.ScenarioOutcomes) -> None:
    """Have check report ``rows`` as if its scenarios had run them: the verdict and the exit
    status alone, whatever a loaded machine makes of a real scenario's 2.5 s bound."""
    monkeypatch.setattr(check, "run_all", lambda: list(rows))


def test_check_prints_json_and_succeeds(monkeypatch, capsys) -> None:
    """--json lists each scenario with stock, wrapped and our outcome, the scenarios stock fails
    and those not run, and exits 0 when ours hold."""
    # Rows as given: real runs, four at once in one process, outlived a scenario's 2.5 s bound
    # on a loaded machine; test_check_fails_when_a_scenario_does_not_hold runs real ones.
    named = ("mid-run, cancel() empty", "cancel() hangs")
    report_on(
        monkeypatch,
        check.ScenarioOutcomes(named[0], {**PASSES, "stock": "WORKING / WORKING"}, "CANCELED"),
        check.ScenarioOutcomes(named[1], {**PASSES, "stock": "HANG"}, "CANCELED"),
    )
    assert cli.main(["check", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [row["scenario"] for row in report["scenarios"]] == list(named)
    assert all(row["holds"] and row["ours"] == row["expected"] for row in report["scenarios"])
    assert report["scenarios"][1]["stock"] == "HANG"
    assert report["needed"] is True and "still needs a2a-cancelfix" in report["verdict"]
    assert report["stock_fails"] == [
        row["scenario"] for row in report["scenarios"] if row["stock"] != row["expected"]
    ]
    assert "cancel() hangs" in report["stock_fails"]
    assert report["ours_fails"] == [] and report["not_run"] == {} and report["removable"] is False


def test_check_table_ends_with_the_verdict_naming_what_stock_fails(monkeypatch, capsys) -> None:
    """The table has a column per handler; under it, the verdict, then each scenario stock fails
    with what stock showed, and how to get a script for an upstream report."""
    fixed = {"stock": "CANCELED", "wrapped": "CANCELED", "ours": "CANCELED"}
    rows = [
        check.ScenarioOutcomes("stays WORKING", {**fixed, "stock": "WORKING"}, "CANCELED"),
        check.ScenarioOutcomes("fixed upstream", fixed, "CANCELED"),
        check.ScenarioOutcomes("hangs", {**fixed, "stock": "HANG"}, "CANCELED"),
    ]
    monkeypatch.setattr(check, "run_all", lambda: rows)
    assert cli.main(["check"]) == 0
    output = capsys.readouterr().out
    assert "stock + CancellableExecutor" in output.splitlines()[0] and "a2a-cancelfix handler" in output
    verdict, *under = verdict_lines(output)
    assert verdict.startswith("a2a-sdk ") and verdict.endswith(
        "still needs a2a-cancelfix: the stock handler fails 2 of the 3 scenarios that ran:"
    )
    assert under == [
        '  - stays WORKING: stock "WORKING", expected "CANCELED"',
        '  - hangs: stock "HANG", expected "CANCELED"',
        'To report one upstream: a2a-cancelfix check --repro "SCENARIO" prints a script for it.',
    ]


def test_check_fails_when_a_scenario_does_not_hold(two_scenarios, monkeypatch, capsys) -> None:
    """If our handler misses a scenario, the command names it and exits 1, with or without
    --fail-when-removable."""
    broken = (replace(two_scenarios[0], expected="something else"),)
    monkeypatch.setattr(scenarios, "SCENARIOS", broken)
    assert cli.main(["check"]) == 1
    verdict, *under = verdict_lines(capsys.readouterr().out)
    assert "does NOT fix every scenario" in verdict
    (named,) = under  # What ours showed is whatever the (loaded) machine let it show.
    assert named.startswith('  - mid-run, cancel() empty: ours "') and named.endswith(
        '", expected "something else"'
    )
    assert cli.main(["check", "--fail-when-removable"]) == 1


@pytest.mark.edges_only  # Its own interpreter, for what runs in process on every release (see noxfile.py).
def test_runs_as_a_module() -> None:
    """`python -m a2a_cancelfix` is the same command."""
    result = subprocess.run(
        [sys.executable, "-m", "a2a_cancelfix", "check", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "--json" in result.stdout


def test_check_help_describes_the_command_and_its_exit_codes(capsys) -> None:
    """`check --help` says what the command does, each option, and what each exit status means."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["check", "--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "verdict on whether this a2a-sdk still needs a2a-cancelfix" in text
    for option in ("--json", "--fail-when-removable", "--repro SCENARIO"):
        assert option in text
    assert "exit status:" in text
    for code, meaning in EXIT_CODES.items():
        assert f"{code} {meaning}" in text
    assert set(EXIT_CODES) == {0, 1, 2, 3}


def test_check_says_when_the_package_can_go(one_stock_passes, capsys) -> None:
    """When the stock handler passes every scenario, the verdict says to remove the package."""
    assert cli.main(["check"]) == 0
    assert "you can remove a2a-cancelfix" in verdict_lines(capsys.readouterr().out)[0]


def test_fail_when_removable_exits_3_once_the_package_can_go(monkeypatch, capsys) -> None:
    """Every scenario ran and stock passes each: exit 0, or 3 with --fail-when-removable; the
    JSON says removable."""
    report_on(monkeypatch, check.ScenarioOutcomes("fixed upstream", PASSES, "CANCELED"))
    assert cli.main(["check"]) == 0
    assert cli.main(["check", "--fail-when-removable"]) == 3
    capsys.readouterr()
    assert cli.main(["check", "--json", "--fail-when-removable"]) == 3
    assert json.loads(capsys.readouterr().out)["removable"] is True


def test_a_needed_package_is_not_removable(monkeypatch) -> None:
    """While stock fails a scenario, or one did not run, --fail-when-removable exits 0."""
    report_on(monkeypatch, check.ScenarioOutcomes("hangs", {**PASSES, "stock": "HANG"}, "CANCELED"))
    assert cli.main(["check", "--fail-when-removable"]) == 0
    report_on(monkeypatch, check.ScenarioOutcomes("fixed upstream", PASSES, "CANCELED"), GRPC_NOT_RUN)
    assert cli.main(["check", "--fail-when-removable"]) == 0


def test_a_transport_not_installed_is_named_and_keeps_the_package(grpc_missing, capsys) -> None:
    """Without the packages for a scenario's transport, its row says NOT RUN and what to install,
    the verdict names it, and neither the verdict nor the exit status says the package can go
    on the rows that did run."""
    assert cli.main(["check"]) == 0
    output = capsys.readouterr().out
    grpc_row = next(line for line in output.splitlines() if line.startswith("client leaves mid-cancel, gRPC"))
    assert grpc_row.count(f"NOT RUN ({GRPC_HINT})") == 3
    verdict, *under = verdict_lines(output)
    assert "passes the 1 scenarios that ran" in verdict and "you can remove" not in verdict
    assert f"NOT RUN: client leaves mid-cancel, gRPC ({GRPC_HINT})" in under


def test_json_says_what_was_not_run(monkeypatch, capsys) -> None:
    """--json names each scenario that did not run, with what to install."""
    report_on(monkeypatch, check.ScenarioOutcomes("fixed upstream", PASSES, "CANCELED"), GRPC_NOT_RUN)
    assert cli.main(["check", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["not_run"] == {"client leaves mid-cancel, gRPC": GRPC_HINT}
    assert report["removable"] is False and report["stock_fails"] == [] and report["ours_fails"] == []


def test_the_verdict_names_what_did_not_run_beside_what_stock_fails(monkeypatch, capsys) -> None:
    """A scenario stock fails and the gRPC one not run: the verdict counts only the scenarios
    that ran, names the failing one and the one not run."""
    hangs = check.ScenarioOutcomes("cancel() hangs", {**PASSES, "stock": "HANG"}, "CANCELED")
    report_on(monkeypatch, hangs, GRPC_NOT_RUN)
    assert cli.main(["check"]) == 0
    verdict, *under = verdict_lines(capsys.readouterr().out)
    assert verdict.endswith(
        "still needs a2a-cancelfix: the stock handler fails 1 of the 1 scenarios that ran:"
    )
    assert under[:2] == [
        '  - cancel() hangs: stock "HANG", expected "CANCELED"',
        f"NOT RUN: client leaves mid-cancel, gRPC ({GRPC_HINT})",
    ]


def test_version_prints_the_installed_package_and_sdk(capsys) -> None:
    """``--version`` prints the version the package was installed as, and the a2a-sdk it runs on."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    expected = f"a2a-cancelfix {version('a2a-cancelfix')} (a2a-sdk {version('a2a-sdk')})"
    assert capsys.readouterr().out.strip() == expected
    assert a2a_cancelfix.__version__ == version("a2a-cancelfix")


@pytest.mark.parametrize(
    "command", ["check", "sweep a2a_cancelfix.testing.examples:Pipeline", "demo", "play x.toml"]
)
def test_an_unknown_option_is_told_with_the_commands_usage(command: str, capsys) -> None:
    """`check --fast` exits 2 with `check`'s usage, which lists what it takes; argparse
    printed the top-level one, which lists none of its options."""
    with pytest.raises(SystemExit) as exited:
        cli.main([*command.split(), "--fast"])
    assert exited.value.code == 2
    said = capsys.readouterr().err
    assert (
        said.startswith(f"usage: a2a-cancelfix {command.split()[0]} ")
        and "unrecognized arguments: --fast" in said
    )

"""The README's behaviour tables are the ones the tests assert; its testing recipes run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from a2a_cancelfix.tools.scenarios import SCENARIOS

from .expected import COLUMNS, STOCK, WRAPPED

README = Path(__file__).parent.parent / "README.md"


def table_after(heading: str) -> list[list[str]]:
    """The rows of the first markdown table after ``heading``."""
    lines = README.read_text().split(heading, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return [row for row in rows if not set("".join(row)) <= {"-"}]


def test_behaviour_table_matches_the_tests() -> None:
    """Stock columns and our column say exactly what the tests assert."""
    header, *rows = table_after("## Behaviour per a2a-sdk version")
    assert header == ["scenario", *COLUMNS, "with a2a-cancelfix"]
    expected = {scenario.name: [*STOCK[scenario.name], scenario.expected] for scenario in SCENARIOS}
    assert {row[0]: row[1:] for row in rows} == expected


def test_wrapper_table_matches_the_tests() -> None:
    """The wrapper-alone table lists exactly where the wrapper differs from the handler."""
    header, *rows = table_after("### If you cannot swap the handler")
    assert header == ["scenario", *COLUMNS]
    expected = {name: [cell or "as the handler" for cell in cells] for name, cells in WRAPPED.items()}
    assert {row[0]: row[1:] for row in rows} == expected


def recipe_blocks(language: str) -> list[str]:
    """The ``language`` code blocks of the section "Testing your executor"."""
    text = README.read_text().split("## Testing your executor", 1)[1].split("\n## ", 1)[0]
    blocks = [block.split("\n", 1) for block in text.split("```")[1::2]]
    return [body for info, body in blocks if info.strip() == language]


def needs_frameworks(block: str) -> bool:
    """Whether ``block`` needs a framework the default matrix does not install."""
    import importlib.util

    wanted = {"adk_agent": "google.adk", "langgraph_agent": "a2a_adapter"}
    for name, package in wanted.items():
        if name in block:
            try:
                found = importlib.util.find_spec(package) is not None
            except ModuleNotFoundError:
                found = False
            if not found:
                return True
    return False


@pytest.mark.edges_only  # Its own interpreter, for what runs in process on every release (see noxfile.py).
@pytest.mark.parametrize("number", range(len(recipe_blocks("python"))))
def test_the_testing_sections_python_runs_as_written(number: int, tmp_path: Path) -> None:
    """A test the README shows passes under pytest-asyncio's strict mode; an excerpt of a
    shipped example is word for word in that file."""
    block = recipe_blocks("python")[number]
    first, _, code = block.partition("\n")
    if first.startswith("# examples/"):
        assert code.strip() in (README.parent / first.removeprefix("# ")).read_text()
        return
    (tmp_path / "test_from_readme.py").write_text(block)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "asyncio_mode=strict"]
    result = subprocess.run(
        [*command, "-q", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout


@pytest.mark.edges_only  # Its own interpreter, for what runs in process on every release (see noxfile.py).
@pytest.mark.parametrize("number", range(len(recipe_blocks("bash"))))
def test_the_testing_sections_commands_run_as_written(number: int) -> None:
    """Each command the README shows exits 0, run from the repository as a user would."""
    block = recipe_blocks("bash")[number]
    if needs_frameworks(block):
        pytest.skip("needs the frameworks `nox -s frameworks` installs")
    environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        ["bash", "-e", "-c", block],
        cwd=README.parent,
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rows hold." in result.stdout

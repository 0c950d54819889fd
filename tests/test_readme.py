"""The README's behaviour tables are the ones the tests assert."""

from pathlib import Path

from a2a_cancelfix.scenarios import SCENARIOS

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

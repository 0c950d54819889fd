"""`a2a-cancelfix check`: the cancel scenarios on the installed a2a-sdk, stock vs ours, as a
table or as JSON, with a verdict on whether the package is still needed."""

from __future__ import annotations

import json
from dataclasses import dataclass

from a2a_cancelfix import scenarios
from a2a_cancelfix._sdk import SDK_VERSION
from a2a_cancelfix.scenarios import NOT_RUN
from a2a_cancelfix.testing.servers import HANDLERS


@dataclass
class Row:
    """One scenario's outcome under each handler kind, and what our handler must show."""

    scenario: str
    outcomes: dict[str, str]
    expected: str

    @property
    def ran(self) -> bool:
        return not self.outcomes["ours"].startswith(NOT_RUN)

    @property
    def holds(self) -> bool:
        return not self.ran or self.outcomes["ours"] == self.expected

    @property
    def stock_holds(self) -> bool:
        """Whether a client of the stock handler sees what the contract says (a row not run
        shows nothing either way)."""
        return not self.ran or self.outcomes["stock"] == self.expected


def run_all() -> list[Row]:
    """Run every scenario against every handler kind: a row per scenario."""
    return [Row(scenario.name, outcomes, scenario.expected) for scenario, outcomes in scenarios.run_all()]


def verdict(rows: list[Row]) -> str:
    if not all(row.holds for row in rows):
        return f"a2a-cancelfix does NOT fix every scenario on a2a-sdk {SDK_VERSION}: please report it."
    failing = [row.scenario for row in rows if not row.stock_holds]
    ran = [row for row in rows if row.ran]
    if failing:
        return (
            f"a2a-sdk {SDK_VERSION} still needs a2a-cancelfix: the stock handler fails "
            f"{len(failing)} of {len(ran)} scenarios."
        )
    if len(ran) < len(rows):
        not_run = [row.outcomes["ours"] for row in rows if not row.ran]
        hints = sorted({outcome.removeprefix(NOT_RUN).strip(" ()") for outcome in not_run})
        return (
            f"a2a-sdk {SDK_VERSION} passes the {len(ran)} scenarios that ran; run the other "
            f"{len(rows) - len(ran)} before removing a2a-cancelfix: {'; '.join(hints)}."
        )
    return f"a2a-sdk {SDK_VERSION} passes every scenario on its own: you can remove a2a-cancelfix."


_TITLES = {
    "stock": f"stock a2a-sdk {SDK_VERSION}",
    "wrapped": "stock + CancellableExecutor",
    "ours": "a2a-cancelfix handler",
}


def render(rows: list[Row]) -> str:
    table = [("scenario", *(_TITLES[kind] for kind in HANDLERS))]
    for row in rows:
        cells = [row.outcomes[kind] for kind in HANDLERS]
        if not row.holds:
            cells[-1] += "  (FAILS)"
        table.append((row.scenario, *cells))
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in table]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines + ["", verdict(rows)])


def as_json(rows: list[Row]) -> str:
    return json.dumps(
        {
            "a2a_sdk": SDK_VERSION,
            "scenarios": [
                {"scenario": row.scenario, **row.outcomes, "expected": row.expected, "holds": row.holds}
                for row in rows
            ],
            "needed": any(not row.stock_holds for row in rows),
            "verdict": verdict(rows),
        },
        indent=2,
    )

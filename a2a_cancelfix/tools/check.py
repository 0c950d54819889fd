"""`a2a-cancelfix check`: the cancel scenarios on the installed a2a-sdk, stock vs ours, as a
table or as JSON, with a verdict on whether the package is still needed."""

from __future__ import annotations

import json
from dataclasses import dataclass

from a2a_cancelfix._sdk import SDK_VERSION
from a2a_cancelfix.testing._table import table
from a2a_cancelfix.testing.servers import HANDLERS
from a2a_cancelfix.tools import scenarios
from a2a_cancelfix.tools.scenarios import NOT_RUN


@dataclass
class ScenarioOutcomes:
    """One scenario's outcome under each handler kind, and what our handler must show."""

    scenario: str
    outcomes: dict[str, str]
    expected: str
    opt_in: str = ""  # An option of ours the scenario shows: stock has none, and is not judged.

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
        return not self.ran or bool(self.opt_in) or self.outcomes["stock"] == self.expected


def run_all() -> list[ScenarioOutcomes]:
    """Run every scenario against every handler kind: a row per scenario."""
    return [
        ScenarioOutcomes(scenario.name, outcomes, scenario.expected, scenario.opt_in)
        for scenario, outcomes in scenarios.run_all()
    ]


EXIT_CODES = {
    0: "our handler holds every scenario that ran",
    1: "our handler fails a scenario: please report it",
    2: "usage error; or --repro has no script: unknown scenario, stock passes it, or it cannot run here",
    3: "with --fail-when-removable: stock a2a-sdk passes every scenario, so a2a-cancelfix can go",
}
OURS_FAIL, USAGE, REMOVABLE = 1, 2, 3


def exit_status(rows: list[ScenarioOutcomes], *, fail_when_removable: bool = False) -> int:
    """The command's exit status (``EXIT_CODES``) for ``rows``."""
    if not all(row.holds for row in rows):
        return OURS_FAIL
    return REMOVABLE if fail_when_removable and removable(rows) else 0


def removable(rows: list[ScenarioOutcomes]) -> bool:
    """Whether every scenario ran and the stock handler passes each: the package can go."""
    return all(row.ran and row.stock_holds for row in rows)


def verdict(rows: list[ScenarioOutcomes]) -> str:
    """One line on whether the package is still needed, then the scenarios that line rests on:
    those our handler fails, those the stock handler fails, and those that did not run."""
    ours_fail = [row for row in rows if not row.holds]
    stock_fails = [row for row in rows if not row.stock_holds]
    ran = [row for row in rows if row.ran]
    if ours_fail:
        lines = [f"a2a-cancelfix does NOT fix every scenario on a2a-sdk {SDK_VERSION}: please report it."]
        lines += [
            f'  - {row.scenario}: ours "{row.outcomes["ours"]}", expected "{row.expected}"'
            for row in ours_fail
        ]
    elif stock_fails:
        lines = [
            f"a2a-sdk {SDK_VERSION} still needs a2a-cancelfix: the stock handler fails "
            f"{len(stock_fails)} of the {len(ran)} scenarios that ran:"
        ]
        lines += [
            f'  - {row.scenario}: stock "{row.outcomes["stock"]}", expected "{row.expected}"'
            for row in stock_fails
        ]
    elif len(ran) < len(rows):
        lines = [
            f"a2a-sdk {SDK_VERSION} passes the {len(ran)} scenarios that ran; run the other "
            f"{len(rows) - len(ran)} before removing a2a-cancelfix."
        ]
    else:
        lines = [f"a2a-sdk {SDK_VERSION} passes every scenario on its own: you can remove a2a-cancelfix."]
    lines += [f"NOT RUN: {name} ({install})" for name, install in not_run(rows).items()]
    lines += [
        f"{row.scenario}: shows a2a-cancelfix's {row.opt_in}, which no a2a-sdk has; "
        "keep the package if you use it."
        for row in rows
        if row.opt_in
    ]
    if stock_fails and not ours_fail:
        lines.append('To report one upstream: a2a-cancelfix check --repro "SCENARIO" prints a script for it.')
    return "\n".join(lines)


def not_run(rows: list[ScenarioOutcomes]) -> dict[str, str]:
    """The scenarios that did not run, each with what to install to run it."""
    return {
        row.scenario: row.outcomes["ours"].removeprefix(NOT_RUN).strip(" ()") for row in rows if not row.ran
    }


_TITLES = {
    "stock": f"stock a2a-sdk {SDK_VERSION}",
    "wrapped": "stock + CancellableExecutor",
    "ours": "a2a-cancelfix handler",
}


def render(rows: list[ScenarioOutcomes]) -> str:
    cells: list[tuple[str, ...]] = [("scenario", *(_TITLES[kind] for kind in HANDLERS))]
    for row in rows:
        outcomes = [row.outcomes[kind] for kind in HANDLERS]
        if not row.holds:
            outcomes[-1] += "  (FAILS)"
        cells.append((row.scenario, *outcomes))
    return "\n".join([*table(cells), "", verdict(rows)])


def as_json(rows: list[ScenarioOutcomes]) -> str:
    return json.dumps(
        {
            "a2a_sdk": SDK_VERSION,
            "scenarios": [
                {"scenario": row.scenario, **row.outcomes, "expected": row.expected, "holds": row.holds}
                for row in rows
            ],
            "needed": any(not row.stock_holds for row in rows),
            "removable": removable(rows),
            "ours_fails": [row.scenario for row in rows if not row.holds],
            "stock_fails": [row.scenario for row in rows if not row.stock_holds],
            "not_run": not_run(rows),
            "verdict": verdict(rows),
        },
        indent=2,
    )

"""What a sweep says: a `Row` per cancel moment, the `Report`'s table, and the scenario file
that replays a row."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from a2a_cancelfix.testing._probe import Point
from a2a_cancelfix.testing._table import table


@dataclass
class Row:
    """What one cancel showed: where it landed, what each observer saw, what went wrong.

    Attributes:
        point: where the cancel landed (None for the uncancelled run).
        origin: one of `ORIGINS`, or "unwatched" ("" for the uncancelled run).
        landing: for an await, "as it returns", or during it: "interrupted" (the cancel's
            interrupt lands on it) or, in a shielded section, "while pending" (the cancel must
            wait for it); for a parked task, "alone" or "follow-up racing".
        answer: what the cancel answered: a state, an A2A error's name, or "client left"
            (for "unwatched", nobody asked: the client left).
        seen: the last state each observer saw: store, stream, subscriber, push, sender.
        failures: each broken promise, in words.
    """

    point: Point | None
    origin: str
    landing: str
    answer: str = ""
    seen: dict[str, str] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    expected: dict[str, tuple[str, ...]] = field(default_factory=dict)
    scenario: str = ""
    """The scenario file that replays this row (see `play`)."""
    said: dict[str, str] = field(default_factory=dict, repr=False)  # An observer's error, in words.

    @property
    def ok(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict[str, Any]:
        """The row for JSON."""
        return {
            "moment": self.moment,
            "point": None if self.point is None else {**vars(self.point), "where": self.point.where},
            "origin": self.origin,
            "landing": self.landing,
            "answer": self.answer,
            "seen": self.seen,
            "ok": self.ok,
            "failures": self.failures,
            "scenario": self.scenario,
        }

    @property
    def moment(self) -> str:
        if self.point is None:
            return "no cancel"
        landing = f", {self.landing}" if self.landing else ""
        return f"{self.point.index} {self.point.where}{landing}"


@dataclass
class Report:
    """A sweep's rows, the uncancelled run's first; ``str()`` is the table.

    Attributes:
        rows: the rows swept.
        folded: the rows not swept because their point repeats a code path (see `fold`).
        unswept: the rows not swept because the sweep stopped at a failing row (``fail_fast``).
        claims_judged: whether a ``released`` predicate judged the executor's claims.
    """

    rows: list[Row]
    folded: int = 0
    unswept: int = 0
    claims_judged: bool = True

    @property
    def ok(self) -> bool:
        return all(row.ok for row in self.rows)

    @property
    def failures(self) -> list[Row]:
        return [row for row in self.rows if not row.ok]

    def assert_ok(self) -> None:
        """Raise ``AssertionError`` with the table and the failing rows' scenario files."""
        if not self.ok:
            raise AssertionError(str(self))

    def __str__(self) -> str:
        columns = ("store", "stream", "subscriber", "push", "sender")
        cells: list[tuple[str, ...]] = [("moment", "origin", "answer", *columns, "")]
        for row in self.rows:
            seen = [row.seen.get(name, "-") for name in columns]
            cells.append(
                (row.moment, row.origin or "-", row.answer or "-", *seen, "ok" if row.ok else "FAILS")
            )
        lines = table(cells)
        failing = self.failures
        lines.append("")
        lines.append(f"{len(self.rows) - len(failing)} of {len(self.rows)} rows hold.")
        lines.extend(self.notes())
        for row in failing:
            lines.append("")
            lines.append(f"FAILS: {row.moment} ({row.origin or 'no cancel'})")
            lines.extend(f"  - {failure}" for failure in row.failures)
            if row.scenario:
                lines.append("  Replay it: save as cancel_<name>.toml, run `a2a-cancelfix play` on it:")
                lines.extend(f"    {line}" for line in row.scenario.splitlines())
        return "\n".join(lines)

    def notes(self) -> list[str]:
        """What the rows do not say: what was not swept, and what was not judged."""
        notes = []
        if self.folded:
            notes.append(
                f"{self.folded} more rows repeat a code path (a loop's iterations): each path was swept"
                " at its first, second and last occurrence; every_occurrence=True"
                " (--every-occurrence) sweeps them all."
            )
        if self.unswept:
            notes.append(f"Stopped at the first failing row: {self.unswept} rows not swept.")
        if not self.claims_judged:
            notes.append(
                "Claims were not judged: pass released=, a predicate true once the executor let go"
                " of what it holds (--released MODULE:NAME)."
            )
        return notes


def compare(row: Row) -> None:
    """Add to ``row``'s failures each observer that ended on a state it was not expected to."""
    for name, allowed in row.expected.items():
        seen = row.seen.get(name, "nothing")
        if name == "answer" and seen in ("HANG", "client left"):
            continue  # Said already, or nobody is left to answer.
        if seen not in allowed:
            said = f": {row.said[name]}" if name in row.said else ""
            row.failures.append(f"the {name} ended on {seen}, not {' or '.join(allowed)}{said}")


def with_scenario(row: Row, executor: str, messages: list[str], grace_period: float, released: str) -> Row:
    """``row`` with the scenario file that replays it, expecting what the sweep expected.

    ``executor`` and ``released`` are MODULE:NAME (see `spec`); "" if they have none.
    """
    point = row.point
    if point is None:
        return row
    lines = [
        "# One cancel moment, replayed by `a2a-cancelfix play FILE` (written by a2a-cancelfix sweep).",
        f"executor = {_string(executor or '<MODULE:NAME of your executor factory>')}",
        f"messages = {json.dumps(messages, ensure_ascii=False)}",
        f"grace_period = {grace_period!r}",
    ]
    if released:
        lines.append(f"released = {_string(released)}")
    lines += [
        "",
        "[cancel]",
        f"kind = {_string(point.kind)}",
        f"at = {_string(point.path)}" + (f"  # {point.place}" if point.place else ""),
        f"occurrence = {point.occurrence}",
        f"shielded = {'true' if point.shielded else 'false'}",
        f"origin = {_string(row.origin)}",
        f"landing = {_string(row.landing)}",
        "",
        "[expect]",
    ]
    for name, allowed in row.expected.items():
        value = _string(allowed[0]) if len(allowed) == 1 else json.dumps(list(allowed), ensure_ascii=False)
        lines.append(f"{name} = {value}")
    return dataclasses.replace(row, scenario="\n".join(lines) + "\n")


def spec(factory: Any) -> str:
    """``factory`` as MODULE:NAME, when it can be imported back so."""
    module, name = getattr(factory, "__module__", None), getattr(factory, "__qualname__", "")
    return f"{module}:{name}" if module and name and "<" not in name else ""


def _string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # A TOML basic string.

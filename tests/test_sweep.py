"""The testing kit catches what it claims: each broken executor fails the right row, with a
message that names the problem; good executors hold on every row; a failing row replays from
its scenario file, in Python, from the shell and as a pytest item."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from a2a.types import Task

from a2a_cancelfix._cancel.cancellation import Cancellation
from a2a_cancelfix._lifecycle import Lifecycle
from a2a_cancelfix.testing import Report, play, sweep
from a2a_cancelfix.testing.examples import Pipeline, claim_released
from a2a_cancelfix.tools.cli import main
from a2a_cancelfix.tools.demo import DemoAgent

from . import sweep_executors as broken
from .support import told

ROOT = Path(__file__).parent.parent
GRACE = 0.2


def failing(report: Report, origin: str, text: str) -> list[str]:
    """The moments of ``origin`` whose failures include ``text``."""
    return [
        row.moment
        for row in report.failures
        if row.origin == origin and any(text in failure for failure in row.failures)
    ]


async def swept(executor: object, **options: object) -> Report:
    report = await sweep(executor, grace_period=GRACE, **options)  # type: ignore[arg-type]
    assert report.rows[0].ok, f"the uncancelled run must hold:\n{report}"
    return report


def line_of(function: Any) -> int:
    """The line of ``function``'s first await, as a row names it."""
    lines, first = inspect.getsourcelines(function)
    return first + next(number for number, line in enumerate(lines) if "await " in line)


# Each broken executor: the origin and moment of a row that must fail, and what it must say.
DEFECTS = [
    (
        broken.SwallowsTheCancel,
        "local",
        "interrupted",
        "the run swallowed the CancelledError it got at await asyncio.sleep in execute > work > step > io",
    ),
    (
        broken.StepAfterCaught,
        "local",
        "step step",
        "the run swallowed the RunCancelled (a CancelledError) it got at step step,"
        " and went on to step scrub",
    ),
    (broken.ClaimOnHappyPath, "local", "scrub", "released() was false when the cancel returned"),
    (
        broken.BackgroundOutlivesRun,
        "local",
        "step step",
        "a task it started (BackgroundOutlivesRun.work.<locals>.warm_cache,"
        " started in work (sweep_executors.py:",
    ),
    (
        broken.ThreadNeverChecks,
        "local",
        f"await asyncio.to_thread in execute > work (sweep_executors.py:{line_of(broken.ThreadNeverChecks.work)}),"
        " interrupted",
        "a thread it started still ran 0.2 s after the cancel returned, in crunch (sweep_executors.py:",
    ),
    (
        broken.CancelHangs,
        "local",
        "step step",
        "cancel() did not return within the grace period: it hangs, at cancel (sweep_executors.py:",
    ),
    (
        broken.CancelRaises,
        "local",
        "step step",
        "CancelRaises.cancel() raised RuntimeError: the LLM provider refused the abort,"
        " at cancel (sweep_executors.py:",
    ),
    (
        broken.ShieldOutlastsGrace,
        "local",
        "while pending",
        "a shielded section was cut at await asyncio.wait in execute > work",
    ),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("executor", "origin", "moment", "problem"), DEFECTS, ids=[defect[0].__name__ for defect in DEFECTS]
)
async def test_each_defect_fails_its_row(executor: type, origin: str, moment: str, problem: str) -> None:
    """The row where the defect shows fails, and says what went wrong there."""
    report = await swept(executor, origins=(origin,), released=broken.unreleased)
    moments = failing(report, origin, problem)
    assert any(moment in each for each in moments), f"{problem!r} not at {moment!r}:\n{report}"
    assert problem in str(report) and "Replay it" in str(report)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("executor", "problem"),
    [
        (broken.StepAfterCaught, "and went on to step scrub"),
        (broken.CancelHangs, "cancel() did not return within the grace period: it hangs, at cancel (sweep_"),
    ],
    ids=["StepAfterCaught", "CancelHangs"],
)
async def test_a_defect_fails_its_unwatched_row(executor: type, problem: str) -> None:
    """Cancelled as unwatched, with nobody waiting for the cancel's answer, a defect still shows."""
    report = await swept(executor, origins=("unwatched",))
    assert any("step step" in moment for moment in failing(report, "unwatched", problem)), str(report)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "executor", [broken.LoopWithoutCheckpoint, broken.PlainTokens], ids=["tool loop", "token loop"]
)
async def test_plain_asyncio_without_checkpoints_holds_on_every_row(executor: type) -> None:
    """No checkpoint, no ``on_cancel``: a cancel that lands as an await returns, here or from
    another replica, stops the run at its next await, and the claim is released."""
    report = await swept(executor, released=lambda agent: getattr(agent, "claims", 0) == 0)
    assert report.ok, told(report)
    returning = [row for row in report.rows if row.landing == "as it returns"]
    assert {row.origin for row in returning} == {"local", "remote", "client leaves"}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("executor", "released"),
    [
        (Pipeline, claim_released),
        (functools.partial(DemoAgent, 0.001, 0.001), None),
        (broken.CleansUpShielded, None),
    ],
    ids=["README's Pipeline", "demo agent", "shielded clean-up"],
)
async def test_good_executors_hold_on_every_row(executor: object, released: object) -> None:
    report = await swept(executor, released=released)
    assert report.ok, told(report)
    if executor is Pipeline:
        assert f"holds\non all {len(report.rows)} rows" in (ROOT / "docs" / "testing.md").read_text()
    kinds = {row.point.kind for row in report.rows[1:] if row.point}
    assert {"publish", "published", "checkpoint", "await", "ended"} <= kinds
    assert {row.origin for row in report.rows[1:]} == {"local", "remote", "client leaves"}
    landings = {row.landing for row in report.rows if row.point and row.point.kind == "await"}
    assert {"as it returns", "interrupted", "while pending"} <= landings


GOOD = [(Pipeline, claim_released), (functools.partial(DemoAgent, 0.001, 0.001), None)]


@pytest.mark.asyncio
@pytest.mark.parametrize(("executor", "released"), GOOD, ids=["README's Pipeline", "demo agent"])
async def test_a_task_nobody_watches_stops_on_every_row(
    executor: object, released: object, tmp_path: Path
) -> None:
    """Asked for, the ``unwatched`` origin: the sender's client leaves at the point, nobody else
    watches, and ``cancel_unwatched_after`` cancels the task; its rows replay from their files."""
    report = await swept(executor, origins=("unwatched",), released=released)
    assert report.ok, told(report)
    rows = report.rows[1:]
    assert rows and {row.origin for row in rows} == {"unwatched"}
    cancelled = [row for row in rows if row.seen["store"] == "CANCELED"]
    assert len(cancelled) >= len(rows) - 3, str(report)  # All but before it is stored, and parked.
    if executor is Pipeline:  # Importable by name (the demo's partial is not): it replays.
        saved = tmp_path / "cancel_unwatched.toml"
        saved.write_text(cancelled[-1].scenario)
        assert 'origin = "unwatched"' in cancelled[-1].scenario
        assert play(saved).ok


@pytest.mark.asyncio
async def test_the_unwatched_rows_fail_without_the_options_cancel(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the option's entry into the lifecycle disabled, nothing cancels the task its client
    left: each row where it ran fails, saying so."""

    async def disabled(*args: object) -> None:
        return None

    monkeypatch.setattr(Lifecycle, "unwatched", disabled)
    # The plain agent: each row waits out its bound (the option's, the grace period's and the
    # lifecycle's margin) for a cancel that never comes; Pipeline has twice its rows.
    report = await swept(broken.Agent, origins=("unwatched",))
    stranded = failing(report, "unwatched", "after its client left and nobody watched the task, and")
    assert len(stranded) >= len(report.rows) - 2, str(report)
    assert "Agent.cancel() was not called" in str(report)


@pytest.mark.asyncio
async def test_an_unwatched_cancel_must_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelled as a client's cancel is, without the reason: the row fails on the status."""

    async def unsaid(self: Lifecycle, task: Task, active: object, caller: object, after: float) -> None:
        cancellation = self._begin(task.id, Cancellation.requested, task.id)
        await self._drive(cancellation, task, active, caller)  # type: ignore[arg-type]

    monkeypatch.setattr(Lifecycle, "unwatched", unsaid)
    report = await swept(Pipeline, origins=("unwatched",), released=claim_released)
    assert failing(report, "unwatched", "status does not say nobody watched it"), str(report)


@pytest.mark.asyncio
async def test_a_parked_conversation_holds_for_cancels_on_its_replica() -> None:
    """Parked, followed up, and cancelled before the follow-up's execute() starts."""
    demo = functools.partial(DemoAgent, 0.001, 0.001)
    report = await swept(demo, message=["ask", "markdown"], origins=("local", "client leaves"))
    assert report.ok, told(report)
    landings = {(row.point.kind, row.landing) for row in report.rows[1:] if row.point}
    assert {("parked", "alone"), ("parked", "follow-up racing"), ("start", "")} <= landings


@pytest.mark.asyncio
async def test_a_remote_cancel_of_a_parked_task_reaches_its_replica() -> None:
    """Nothing runs on the replica where the task is parked; it looks at the task once per
    poll interval, so its subscriber and push configs end on CANCELED too."""
    demo = functools.partial(DemoAgent, 0.001, 0.001)
    report = await swept(demo, message=["ask", "markdown"], origins=("remote",))
    assert report.ok, told(report)
    parked = [row for row in report.rows if row.point and row.point.kind == "parked"]
    assert len(parked) == 2
    assert all(row.seen["subscriber"] == row.seen["push"] == "CANCELED" for row in parked)


@pytest.mark.asyncio
async def test_a_failing_row_replays_from_its_scenario_file(tmp_path: Path) -> None:
    report = await swept(broken.ClaimOnHappyPath, origins=("local",), released=broken.unreleased)
    row = report.failures[0]
    assert 'executor = "tests.sweep_executors:ClaimOnHappyPath"' in row.scenario
    saved = tmp_path / "cancel_claim.toml"
    saved.write_text(row.scenario)
    replayed = play(saved)
    assert not replayed.ok
    assert replayed.rows[0].failures == row.failures
    with pytest.raises(AssertionError, match="released"):
        replayed.assert_ok()


@pytest.mark.asyncio
async def test_a_scenario_file_says_what_each_observer_must_see(tmp_path: Path) -> None:
    """A good moment replays green; the same moment with another expectation fails, naming it."""
    report = await swept(Pipeline, origins=("remote",), released=claim_released)
    row = next(row for row in report.rows if row.point and row.point.kind == "checkpoint")
    saved = tmp_path / "cancel_remote.toml"
    saved.write_text(row.scenario)
    assert play(saved).ok
    saved.write_text(row.scenario.replace('stream = "CANCELED"', 'stream = "COMPLETED"'))
    assert play(saved).rows[0].failures == ["the stream ended on CANCELED, not COMPLETED"]


def test_a_file_that_is_no_scenario_is_refused(tmp_path: Path) -> None:
    saved = tmp_path / "cancel_bad.toml"
    saved.write_text('executor = "a2a_cancelfix.testing.examples:Pipeline"\n')
    with pytest.raises(ValueError, match="not a scenario file"):
        play(saved)


@pytest.mark.asyncio
async def test_origins_are_checked() -> None:
    with pytest.raises(ValueError, match="origins must be among"):
        await sweep(Pipeline, origins=("mars",))


@pytest.mark.edges_only  # Its own interpreter, for what runs in process on every release (see noxfile.py).
def test_the_sweep_command_prints_the_table_and_exits_by_the_rows() -> None:
    command = [sys.executable, "-m", "a2a_cancelfix", "sweep", "a2a_cancelfix.testing.examples:Pipeline"]
    good = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert good.returncode == 0, good.stdout + good.stderr
    assert "publishes COMPLETED" in good.stdout and "rows hold." in good.stdout


def test_the_sweep_command_prints_json_and_fails_with_a_row(capsys: pytest.CaptureFixture[str]) -> None:
    arguments = ["sweep", "tests.sweep_executors:CancelRaises", "--json", "--origin", "local"]
    assert main([*arguments, "--grace-period", "0.2"]) == 1
    rows = json.loads(capsys.readouterr().out)
    assert any("CancelRaises.cancel() raised RuntimeError" in " ".join(row["failures"]) for row in rows)
    assert {"moment", "origin", "landing", "answer", "seen", "ok", "failures", "scenario"} <= set(rows[0])


@pytest.mark.asyncio
async def test_the_play_command_exits_by_the_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scenario = tmp_path / "cancel_raises.toml"
    report = await swept(broken.CancelRaises, origins=("local",))
    scenario.write_text(report.failures[0].scenario)
    assert await asyncio.to_thread(main, ["play", str(scenario)]) == 1
    assert "CancelRaises.cancel() raised RuntimeError" in capsys.readouterr().out
    assert await asyncio.to_thread(main, ["sweep", "no_such_module:Thing"]) == 2
    assert "No module named 'no_such_module'" in capsys.readouterr().err


def test_the_pytest_plugin_collects_scenario_files(pytester: pytest.Pytester) -> None:
    """Installed, a2a-cancelfix's plugin makes each cancel_*.toml a test item."""
    good = Path(pytester.path, "cancel_good.toml")
    good.write_text(
        'executor = "a2a_cancelfix.testing.examples:Pipeline"\n'
        "grace_period = 0.2\n"
        '[cancel]\nkind = "checkpoint"\nat = "step scrub"\norigin = "local"\n'
        '[expect]\nanswer = "CANCELED"\nstore = "CANCELED"\n'
    )
    Path(pytester.path, "cancel_wrong.toml").write_text(
        good.read_text().replace('store = "CANCELED"', 'store = "COMPLETED"')
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-W", "ignore")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*the store ended on CANCELED, not COMPLETED*"])


@pytest.mark.asyncio
async def test_a_remote_cancel_ends_canceled_even_when_cancel_raises_there() -> None:
    """Another replica recorded CANCELED: the replica that runs the task publishes CANCELED
    too when its ``cancel()`` raises (it published FAILED, which the store refused, so its
    streams and push ended on a state the store does not hold)."""
    report = await swept(broken.CancelRaises, origins=("remote",))
    noticed = [row for row in report.rows[1:] if row.answer == "CANCELED"]
    assert noticed
    for row in noticed:
        assert {row.seen[name] for name in ("store", "stream", "subscriber", "push")} == {"CANCELED"}, row


def sweep_doc_blocks(after: str) -> list[str]:
    """The code blocks of docs/testing.md's section ``after``."""
    text = (ROOT / "docs" / "testing.md").read_text().split(after, 1)[1].split("\n## ", 1)[0]
    return [block.split("\n", 1)[1] for block in text.split("```")[1::2]]


def broken_example(change: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The kit's example changed as docs/testing.md says, imported as the user's ``agent``."""
    source = (ROOT / "a2a_cancelfix" / "testing" / "examples.py").read_text()
    assert change[0] in source
    (tmp_path / "agent.py").write_text(source.replace(change[0], change[1]))
    monkeypatch.syspath_prepend(str(tmp_path))
    import agent  # type: ignore[import-not-found]

    sys.modules.pop("agent")
    return agent


@pytest.mark.asyncio
async def test_the_readme_example_holds_without_its_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the checkpoint between its tool calls, the kit's example still holds on every
    row, as docs/testing.md says: a cancel stops it at its next await."""
    removed = (
        "                await checkpoint()  # Between tool calls: a cancel stops before the next one.\n",
        "",
    )
    agent = broken_example(removed, tmp_path, monkeypatch)
    report = await swept(agent.Pipeline, released=agent.claim_released)
    assert report.ok, told(report)
    assert (
        "delete the `await checkpoint()`\nbetween its tool calls, and every row still holds"
        in (ROOT / "docs" / "testing.md").read_text()
    )


@pytest.mark.asyncio
async def test_the_readme_shows_the_row_that_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kit's example, its claim released outside ``finally``, fails first the row
    docs/testing.md quotes, and as many rows as it says."""
    outside = (
        "        try:\n            yield\n        finally:\n            self",
        "        yield\n        self",
    )
    agent = broken_example(outside, tmp_path, monkeypatch)
    report = await swept(agent.Pipeline, released=agent.claim_released)
    quoted = sweep_doc_blocks("## What the sweep does")[0].strip().splitlines()
    first = str(report).split("\n\n")[2].splitlines()  # After the table and the count.
    assert first[:2] == quoted
    assert f"and {len(report.failures)} rows fail, the first:" in (ROOT / "docs" / "testing.md").read_text()


@pytest.mark.asyncio
async def test_an_installed_executors_awaits_are_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An executor installed as a package (in site-packages, where libraries live) still has
    its awaits swept: the code of the executor's own package is the user's."""
    from a2a_cancelfix.testing import _probe

    package = tmp_path / "installed_agent"
    package.mkdir()
    (package / "__init__.py").write_text((ROOT / "a2a_cancelfix" / "testing" / "examples.py").read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_probe, "_LIBRARIES", (*_probe._LIBRARIES, str(tmp_path)))
    import installed_agent  # type: ignore[import-not-found]

    report = await swept(installed_agent.Pipeline, origins=("local",))
    awaits = [row.point.where for row in report.rows[1:] if row.point and row.point.kind == "await"]
    assert any("in execute > call > io" in where for where in awaits), str(report)
    sys.modules.pop("installed_agent")


@pytest.mark.asyncio
async def test_a_sweep_is_deterministic() -> None:
    """Swept twice, an executor shows the same rows: no row depends on timing."""
    first, second = [await swept(broken.SwallowsTheCancel, origins=("local", "remote")) for _ in range(2)]
    assert [row.as_dict() for row in first.rows] == [row.as_dict() for row in second.rows]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.TaskGroup is Python 3.11+")
@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["TaskGroup", "create_task", "gather"])
async def test_the_awaits_of_the_tasks_a_run_starts_are_swept(how: str) -> None:
    """Eight tool calls at once in child tasks: a cancel lands at each child's awaits too, each
    row named by the child's own line, its repeats folded as a loop's are. The fifth call
    swallowing the cancel fails the rows that land in it; no child's await was a point, and
    every row held."""
    stubborn = await swept(functools.partial(broken.ParallelToolCalls, how, stubborn=True), origins=["local"])
    line = f"sweep_executors.py:{line_of(broken.stubborn_tool_call)}"  # The child's own, outermost.
    in_it = [row for row in stubborn.failures if row.point and row.point.stack[0] == line]
    assert in_it and all("in stubborn_tool_call" in row.point.path for row in in_it), told(stubborn)
    clean = await swept(functools.partial(broken.ParallelToolCalls, how), origins=["local"])
    assert clean.ok, told(clean)
    children = [row for row in clean.rows if row.point and "in tool_call" in row.point.path]
    assert children and clean.folded, told(clean)

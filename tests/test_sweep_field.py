"""The sweep on executors as they are written in the field (issue 26): no false alarm for waits
inside library calls or for idle thread-pool workers, no miss of work that ``cancel()`` starts,
the blame on the right code, and scenario files that are checked and survive edits."""

from __future__ import annotations

import asyncio
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from a2a_cancelfix.testing import play, sweep
from a2a_cancelfix.testing._clock import working as _working
from a2a_cancelfix.testing.examples import Pipeline
from a2a_cancelfix.testing.scenario_file import ScenarioError
from a2a_cancelfix.tools.cli import main

from . import field_executors as field
from .support import told
from .test_sweep import GRACE, ROOT, swept


@pytest.mark.asyncio
@pytest.mark.parametrize("executor", [field.CallsALibrary, field.StreamsFromALibrary])
async def test_suspensions_inside_one_library_call_are_one_await(executor: type) -> None:
    """An installed package's call that suspends twice is one await of the user's code: no row
    says the run went on to await it after the cancel."""
    report = await swept(executor)
    assert report.ok, told(report)
    awaits = {row.point.path for row in report.rows[1:] if row.point and row.point.kind == "await"}
    assert awaits and all(path.startswith("await fakelib.") for path in awaits), awaits


@pytest.mark.asyncio
@pytest.mark.parametrize("executor", [field.OnAnyioThreads, field.OnItsOwnPool])
async def test_idle_pool_workers_are_no_leak(executor: type) -> None:
    """A pool's worker that went idle is not the executor's leftover work. A worker finishing
    its item may not be back at its queue within 0.2 s on a loaded machine (seen in CI, the
    interrupted row of OnAnyioThreads): the leftovers get a second, which an idle worker taken
    for a busy one would exceed all the same."""
    report = await sweep(executor, grace_period=1.0)
    assert report.ok, told(report)


class AnyioLikeWorker(threading.Thread):
    """A pool worker as anyio's are: the items it takes come from its ``queue``; here it is
    held past its item, as one is while the collector runs a finalizer in it."""

    __module__ = "anyio._backends._asyncio"  # Where anyio's WorkerThread is defined.

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.queue: queue.Queue[int] = queue.Queue()
        self.held = threading.Event()
        self.release = threading.Event()

    def run(self) -> None:
        self.queue.get()
        self.queue.task_done()
        self.held.set()
        self.release.wait(10)


def test_a_pool_worker_past_its_item_runs_no_work() -> None:
    """Judged by its queue, not by where its frames are: an anyio worker still in its loop
    after its item was done made the interrupted row of OnAnyioThreads fail under xdist."""
    worker = AnyioLikeWorker()
    worker.start()
    try:
        worker.queue.put(1)
        assert worker.held.wait(10)
        assert not _working(worker)
        worker.queue.put(2)  # Taken by nobody: an item not yet done is work.
        assert _working(worker)
    finally:
        worker.release.set()
        worker.join(10)


@pytest.mark.asyncio
async def test_a_thread_that_threading_learns_of_mid_run_is_not_the_executors() -> None:
    """A thread nobody started through `threading` (pytest-xdist's I/O thread) that becomes
    known to it during a run is no thread the executor started: it made the row above fail now
    and then under xdist, when a finalizer that logs ran in that thread mid-row."""
    foreign = field.ForeignThread()
    try:
        report = await swept(lambda: field.WakesAForeignThread(foreign))
    finally:
        foreign.done.set()
    assert report.ok, told(report)


@pytest.mark.asyncio
async def test_a_pool_thread_still_running_the_work_is_a_leak() -> None:
    report = await swept(field.PoolWorkOutlivesRun, origins=("local",))
    assert any(
        f"a thread it started still ran {GRACE:g} s" in " ".join(row.failures) for row in report.failures
    )


@pytest.mark.asyncio
@pytest.mark.parametrize("origin", ["local", "client leaves"])
async def test_a_task_that_cancel_starts_must_end(origin: str) -> None:
    """A local cancel's ``cancel()`` runs in the cancel request's context, not the run's: what it
    starts is the executor's all the same."""
    report = await swept(field.CancelStartsAPoller, origins=(origin,))
    problem = "a task it started (CancelStartsAPoller.poll, started in cancel (field_executors.py:"
    rows = [row for row in report.rows[1:] if row.answer in ("CANCELED", "client left")]
    assert rows and all(any(problem in failure for failure in row.failures) for row in rows), str(report)


@pytest.mark.asyncio
async def test_a_released_callback_that_raises_is_blamed() -> None:
    report = await sweep(Pipeline, grace_period=GRACE, released=field.released_with_a_wrong_signature)
    [failure] = report.rows[0].failures
    assert failure.startswith("released_with_a_wrong_signature(executor) raised TypeError")
    assert "the run raised" not in str(report)


AGENT = """
import asyncio

from tests.sweep_executors import Agent


class Leaky(Agent):
    async def work(self):
        # A comment line: NOTE
        await asyncio.sleep(0.001)

    async def cancel(self, context, event_queue):
        asyncio.ensure_future(self.poll())

    async def poll(self):
        while True:
            await asyncio.sleep(0.05)
"""


def lineless(failures: list[str]) -> list[str]:
    return [re.sub(r"\.py:\d+", ".py:N", failure) for failure in failures]


@pytest.mark.asyncio
async def test_a_scenario_file_survives_edits_that_keep_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A point is found by its path and occurrence: lines added above it leave the file
    replaying the same moment, and once the bug is fixed the file passes."""
    (tmp_path / "edited_agent.py").write_text(AGENT)
    monkeypatch.syspath_prepend(str(tmp_path))
    import edited_agent  # type: ignore[import-not-found]

    try:
        report = await swept(edited_agent.Leaky, origins=("local",))
    finally:
        sys.modules.pop("edited_agent")
    row = next(row for row in report.failures if row.point and row.point.path.endswith("in execute > work"))
    scenario = tmp_path / "cancel_poller.toml"
    scenario.write_text(row.scenario)
    assert 'at = "await asyncio.sleep in execute > work"  # edited_agent.py:10' in row.scenario

    edited = "# An unrelated comment, two lines above everything.\n\n" + AGENT.replace("NOTE", "NOTE\n# Two")
    (tmp_path / "edited_agent.py").write_text(edited)
    replayed = await asyncio.to_thread(play, scenario)
    sys.modules.pop("edited_agent")
    assert replayed.rows[0].point.place == "edited_agent.py:13"  # type: ignore[union-attr]
    assert lineless(replayed.rows[0].failures) == lineless(row.failures) != []

    fixed = edited.replace("asyncio.ensure_future(self.poll())", "return None")
    (tmp_path / "edited_agent.py").write_text(fixed)
    replayed = await asyncio.to_thread(play, scenario)
    sys.modules.pop("edited_agent")
    assert replayed.ok, str(replayed)


GOOD = (ROOT / "tests" / "cancel_remote_between_tool_calls.toml").read_text()
TYPOS = [
    (('landing = "as it returns"', 'landing = "interupted"'), "landing = 'interupted'"),
    (("released =", "relased ="), "unknown key 'relased' (did you mean 'released'?)"),
    (('origin = "remote"', 'origin = "locl"'), "origin = 'locl'"),
    (('origin = "remote"', 'orign = "remote"'), "unknown key 'orign' (did you mean 'origin'?)"),
    (("[expect]", "[expct]"), "unknown section [expct] (did you mean 'expect'?)"),
    (('kind = "await"', 'kind = "awiat"'), "kind = 'awiat'"),
    (("[cancel]", "[cancle]"), "unknown section [cancle] (did you mean 'cancel'?)"),
    (('landing = "as it returns"', 'landing = "interrupted"'), "is not a landing of a remote cancel"),
]


@pytest.mark.parametrize(("change", "named"), TYPOS, ids=[typo[0][1] for typo in TYPOS])
def test_a_scenario_file_is_checked_before_anything_runs(
    change: tuple[str, str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A typo is an error naming it, exit 2 and no traceback; never a test that tests nothing."""
    assert change[0] in GOOD
    scenario = tmp_path / "cancel_typo.toml"
    scenario.write_text(GOOD.replace(change[0], change[1]))
    with pytest.raises(ScenarioError) as raised:
        play(scenario)
    assert named in str(raised.value)
    assert main(["play", str(scenario)]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


def test_the_pytest_plugin_refuses_a_scenario_file_with_a_typo(pytester: pytest.Pytester) -> None:
    Path(pytester.path, "cancel_typo.toml").write_text(GOOD.replace("[cancel]", "[cancle]"))
    result = pytester.runpytest("-p", "no:cacheprovider", "-W", "ignore")
    assert result.ret == pytest.ExitCode.INTERRUPTED  # 2: a collection error.
    result.stdout.fnmatch_lines(["*unknown section [[]cancle[]] (did you mean 'cancel'?)*"])
    assert "Traceback" not in result.stdout.str() and "scenario_file.py" not in result.stdout.str()


class ToolBox:
    """Not an executor."""


def needs_arguments(model: str) -> Pipeline:
    return Pipeline()


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (["--grace-period", "-1"], "the grace period must be a positive number of seconds, not -1.0"),
        (["--grace-period", "0"], "not 0.0"),
        (["--grace-period", "nan"], "not nan"),
        (["--grace-period", "inf"], "not inf"),
    ],
)
def test_the_sweep_command_refuses_a_grace_period(
    arguments: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sweep", "a2a_cancelfix.testing.examples:Pipeline", *arguments]) == 2
    assert said in capsys.readouterr().err


@pytest.mark.edges_only  # Its own interpreter, for what runs in process on every release (see noxfile.py).
@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("tests.test_sweep_field:ToolBox", "ToolBox is not an AgentExecutor"),
        ("tests.test_sweep_field:needs_arguments", "needs_arguments cannot be called without arguments"),
    ],
)
def test_the_sweep_command_refuses_what_is_no_executor_factory(spec: str, said: str) -> None:
    command = [sys.executable, "-m", "a2a_cancelfix", "sweep", spec]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert said in result.stderr and "Traceback" not in result.stderr and not result.stdout


@pytest.mark.edges_only  # Its own interpreter, for what runs in process on every release (see noxfile.py).
def test_the_sweep_command_takes_released(tmp_path: Path) -> None:
    """From the shell too, a claim released outside ``finally`` fails its rows."""
    source = (ROOT / "a2a_cancelfix" / "testing" / "examples.py").read_text()
    (tmp_path / "agent.py").write_text(
        source.replace(
            "        try:\n            yield\n        finally:\n", "        yield\n        if True:\n"
        )
    )
    command = [sys.executable, "-m", "a2a_cancelfix", "sweep", "agent:Pipeline", "--origin", "remote"]
    command += ["--grace-period", str(GRACE), "--released", "agent:claim_released"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "released() was false when the cancel returned" in result.stdout

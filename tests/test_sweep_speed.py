"""A sweep whose cost grows with the executor's code paths, not with its iterations or its
sleeps, and that says how far it is: repeated code paths folded, the loop's idle waits
skipped, progress and failing scenario files as it goes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import sys
import threading
from pathlib import Path

import pytest

from a2a_cancelfix.testing import play, sweep
from a2a_cancelfix.testing._clock import VirtualTimeLoop
from a2a_cancelfix.testing.waits import BOUND, in_own_loop, wait_all_tasks_blocked, within
from a2a_cancelfix.tools.cli import main

from . import sweep_executors as broken
from .support import told
from .test_sweep import GRACE, swept

_SOURCE = Path(broken.__file__).read_text().splitlines()
TOOL = f"sweep_executors.py:{_SOURCE.index('                    await io()  # The tool.') + 1}"


@pytest.mark.asyncio
async def test_a_tool_called_every_tenth_token_is_swept_though_the_tokens_are_folded() -> None:
    """The tokens' awaits repeat one code path and are folded; the tool's is another path,
    swept too, and its defect is found."""
    report = await swept(broken.ToolSwallowsTheCancel, origins=("local",))
    swallowed = [
        row for row in report.failures if "the run swallowed the CancelledError" in str(row.failures)
    ]
    assert swallowed and all(row.point and TOOL in row.point.stack for row in swallowed), str(report)
    assert report.folded > 0
    assert f"{report.folded} more rows repeat a code path" in str(report)
    assert "--every-occurrence" in str(report)


@pytest.mark.asyncio
async def test_every_occurrence_finds_a_defect_of_the_third_pass_only() -> None:
    """Folded, the third pass is not swept; with ``every_occurrence`` it is, and fails."""
    folded = await swept(broken.ThirdPassClaim, origins=("local",), released=broken.unreleased)
    assert folded.ok, told(folded)
    every = await swept(
        broken.ThirdPassClaim, origins=("local",), released=broken.unreleased, every_occurrence=True
    )
    assert every.folded == 0 and len(every.rows) > len(folded.rows)
    held = [row for row in every.failures if "released() was false" in " ".join(row.failures)]
    assert held and {row.point.occurrence for row in held if row.point} == {3}, str(every)


@pytest.mark.asyncio
async def test_fail_fast_stops_at_the_first_failing_row() -> None:
    report = await swept(broken.CancelRaises, origins=("local",), fail_fast=True)
    assert [row.ok for row in report.rows[1:]].count(False) == 1 and not report.rows[-1].ok
    assert report.unswept > 0
    assert f"Stopped at the first failing row: {report.unswept} rows not swept." in str(report)


@pytest.mark.asyncio
async def test_without_released_the_report_says_claims_were_not_judged() -> None:
    unjudged = await swept(broken.LoopWithoutCheckpoint, origins=("remote",))
    assert "Claims were not judged: pass released=" in str(unjudged)
    judged = await swept(broken.LoopWithoutCheckpoint, origins=("remote",), released=broken.unreleased)
    assert "not judged" not in str(judged)


@pytest.mark.asyncio
async def test_an_event_the_sdk_refuses_is_reported_with_its_error_and_line() -> None:
    """Not the harness's timeout: the SDK's error, its message and the user's line."""
    report = await sweep(broken.StatusBeforeTask, grace_period=GRACE)
    said = " ".join(report.rows[0].failures)
    assert "TimeoutError" not in said, said
    assert "InvalidAgentResponseError, not COMPLETED: Agent should enqueue Task before" in said, said
    assert "the run's last event came from execute (sweep_executors.py:" in said, said


@pytest.mark.asyncio
async def test_what_execute_raises_is_reported_with_its_line() -> None:
    report = await sweep(broken.RaisesOnItsWay, grace_period=GRACE)
    said = " ".join(report.rows[0].failures)
    assert (
        "execute() raised ValueError: the model's answer was not JSON, at work (sweep_executors.py:" in said
    )


def test_the_sweep_command_says_how_far_it_is_and_writes_failing_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not a terminal: a plain line per row on stderr; each failing row's scenario file in
    ``--write``'s folder, which ``play`` replays."""
    arguments = ["sweep", "tests.sweep_executors:CancelRaises", "--origin", "local", "--grace-period", "0.2"]
    assert main([*arguments, "--write", str(tmp_path / "found")]) == 1
    lines = capsys.readouterr().err.splitlines()
    total = len([line for line in lines if line.startswith("sweep: ")])
    assert lines[0] == f"sweep: 1 of {total} rows, 0 failing"
    assert any(line.startswith(f"sweep: {total} of {total} rows, ") for line in lines)
    written = sorted((tmp_path / "found").glob("cancel_*.toml"))
    assert written and len(written) == sum("written to" in line for line in lines)
    replayed = play(written[0])
    assert not replayed.ok and "CancelRaises.cancel() raised RuntimeError" in str(replayed)


def test_the_clock_skips_a_wait_only_a_timer_ends() -> None:
    """An hour's sleep on the sweep's loop takes no real hour; the loop's clock says it passed."""

    async def an_hour() -> float:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.sleep(3600)
        return loop.time() - started

    passed: list[float] = []
    thread = threading.Thread(target=lambda: passed.append(in_own_loop(an_hour)), daemon=True)
    thread.start()
    thread.join(BOUND)
    assert passed and passed[0] >= 3600


@pytest.mark.parametrize("outside", ["thread handed work", "thread of its own", "socket"])
def test_the_clock_does_not_skip_while_something_outside_the_loop_works(outside: str) -> None:
    """A thread at work or an open socket may still wake the loop: a timer is no due then."""
    loop = VirtualTimeLoop()
    release = threading.Event()
    left, right = socket.socketpair()
    try:
        if outside == "thread handed work":
            work = loop.run_in_executor(None, release.wait, BOUND)
        elif outside == "thread of its own":
            thread = threading.Thread(target=release.wait, args=(BOUND,))
            thread.start()
        else:
            loop.add_reader(left, lambda: None)
        assert loop._outside_works()
        release.set()
        if outside == "thread handed work":
            loop.run_until_complete(within(work))
            # Its worker has handed the result back, not yet gone back to wait: joined, it has.
            loop.run_until_complete(within(loop.shutdown_default_executor()))
        elif outside == "thread of its own":
            thread.join(BOUND)
        else:
            loop.remove_reader(left)
        assert not loop._outside_works()
    finally:
        release.set()
        left.close()
        right.close()
        loop.close()


@pytest.mark.asyncio
async def test_two_tasks_may_wait_for_everyone_blocked_at_once() -> None:
    """Each would see the other run and wait for ever: the second waits for the first."""
    await within(asyncio.gather(wait_all_tasks_blocked(), wait_all_tasks_blocked()))


@pytest.mark.asyncio
async def test_a_run_paced_by_the_wall_clock_is_told_to_sweep_in_real_time() -> None:
    """On the sweep's clock its 0.5 s of wall clock never pass before the run's bound: the
    uncancelled row fails, and says to sweep it with --real-time, on which it holds."""
    report = await sweep(broken.PacedByTheWallClock, grace_period=GRACE, origins=["local"])
    (row,) = report.rows
    hinted = any("--real-time (real_time=True)" in failure for failure in row.failures)
    assert not row.ok and hinted, told(report)
    assert (await sweep(broken.PacedByTheWallClock, grace_period=GRACE, origins=[], real_time=True)).ok


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.timeout is Python 3.11+")
@pytest.mark.asyncio
async def test_the_clock_does_not_skip_while_a_shared_pool_works() -> None:
    """A synchronous client called on a process-wide pool through ``asyncio.wrap_future``,
    under a 10 s timeout: the clock waits for the thread, every row holds. It jumped to the
    timeout (the pool's worker had started before the row's loop, or was idle as the work was
    queued), and the uncancelled run failed on TimeoutError in a hundredth of a second."""
    broken.SHARED_POOL.submit(lambda: None).result(BOUND)  # Its worker starts before any row.
    report = await swept(broken.SyncClientOnASharedPool, origins=["local"])
    assert report.ok, told(report)


@pytest.mark.parametrize("worker", ["started before the loop", "idle as the work comes"])
def test_a_pools_worker_works_from_the_moment_its_work_is_queued(worker: str) -> None:
    """Judged from the work queued for it to the work done, however old the worker is, and
    whether it has woken to take the work yet or not."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    release = threading.Event()
    if worker == "started before the loop":
        pool.submit(lambda: None).result(BOUND)
    loop = VirtualTimeLoop()
    try:
        if worker == "idle as the work comes":
            loop.run_until_complete(asyncio.wrap_future(pool.submit(lambda: None), loop=loop))
        work = pool.submit(release.wait, BOUND)
        assert loop._outside_works()
        release.set()
        work.result(BOUND)
        pool.shutdown(wait=True)
        assert not loop._outside_works()
    finally:
        release.set()
        pool.shutdown(wait=False)
        loop.close()

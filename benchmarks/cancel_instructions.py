"""Instructions per cancel, ours vs stock whose ``cancel()`` publishes CANCELED: figures that
do not move with the machine's load.

``cancel_latency.py`` and ``mass_cancel.py`` time cancels by the clock, which a shared machine
moves by tens of percent. Here ``valgrind --tool=callgrind`` counts what the process executes
from a cancel's request to its answer (every task of the loop included, as a latency would):
the process calls ``os.getppid()`` at each end of the window, and callgrind dumps its counts
before that C function (``--dump-before``), so each window is one dump. A single cancel is
timed on an otherwise idle loop, as ``cancel_latency.py`` times it (median of the windows);
a burst of 100 or 1,000 tasks, to the last answer and until every run has closed, as
``mass_cancel.py`` does (median of several bursts). 10,000 at once would take most of an hour
under callgrind: ``mass_cancel.py`` times it. Same hash seed everywhere. Needs valgrind; tens of
minutes on 2 cores (``--quick``: a single cancel and 100 at once).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import glob
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

from _common import header, settle, started
from a2a_cancelfix.testing import ScriptedExecutor, cancel, make_server
from a2a_cancelfix.testing.servers import GRACE
from tests.fleet import FleetExecutor, start_fleet

# Who is measured: (handler, what its executor's cancel() does).
KINDS = {
    "floor": ("stock", "publish"),
    "ours, cancel() publishes": ("ours", "publish"),
    "ours, cancel() is empty": ("ours", "empty"),
}
WARM, SINGLES, BURSTS = 5, 30, {100: 5, 1000: 2}
# How much slower than native the workers run under callgrind, at most: the bounds of their
# waits are stretched by it (a burst's start, mostly), so that a slow run is not a failed one,
# and so is ours' grace period, so that a cancel takes the path it takes natively (a burst
# of 100 ends well within the grace period natively; under callgrind it would not).
VALGRIND_SLOWDOWN = 100.0
GRACE_UNDER_VALGRIND = GRACE * VALGRIND_SLOWDOWN


def mark() -> None:
    os.getppid()  # callgrind dumps its counts here: one end of a window.


async def singles(handler: str, mode: str) -> None:
    """Windows: each cancel of a task mid-step, on an otherwise idle loop (after WARM unmarked)."""
    for index in range(WARM + SINGLES):
        server = make_server(
            handler,
            ScriptedExecutor(cancel=mode),
            push=False,
            told=False,
            cancel_grace_period=GRACE_UNDER_VALGRIND,
        )
        await started(server)
        timed = index >= WARM
        if timed:
            mark()
        async with asyncio.timeout(GRACE_UNDER_VALGRIND + 5):
            await cancel(server, server.executor.task_id)
        if timed:
            mark()
        server.executor.step.open()
        await settle(turns=10_000)


async def burst(handler: str, mode: str, count: int) -> None:
    """Windows, per burst: to the last answer, then on until every run has closed."""
    idle = len(asyncio.all_tasks())
    server = make_server(
        handler,
        FleetExecutor(mode == "publish"),
        push=False,
        told=False,
        cancel_grace_period=GRACE_UNDER_VALGRIND,
    )
    streams = await start_fleet(server, count, slowdown=VALGRIND_SLOWDOWN)
    mark()
    await asyncio.gather(*(cancel(server, task_id) for task_id in streams))
    mark()
    await settle(idle)
    mark()
    server.executor.released.set()
    await asyncio.wait([stream.task for stream in streams.values()], timeout=60)


async def work(handler: str, mode: str, what: str) -> None:
    if what == "single":
        await singles(handler, mode)
    else:
        count = int(what)
        for _ in range(BURSTS[count]):
            await burst(handler, mode, count)


def windows(handler: str, mode: str, what: str) -> list[int]:
    """The instruction count of each window of one worker process, in order."""
    with tempfile.TemporaryDirectory(prefix="cancel-instructions-") as directory:
        out = os.path.join(directory, "callgrind.out")
        command = [
            "valgrind", "--tool=callgrind", "--dump-before=os_getppid*", f"--callgrind-out-file={out}",
            sys.executable, __file__, "--worker", handler, mode, what,
        ]  # fmt: skip
        environment = {**os.environ, "PYTHONHASHSEED": "1"}
        done = subprocess.run(command, env=environment, capture_output=True, text=True)
        if done.returncode != 0:  # Say why: valgrind's own lines would hide the worker's.
            raise RuntimeError(f"worker {handler} {mode} {what} failed:\n{done.stderr[-3000:]}")
        # out.1 is everything before the first mark; then a window, the gap to the next, ...
        dumps = sorted(glob.glob(out + ".*"), key=lambda path: int(path.rsplit(".", 1)[1]))
        counts = []
        for path in dumps[1:]:
            with open(path) as dump:
                found = re.search(r"^summary: (\d+)", dump.read(), re.MULTILINE)
            counts.append(int(found.group(1)) if found else 0)
        return counts


def main(quick: bool) -> None:
    if shutil.which("valgrind") is None:
        print("cancel_instructions: valgrind is not installed (apt-get install valgrind)")
        return
    header(
        "cancel: instructions from request to answer under callgrind, medians; "
        "floor = stock whose cancel() publishes"
    )
    kinds = list(KINDS)
    sizes = ("single", "100") if quick else ("single", *map(str, BURSTS))
    jobs = [(name, what) for what in sizes for name in kinds]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        found = dict(zip(jobs, pool.map(lambda job: windows(*KINDS[job[0]], job[1]), jobs), strict=True))
    for what in sizes:
        floor = found[("floor", what)]
        for name in kinds:
            counts = found[(name, what)]
            if what == "single":  # A window, the gap to the next one, ...
                median, base = statistics.median(counts[0::2]), statistics.median(floor[0::2])
                print(f"one cancel, idle loop      {name:26} {median:12,.0f}  /floor {median / base:.3f}")
                continue
            # Per burst: to the answers, then to every run closed, then the gap to the next burst.
            answered = statistics.median(counts[0::3])
            closed = statistics.median(a + b for a, b in zip(counts[0::3], counts[1::3], strict=False))
            f_answered = statistics.median(floor[0::3])
            f_closed = statistics.median(a + b for a, b in zip(floor[0::3], floor[1::3], strict=False))
            print(
                f"{what:>5} at once, answered    {name:26} {answered / int(what):12,.0f} per task  "
                f"/floor {answered / f_answered:.3f};  all closed /floor {closed / f_closed:.3f}"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one cancel and 100 at once")
    parser.add_argument("--worker", nargs=3, metavar=("HANDLER", "MODE", "WHAT"), help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.worker:
        asyncio.run(work(*arguments.worker))
    else:
        main(arguments.quick)

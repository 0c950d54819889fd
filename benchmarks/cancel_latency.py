"""Cancel latency, request to answer, for a well-behaved and an empty cancel(): ours vs stock.

Each cancel is timed on an otherwise idle event loop: what a sample's run still has to do
after the answer (closing down, which ours does after answering) is let finish before the
next sample starts, so that it lands in neither handler's figure. Then again back to back:
the next sample starts at once, and part of each run's closing lands in the next cancel of
the same handler. Stock's and ours' cancels are interleaved within each of several processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from _common import clock, header, in_processes, percentile, ratio, settle, started
from a2a_cancelfix.testing import ScriptedExecutor, cancel, make_server
from a2a_cancelfix.testing.servers import GRACE

MODES = {"publish": "cancel() publishes CANCELED", "empty": "cancel() is empty"}
# Each row compares two arms, each a handler and its executor's cancel(), in a phase of its
# own: a cancel's time depends on what ran just before it (what is still in the processor's
# caches), so both arms of a row follow the same mix of cancels, the other arm's and their own.
ROWS = {
    "publish": (("stock", "publish"), ("ours", "publish")),
    "empty": (("stock", "empty"), ("ours", "empty")),
    # The floor: stock whose cancel() publishes CANCELED, which ours always sends.
    "floor": (("stock", "publish"), ("ours", "empty")),
}
RUN = 6  # Back to back: cancels of one arm in a row, the first left out.


async def sample(kind: str, mode: str, settled: bool) -> tuple[float, str]:
    """Time one cancel of a mid-step task; also say what it answered."""
    server = make_server(kind, ScriptedExecutor(cancel=mode), push=False, told=False)
    await started(server)
    began = clock()
    async with asyncio.timeout(GRACE + 5):  # Not wait_for: its task would be timed too.
        answer = await cancel(server, server.executor.task_id)
    took = clock() - began
    server.executor.step.open()
    if settled:
        await settle(turns=10_000)
    return took, answer


async def samples(count: int, settled: bool) -> dict:
    """``count`` cancels of each arm of each row, the arms interleaved so that the drift of a
    process (its heap, the machine's clock speed) is shared by both: one each in turn on an
    idle loop; back to back, in runs of ``RUN`` of one arm, the first of each left out, so
    that what a cancel leaves to close lands in the same arm's next one."""
    kept: dict[str, list[list[tuple[float, str]]]] = {row: [[], []] for row in ROWS}
    run, skip = (1, 0) if settled else (RUN, 1)
    for row, arms in ROWS.items():
        for index in range(-(-count // (run - skip))):
            for arm in (0, 1) if index % 2 == 0 else (1, 0):
                taken = [await sample(*arms[arm], settled) for _ in range(run)]
                kept[row][arm].extend(taken[skip:])
    return {row: [taken[:count] for taken in arms] for row, arms in kept.items()}


def main(quick: bool) -> None:
    count, processes = (25, 2) if quick else (150, 4)
    for settled in (True, False):
        how = "each on an idle loop" if settled else "back to back"
        header(f"cancel latency: {count} cancels of a task mid-step in each of {processes} processes, {how}")
        shares = in_processes(__file__, [str(count), str(int(settled))], processes)
        p50s = {}
        for row, arms in ROWS.items():
            figures = []
            for arm in (0, 1):
                latencies = [took for share in shares for took, _ in share[row][arm]]
                answers = sorted({answer for share in shares for _, answer in share[row][arm]})
                figures.append((percentile(latencies, 0.5), percentile(latencies, 0.99), "/".join(answers)))
            (s50, s99, s_answers), (o50, o99, o_answers) = figures
            p50s[row] = ratio(o50, s50)
            (stock, stock_mode), (ours, ours_mode) = arms
            print(
                f"{stock} with {MODES[stock_mode]:28} p50 {s50 * 1e3:6.3f} ms p99 {s99 * 1e3:6.3f} ms -> "
                f"{s_answers}; {ours} with {MODES[ours_mode]:28} p50 {o50 * 1e3:6.3f} ms p99 "
                f"{o99 * 1e3:6.3f} ms -> {o_answers}; p50 ratio {p50s[row]}"
            )
        print(
            f"p50 ours/floor (stock, cancel() publishes): cancel() publishes {p50s['publish']}, "
            f"cancel() is empty {p50s['floor']}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", nargs=2, type=int, metavar=("COUNT", "SETTLED"), help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.worker:
        count, settled = arguments.worker
        print(json.dumps(asyncio.run(samples(count, bool(settled)))))
    else:
        main(arguments.quick)

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
RUN = 6  # Back to back: cancels of one handler in a row, the first left out.


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
    """``count`` cancels of each handler, interleaved so that the drift of a process (its heap,
    the machine's clock speed) is shared by both: one each in turn on an idle loop; back to
    back, in runs of ``RUN`` of one handler, the first of each left out, so that what a cancel
    leaves to close lands in the same handler's next one."""
    kinds = ("stock", "ours")
    kept: dict[str, dict[str, list[tuple[float, str]]]] = {
        mode: {kind: [] for kind in kinds} for mode in MODES
    }
    run, skip = (1, 0) if settled else (RUN, 1)
    for index in range(-(-count // (run - skip))):
        for mode in MODES:
            for kind in kinds if index % 2 == 0 else kinds[::-1]:
                taken = [await sample(kind, mode, settled) for _ in range(run)]
                kept[mode][kind].extend(taken[skip:])
    return {mode: {kind: taken[:count] for kind, taken in by_kind.items()} for mode, by_kind in kept.items()}


def main(quick: bool) -> None:
    count, processes = (25, 2) if quick else (150, 4)
    for settled in (True, False):
        how = "each on an idle loop" if settled else "back to back"
        header(f"cancel latency: {count} cancels of a task mid-step in each of {processes} processes, {how}")
        shares = in_processes(__file__, [str(count), str(int(settled))], processes)
        p50s = {}
        for mode, meaning in MODES.items():
            figures = {}
            for kind in ("stock", "ours"):
                latencies = [took for share in shares for took, _ in share[mode][kind]]
                answers = sorted({answer for share in shares for _, answer in share[mode][kind]})
                figures[kind] = (percentile(latencies, 0.5), percentile(latencies, 0.99), "/".join(answers))
            (s50, s99, s_answers), (o50, o99, o_answers) = figures["stock"], figures["ours"]
            p50s[mode] = (s50, o50)
            print(
                f"{meaning:28} stock p50 {s50 * 1e3:6.3f} ms p99 {s99 * 1e3:6.3f} ms -> {s_answers}; "
                f"ours p50 {o50 * 1e3:6.3f} ms p99 {o99 * 1e3:6.3f} ms -> {o_answers}; "
                f"p50 ours/stock {ratio(o50, s50)}"
            )
        # The floor: stock whose cancel() publishes CANCELED, which ours always sends.
        floor = p50s["publish"][0]
        print(
            f"{'':28} p50 ours/floor (stock, cancel() publishes): cancel() publishes "
            f"{ratio(p50s['publish'][1], floor)}, cancel() is empty {ratio(p50s['empty'][1], floor)}"
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

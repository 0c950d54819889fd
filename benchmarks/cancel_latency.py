"""Cancel latency, request to answer, for a well-behaved and an empty cancel(): ours vs stock.

Each cancel is timed on an otherwise idle event loop: what a sample's run still has to do
after the answer (closing down, which ours does after answering) is let finish before the
next sample starts, so that it lands in neither handler's figure. Then again back to back:
the next sample starts at once, and part of each run's closing lands in the next cancel of
the same handler. In several processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from _common import clock, header, in_processes, percentile, ratio, settle, started
from a2a_cancelfix.testing import ScriptedExecutor, cancel, make_server
from a2a_cancelfix.testing.servers import GRACE

MODES = {"publish": "cancel() publishes CANCELED", "empty": "cancel() is empty"}


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
    """Each handler's ``count`` cancels in a row, so that back to back, what a cancel leaves
    to close lands in the same handler's next one."""
    return {
        mode: {kind: [await sample(kind, mode, settled) for _ in range(count)] for kind in ("stock", "ours")}
        for mode in MODES
    }


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

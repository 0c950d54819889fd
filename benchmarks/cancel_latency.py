"""Cancel latency, request to answer, for a well-behaved and an empty cancel(): ours vs stock.

Each cancel is timed on an otherwise idle event loop: what a sample's run still has to do
after the answer (closing down, which ours does after answering) is let finish before the
next sample starts, so that it lands in neither handler's figure. Stock and ours alternate,
in several processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from a2a_cancelfix.check import GRACE, ScriptedExecutor, cancel, make_server, start

from _common import clock, header, in_processes, percentile, ratio

MODES = {"publish": "cancel() publishes CANCELED", "empty": "cancel() is empty"}


async def sample(kind: str, mode: str) -> tuple[float, str]:
    """Time one cancel of a mid-step task; also say what it answered."""
    server = make_server(kind, ScriptedExecutor(cancel=mode), push=False)
    await start(server)
    started = clock()
    async with asyncio.timeout(GRACE + 5):  # Not wait_for: its task would be timed too.
        answer = await cancel(server, server.executor.task_id)
    took = clock() - started
    server.executor.step.open()
    await settle()
    return took, answer


async def settle(turns: int = 10_000) -> None:
    """Let the loop run until no other task is left (the run has closed), or ``turns`` have passed."""
    for _ in range(turns):
        if len(asyncio.all_tasks()) == 1:
            return
        await asyncio.sleep(0)


async def samples(count: int) -> dict:
    results: dict = {mode: {"stock": [], "ours": [], "answers": {"stock": [], "ours": []}} for mode in MODES}
    for index in range(count):
        for mode in MODES:
            for kind in ("stock", "ours") if index % 2 == 0 else ("ours", "stock"):
                took, answer = await sample(kind, mode)
                results[mode][kind].append(took)
                if answer not in results[mode]["answers"][kind]:
                    results[mode]["answers"][kind].append(answer)
    return results


def main(quick: bool) -> None:
    count, processes = (25, 2) if quick else (150, 4)
    header(f"cancel latency: {count} cancels of a task mid-step in each of {processes} processes, request to answer")
    shares = in_processes(__file__, [str(count)], processes)
    for mode, meaning in MODES.items():
        figures = {}
        for kind in ("stock", "ours"):
            latencies = [took for share in shares for took in share[mode][kind]]
            answers = sorted({answer for share in shares for answer in share[mode]["answers"][kind]})
            figures[kind] = (percentile(latencies, 0.5), percentile(latencies, 0.99), "/".join(answers))
        (s50, s99, s_answers), (o50, o99, o_answers) = figures["stock"], figures["ours"]
        print(
            f"{meaning:28} stock p50 {s50 * 1e3:6.3f} ms p99 {s99 * 1e3:6.3f} ms -> {s_answers}; "
            f"ours p50 {o50 * 1e3:6.3f} ms p99 {o99 * 1e3:6.3f} ms -> {o_answers}; "
            f"p50 ours/stock {ratio(o50, s50)}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", type=int, metavar="COUNT", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.worker:
        print(json.dumps(asyncio.run(samples(arguments.worker))))
    else:
        main(arguments.quick)

"""Cancel latency, request to answer, for a well-behaved and an empty cancel(): ours vs stock."""

from __future__ import annotations

import argparse
import asyncio

from a2a_cancelfix.check import GRACE, ScriptedExecutor, cancel, make_server, start

from _common import clock, header, percentile, ratio


async def samples(kind: str, mode: str, count: int) -> tuple[list[float], set[str]]:
    """Time ``count`` cancels of a mid-step task; also say what they answered."""
    latencies, answers = [], set()
    for _ in range(count):
        server = make_server(kind, ScriptedExecutor(cancel=mode), push=False)
        await start(server)
        started = clock()
        answer = await asyncio.wait_for(cancel(server, server.executor.task_id), GRACE + 5)
        latencies.append(clock() - started)
        answers.add(answer)
        server.executor.step.open()
    return latencies, answers


def main(quick: bool) -> None:
    count = 50 if quick else 300
    header(f"cancel latency: {count} cancels of a task mid-step, request to answer")
    for mode, meaning in (("publish", "cancel() publishes CANCELED"), ("empty", "cancel() is empty")):
        stats = {}
        for kind in ("stock", "ours"):
            latencies, answers = asyncio.run(samples(kind, mode, count))
            stats[kind] = (percentile(latencies, 0.5), percentile(latencies, 0.99), answers)
        (s50, s99, s_answers), (o50, o99, o_answers) = stats["stock"], stats["ours"]
        print(
            f"{meaning:28} stock p50 {s50 * 1e3:6.2f} ms p99 {s99 * 1e3:6.2f} ms -> {'/'.join(sorted(s_answers))}; "
            f"ours p50 {o50 * 1e3:6.2f} ms p99 {o99 * 1e3:6.2f} ms -> {'/'.join(sorted(o_answers))}; "
            f"p50 ours/stock {ratio(o50, s50)}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    main(parser.parse_args().quick)

"""SendMessage and streaming throughput with no cancels: a2a-cancelfix vs the stock handler.

Each figure is the median over pairs of rounds (stock and ours back to back), gathered in
several processes: a process's string hashing, and so its memory layout, shifts both
handlers' speed by a few percent, more than the difference being measured.
"""

from __future__ import annotations

import argparse
import json
import statistics

from a2a.types import SendMessageRequest

from _common import QuickExecutor, clock, header, in_processes, interleaved
from a2a_cancelfix.testing import caller, make_server, message


def measure(messages: int, streaming: bool, options: dict):
    async def run(kind: str) -> float:
        server = make_server(kind, QuickExecutor(), push=False, told=False, **options)
        handler, context = server.handler, caller()
        requests = [SendMessageRequest(message=message()) for _ in range(messages)]
        started = clock()
        for request in requests:
            if streaming:
                async for _event in handler.on_message_send_stream(request, context):
                    pass
            else:
                await handler.on_message_send(request, context)
        return messages / (clock() - started)

    return run


def worker(messages: int, rounds: int, unwatched: float | None) -> None:
    """One process's share: rates and paired ratios, as JSON on stdout."""
    results = {}
    options = {} if unwatched is None else {"cancel_unwatched_after": unwatched}
    for streaming in (False, True):
        rates, pairs = interleaved(measure(messages, streaming, options), rounds)
        results["streaming" if streaming else "blocking"] = {"rates": rates, "pairs": pairs}
    print(json.dumps(results))


def main(quick: bool, unwatched: float | None) -> None:
    messages, rounds, processes = (100, 4, 2) if quick else (200, 8, 6)
    header(
        f"hot path: {messages} messages a round, {rounds} pairs of rounds in each of "
        f"{processes} processes, medians"
        + ("" if unwatched is None else f"; ours with cancel_unwatched_after={unwatched:g}")
    )
    arguments = [str(messages), str(rounds)] + ([] if unwatched is None else ["--unwatched", str(unwatched)])
    shares = in_processes(__file__, arguments, processes)
    for name in ("blocking", "streaming"):
        stock = statistics.median(r for share in shares for r in share[name]["rates"]["stock"])
        ours = statistics.median(r for share in shares for r in share[name]["rates"]["ours"])
        paired = statistics.median(p for share in shares for p in share[name]["pairs"])
        print(
            f"{name + ' SendMessage':24} stock {stock:8.0f}/s  ours {ours:8.0f}/s  "
            f"ours/stock {paired:.3f}  (target >= 0.97)"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--unwatched", type=float, metavar="SECONDS", help="ours with cancel_unwatched_after")
    parser.add_argument("--worker", nargs=2, type=int, metavar=("MESSAGES", "ROUNDS"), help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.worker:
        worker(*arguments.worker, arguments.unwatched)
    else:
        main(arguments.quick, arguments.unwatched)

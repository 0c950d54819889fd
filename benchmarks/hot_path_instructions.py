"""Instructions per message with no cancels, ours vs stock: a figure that does not move.

`hot_path.py`'s wall-clock ratio moves by about 1% from run to run, as much as a change to the
hot path is worth. Here ``valgrind --tool=callgrind`` counts the instructions of a process that
sends N messages and of one that sends N + 200: the difference, over 200, is one message's
count, with start-up taken out. Same hash seed everywhere. Needs valgrind (Debian's package);
about 4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import gc
import os
import re
import shutil
import subprocess
import sys

from a2a.types import SendMessageRequest

from _common import QuickExecutor, header
from a2a_cancelfix.testing import caller, make_server, message

BASE, EXTRA = 50, 200
UNWATCHED = "ours,unwatched"


async def send(kind: str, streaming: bool, count: int) -> None:
    # "ours, unwatched": ours with cancel_unwatched_after, which counts each stream and sender.
    options = {"cancel_unwatched_after": 30.0} if kind == UNWATCHED else {}
    server = make_server(kind.split(",")[0], QuickExecutor(), push=False, **options)
    handler, context = server.handler, caller()
    # What the imports left is out of the collector's reach: a full collection landing among the
    # counted messages would otherwise walk it, and move a message's count by tens of thousands.
    gc.freeze()
    for _ in range(count):
        request = SendMessageRequest(message=message())
        if streaming:
            async for _event in handler.on_message_send_stream(request, context):
                pass
        else:
            await handler.on_message_send(request, context)


def instructions(kind: str, streaming: bool, count: int) -> int:
    """Instructions that a whole process sending ``count`` messages executes."""
    command = [
        "valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
        sys.executable, __file__, "--worker", kind, "stream" if streaming else "block", str(count),
    ]  # fmt: skip
    environment = {**os.environ, "PYTHONHASHSEED": "1"}
    output = subprocess.run(command, env=environment, capture_output=True, text=True, check=True)
    return int(re.search(r"Collected : (\d+)", output.stderr).group(1))  # type: ignore[union-attr]


def per_message(kind: str, streaming: bool) -> float:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        base, more = pool.map(lambda count: instructions(kind, streaming, count), (BASE, BASE + EXTRA))
    return (more - base) / EXTRA


def main(quick: bool) -> None:
    if shutil.which("valgrind") is None:
        print("hot_path_instructions: valgrind is not installed (apt-get install valgrind)")
        return
    header(f"hot path: instructions per message, {BASE + EXTRA} minus {BASE} messages under callgrind")
    for streaming in (False, True):
        stock, ours = per_message("stock", streaming), per_message("ours", streaming)
        unwatched = per_message(UNWATCHED, streaming)
        name = "streaming" if streaming else "blocking"
        print(
            f"{name + ' SendMessage':24} stock {stock:10,.0f}  ours {ours:10,.0f}  "
            f"ours/stock {ours / stock:.4f} ({(ours / stock - 1) * 100:+.2f}%)"
        )
        print(
            f"{'  cancel_unwatched_after':24} {'':16} ours {unwatched:10,.0f}  "
            f"ours/stock {unwatched / stock:.4f} ({(unwatched / stock - 1) * 100:+.2f}%), "
            f"over ours without it {(unwatched / ours - 1) * 100:+.2f}%"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the same: it is already one count each")
    parser.add_argument("--worker", nargs=3, metavar=("KIND", "MODE", "COUNT"), help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.worker:
        kind, mode, count = arguments.worker
        asyncio.run(send(kind, mode == "stream", int(count)))
    else:
        main(arguments.quick)

"""Instructions per message with no cancels, ours vs stock: a figure that does not move.

`hot_path.py`'s wall-clock ratio moves by about 1% from run to run, as much as a change to the
hot path is worth. Here ``valgrind --tool=callgrind`` counts the instructions of 200 messages
sent after 50 that warm up: the process calls ``os.getppid()`` at each end of the window, and
callgrind dumps its counts before that C function (``--dump-before``), so the window is one dump,
start-up and warm-up left out. Same hash seed everywhere. Needs valgrind (Debian's package);
about 5 minutes on 2 cores (two processes at a time, one per handler and mode).
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
import tempfile

from a2a.types import SendMessageRequest

from _common import QuickExecutor, header
from a2a_cancelfix.testing import caller, make_server, message

WARM, COUNTED = 50, 200
UNWATCHED = "ours,unwatched"


def mark() -> None:
    os.getppid()  # callgrind dumps its counts here: one end of the window.


async def send(kind: str, streaming: bool) -> None:
    # "ours, unwatched": ours with cancel_unwatched_after, which counts each stream and sender.
    options = {"cancel_unwatched_after": 30.0} if kind == UNWATCHED else {}
    server = make_server(kind.split(",")[0], QuickExecutor(), push=False, told=False, **options)
    handler, context = server.handler, caller()

    async def one() -> None:
        request = SendMessageRequest(message=message())
        if streaming:
            async for _event in handler.on_message_send_stream(request, context):
                pass
        else:
            await handler.on_message_send(request, context)

    for _ in range(WARM):
        await one()
    # What the imports and the warm-up left is out of the collector's reach: a full collection
    # landing among the counted messages would otherwise walk it, and move a message's count by
    # tens of thousands.
    gc.collect()
    gc.freeze()
    mark()
    for _ in range(COUNTED):
        await one()
    mark()


def per_message(kind: str, streaming: bool) -> float:
    """Instructions per message in the window of one worker process."""
    with tempfile.TemporaryDirectory(prefix="hot-path-instructions-") as directory:
        out = os.path.join(directory, "callgrind.out")
        command = [
            "valgrind", "--tool=callgrind", "--dump-before=os_getppid*", f"--callgrind-out-file={out}",
            sys.executable, __file__, "--worker", kind, "stream" if streaming else "block",
        ]  # fmt: skip
        environment = {**os.environ, "PYTHONHASHSEED": "1"}
        subprocess.run(command, env=environment, capture_output=True, text=True, check=True)
        # out.1 is everything before the first mark, out.2 the window.
        with open(out + ".2") as dump:
            found = re.search(r"^summary: (\d+)", dump.read(), re.MULTILINE)
        assert found is not None, "callgrind wrote no summary for the window"
        return int(found.group(1)) / COUNTED


def main(quick: bool) -> None:
    if shutil.which("valgrind") is None:
        print("hot_path_instructions: valgrind is not installed (apt-get install valgrind)")
        return
    header(f"hot path: instructions per message, {COUNTED} after {WARM} under callgrind")
    jobs = [(kind, streaming) for streaming in (False, True) for kind in ("stock", "ours", UNWATCHED)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        counts = dict(zip(jobs, pool.map(lambda job: per_message(*job), jobs), strict=True))
    for streaming in (False, True):
        stock, ours, unwatched = (counts[kind, streaming] for kind in ("stock", "ours", UNWATCHED))
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
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "MODE"), help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.worker:
        kind, mode = arguments.worker
        asyncio.run(send(kind, mode == "stream"))
    else:
        main(arguments.quick)

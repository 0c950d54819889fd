"""Instructions per message with no cancels, ours vs stock: a figure that does not move with the load.

`hot_path.py`'s wall-clock ratio moves by about 1% from run to run, as much as a change to the
hot path is worth. Here ``valgrind --tool=callgrind`` counts the instructions of 200 messages
sent after 50 that warm up: the process calls ``os.getppid()`` at each end of the window, and
callgrind dumps its counts before that C function (``--dump-before``), so the window is one dump,
start-up and warm-up left out.

A count still depends on the process's memory layout. CPython's method cache is one table
indexed by a type's version tag and a name's address, so which of a message's attribute lookups
evict each other there depends on everything imported and allocated before the window: a few
more modules in the process move ours/stock, either way, by as much as a change to the hot
path is worth. So:

* A worker holds the handlers it counts and what they need: the SDK, this package's runtime and
  `QuickExecutor`, built as a user builds them, not the testing kit (whose modules would move
  the figure whenever the kit changes). Stock's and ours' workers import the same modules.
* Each pair is counted under several hash seeds, each a layout of its own, stock and ours under
  the same one. The figure is the median of the seeds' ratios; their range shows the layouts'
  spread.
* The workers load bytecode written before they start, rather than compiling the SDK under
  callgrind each time (``PYTHONDONTWRITEBYTECODE``, which some images set, would make them).

Needs valgrind (Debian's package); about 2 minutes on 2 idle cores, two workers at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import gc
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import uuid

from a2a.auth.user import User
from a2a.server.context import ServerCallContext
from a2a.server.request_handlers import DefaultRequestHandler as StockHandler
from a2a.server.tasks import InMemoryTaskStore
from a2a.types import AgentCapabilities, AgentCard, Message, Part, Role, SendMessageRequest

from _common import QuickExecutor, header
from a2a_cancelfix import DefaultRequestHandler

WARM, COUNTED = 50, 200
KINDS = ("stock", "ours", "ours,unwatched")
SEEDS = ("1", "2", "3")


class _Alice(User):
    @property
    def is_authenticated(self) -> bool:
        return True

    @property
    def user_name(self) -> str:
        return "alice"


def mark() -> None:
    os.getppid()  # callgrind dumps its counts here: one end of the window.


def handler(kind: str) -> StockHandler:
    arguments = {
        "agent_executor": QuickExecutor(),
        "task_store": InMemoryTaskStore(),
        "agent_card": AgentCard(
            name="hot path", description="", version="1", capabilities=AgentCapabilities(streaming=True)
        ),
    }
    if kind == "stock":
        return StockHandler(**arguments)
    # "ours,unwatched": ours with cancel_unwatched_after, which counts each stream and sender.
    return DefaultRequestHandler(**arguments, cancel_unwatched_after=30.0 if kind == KINDS[2] else None)


async def send(kind: str, streaming: bool) -> None:
    handler_, context = handler(kind), ServerCallContext(user=_Alice())

    async def one() -> None:
        message = Message(role=Role.ROLE_USER, message_id=uuid.uuid4().hex, parts=[Part(text="go")])
        request = SendMessageRequest(message=message)
        if streaming:
            async for _event in handler_.on_message_send_stream(request, context):
                pass
        else:
            await handler_.on_message_send(request, context)

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


def worker(kind: str, streaming: bool) -> list[str]:
    return [sys.executable, __file__, "--worker", kind, "stream" if streaming else "block"]


def compile_first() -> None:
    """Run each worker once, natively, writing the bytecode of everything it imports."""
    environment = {**os.environ, "PYTHONHASHSEED": SEEDS[0]}
    environment.pop("PYTHONDONTWRITEBYTECODE", None)
    for kind in KINDS:
        for streaming in (False, True):
            subprocess.run(worker(kind, streaming), env=environment, capture_output=True, check=True)


def per_message(kind: str, streaming: bool, seed: str) -> float:
    """Instructions per message in the window of one worker process."""
    with tempfile.TemporaryDirectory(prefix="hot-path-instructions-") as directory:
        out = os.path.join(directory, "callgrind.out")
        command = [
            "valgrind", "--tool=callgrind", "--dump-before=os_getppid*", f"--callgrind-out-file={out}",
            *worker(kind, streaming),
        ]  # fmt: skip
        environment = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run(command, env=environment, capture_output=True, text=True, check=True)
        # out.1 is everything before the first mark, out.2 the window.
        with open(out + ".2") as dump:
            found = re.search(r"^summary: (\d+)", dump.read(), re.MULTILINE)
        assert found is not None, "callgrind wrote no summary for the window"
        return int(found.group(1)) / COUNTED


def over(ratios: list[float]) -> str:
    """The median of ``ratios`` over 1 as a percentage, and their range."""
    low, high = min(ratios), max(ratios)
    spread = f" ({(low - 1) * 100:+.2f}% to {(high - 1) * 100:+.2f}%)" if len(ratios) > 1 else ""
    return f"{(statistics.median(ratios) - 1) * 100:+.2f}%{spread}"


def main(quick: bool) -> None:
    if shutil.which("valgrind") is None:
        print("hot_path_instructions: valgrind is not installed (apt-get install valgrind)")
        return
    seeds = SEEDS[:1] if quick else SEEDS
    header(
        f"hot path: instructions per message, {COUNTED} after {WARM} under callgrind, hash seeds {', '.join(seeds)}"
    )
    compile_first()
    jobs = [(kind, streaming, seed) for seed in seeds for streaming in (False, True) for kind in KINDS]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        counts = dict(zip(jobs, pool.map(lambda job: per_message(*job), jobs), strict=True))
    for streaming in (False, True):
        stock, ours, unwatched = ([counts[kind, streaming, seed] for seed in seeds] for kind in KINDS)
        name = "streaming" if streaming else "blocking"
        print(
            f"{name + ' SendMessage':24} stock {statistics.median(stock):10,.0f}  "
            f"ours {statistics.median(ours):10,.0f}  ours/stock "
            f"{over([o / s for o, s in zip(ours, stock, strict=True)])}"
        )
        print(
            f"{'  cancel_unwatched_after':24} {'':16} ours {statistics.median(unwatched):10,.0f}  ours/stock "
            f"{over([u / s for u, s in zip(unwatched, stock, strict=True)])}, over ours without it "
            f"{over([u / o for u, o in zip(unwatched, ours, strict=True)])}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help=f"one hash seed, not {len(SEEDS)}")
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "MODE"), help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.worker:
        kind, mode = arguments.worker
        asyncio.run(send(kind, mode == "stream"))
    else:
        main(arguments.quick)

"""Bytecodes and calls the interpreter runs, ours vs stock: per message, and per cancel against
the floor (stock whose ``cancel()`` publishes CANCELED).

``hot_path_instructions.py`` and ``cancel_instructions.py`` count machine instructions, which
include the interpreter's own lookups; here a trace hook counts what the Python code itself
asks for: bytecodes executed, Python calls (a coroutine's resume counts as one) and C calls,
with the collector off inside the window. Where these match and the clock does not, the
difference is in how the machine runs the same work (its caches), not in the work. About
a minute; no valgrind.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
from collections import Counter
from collections.abc import Awaitable
from types import FrameType
from typing import Any

from a2a.types import SendMessageRequest

from _common import QuickExecutor, header, settle, started
from a2a_cancelfix.testing import ScriptedExecutor, caller, cancel, make_server, message

WARM = 20


class Counts:
    """What the trace hooks saw while `counting`: bytecodes, Python calls, C calls."""

    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()

    def _trace(self, frame: FrameType, event: str, _: Any) -> Any:
        if event == "call":
            self.seen["Python calls"] += 1
            frame.f_trace_opcodes, frame.f_trace_lines = True, False
        elif event == "opcode":
            self.seen["bytecodes"] += 1
        return self._trace

    def _profile(self, _frame: FrameType, event: str, _arg: Any) -> None:
        if event == "c_call":
            self.seen["C calls"] += 1

    async def counting(self, work: Awaitable[Any]) -> None:
        gc.disable()
        sys.settrace(self._trace)
        sys.setprofile(self._profile)
        try:
            await work
        finally:
            sys.settrace(None)
            sys.setprofile(None)
            gc.enable()


async def per_message(kind: str, streaming: bool, count: int) -> Counts:
    server = make_server(kind, QuickExecutor(), push=False, told=False)
    handler, context = server.handler, caller()

    async def one() -> None:
        request = SendMessageRequest(message=message())
        if streaming:
            async for _event in handler.on_message_send_stream(request, context):
                pass
        else:
            await handler.on_message_send(request, context)

    counts = Counts()
    for index in range(WARM + count):
        await (counts.counting(one()) if index >= WARM else one())
    return counts


async def per_cancel(kind: str, mode: str, count: int) -> Counts:
    """Each cancel of a task mid-step, request to answer, on an otherwise idle loop."""
    counts = Counts()
    for index in range(WARM + count):
        server = make_server(kind, ScriptedExecutor(cancel=mode), push=False, told=False)
        await started(server)
        call = cancel(server, server.executor.task_id)
        await (counts.counting(call) if index >= WARM else call)
        server.executor.step.open()
        await settle(turns=10_000)
    return counts


def report(name: str, count: int, base: Counts, ours: Counts, base_name: str) -> None:
    for what in ("bytecodes", "Python calls", "C calls"):
        theirs, mine = base.seen[what] / count, ours.seen[what] / count
        print(
            f"{name:34} {what:13} {base_name} {theirs:9,.1f}  ours {mine:9,.1f}  "
            f"ours/{base_name} {mine / theirs:.4f}"
        )


def main(quick: bool) -> None:
    messages, cancels = (50, 20) if quick else (200, 60)
    header(f"bytecodes and calls: per message ({messages} after {WARM}), per cancel ({cancels} after {WARM})")
    for streaming in (False, True):
        stock, ours = (asyncio.run(per_message(kind, streaming, messages)) for kind in ("stock", "ours"))
        report(
            "streaming SendMessage" if streaming else "blocking SendMessage", messages, stock, ours, "stock"
        )
    floor = asyncio.run(per_cancel("stock", "publish", cancels))
    for mode, meaning in (("publish", "publishes"), ("empty", "is empty")):
        ours = asyncio.run(per_cancel("ours", mode, cancels))
        report(f"cancel, ours' cancel() {meaning}", cancels, floor, ours, "floor")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    main(parser.parse_args().quick)

"""What a checkpoint costs inside a run, with no cancel pending and with one pending."""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import timeit

from _common import header, ratio
from a2a_cancelfix.checkpoints import Run, RunCancelled, checkpoint, enter_run


def empty() -> None:
    return None


def pending() -> None:
    try:  # noqa: SIM105 (measured: contextlib.suppress would add its own cost)
        checkpoint()
    except RunCancelled:
        pass


def in_run(cancelled: bool) -> contextvars.Context:
    context = contextvars.copy_context()
    run = context.run(Run, "bench")
    context.run(enter_run, run)
    if cancelled:
        run.cancel("bench")
    return context


async def awaited(count: int) -> float:
    """Seconds per ``await checkpoint()`` in a coroutine of a run."""
    enter_run(Run("bench"))
    loop = asyncio.get_running_loop()
    started = loop.time()
    for _ in range(count):
        await checkpoint()
    return (loop.time() - started) / count


def main(quick: bool) -> None:
    count = 200_000 if quick else 2_000_000
    header(f"checkpoint cost: {count} calls")
    baseline = min(timeit.repeat(empty, number=count, repeat=5)) / count
    idle_context, cancelled_context = in_run(False), in_run(True)
    idle = min(idle_context.run(timeit.repeat, checkpoint, number=count, repeat=5)) / count
    raised = min(cancelled_context.run(timeit.repeat, pending, number=count // 10, repeat=5)) / (count // 10)
    outside = min(timeit.repeat(checkpoint, number=count, repeat=5)) / count
    per_await = asyncio.run(awaited(count))
    print(f"empty function call (reference)     {baseline * 1e9:7.1f} ns")
    print(
        f"checkpoint(), no cancel pending     {idle * 1e9:7.1f} ns  ({ratio(idle, baseline)} x a call; target < 1000 ns)"
    )
    print(f"await checkpoint(), no cancel       {per_await * 1e9:7.1f} ns")
    print(f"checkpoint() outside any run        {outside * 1e9:7.1f} ns")
    print(f"checkpoint() raising, cancel pending {raised * 1e9:6.1f} ns (raise and catch RunCancelled)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    main(parser.parse_args().quick)

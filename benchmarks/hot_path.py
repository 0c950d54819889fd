"""SendMessage and streaming throughput with no cancels: a2a-cancelfix vs the stock handler."""

from __future__ import annotations

import argparse

from a2a.types import SendMessageRequest

from a2a_cancelfix.check import caller, make_server, message

from _common import QuickExecutor, clock, header, interleaved


def measure(messages: int, streaming: bool):
    async def run(kind: str) -> float:
        server = make_server(kind, QuickExecutor(), push=False)
        handler, context = server.handler, caller()
        started = clock()
        for _ in range(messages):
            request = SendMessageRequest(message=message())
            if streaming:
                async for _event in handler.on_message_send_stream(request, context):
                    pass
            else:
                await handler.on_message_send(request, context)
        return messages / (clock() - started)

    return run


def main(quick: bool) -> None:
    messages, rounds = (100, 9) if quick else (200, 41)
    header(f"hot path: {messages} messages a round, {rounds} rounds, medians")
    for streaming in (False, True):
        rates, paired = interleaved(measure(messages, streaming), rounds)
        name = "streaming SendMessage" if streaming else "blocking SendMessage"
        print(
            f"{name:24} stock {rates['stock']:8.0f}/s  ours {rates['ours']:8.0f}/s  "
            f"ours/stock {paired:.3f} (paired)  (target >= 0.97)"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    main(parser.parse_args().quick)

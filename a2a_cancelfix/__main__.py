"""The ``a2a-cancelfix`` command."""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="a2a-cancelfix", description="Cancellation that always ends, for a2a-sdk 1.x."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser(
        "check", help="run the cancel scenarios against the installed a2a-sdk, stock vs ours"
    )
    check.add_argument("--json", action="store_true", help="print the results as JSON")
    demo = commands.add_parser("demo", help="serve a demo A2A agent to cancel by hand")
    demo.add_argument("--host", default="127.0.0.1")
    demo.add_argument("--port", type=int, default=8000)
    arguments = parser.parse_args(argv)

    if arguments.command == "demo":
        from a2a_cancelfix import demo as server

        return server.run(arguments.host, arguments.port)

    # The scenarios provoke misbehaving executors on purpose: keep their log lines quiet.
    logging.basicConfig(level=logging.CRITICAL)
    from a2a_cancelfix import check as report

    rows = report.run_all()
    print(report.as_json(rows) if arguments.json else report.render(rows))
    return 0 if all(row.holds for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

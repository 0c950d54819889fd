"""The ``a2a-cancelfix`` command line (``python -m a2a_cancelfix`` runs it too)."""

from __future__ import annotations

import argparse
import logging
import re
import sys
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from a2a_cancelfix.testing import Row


def main(argv: list[str] | None = None) -> int:
    from a2a_cancelfix.tools.check import EXIT_CODES

    parser = argparse.ArgumentParser(
        prog="a2a-cancelfix", description="Cancellation that always ends, for a2a-sdk 1.x."
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {version('a2a-cancelfix')} (a2a-sdk {version('a2a-sdk')})",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser(
        "check",
        help="run the cancel scenarios against the installed a2a-sdk, stock vs ours",
        description=(
            "Run each cancel scenario against the installed a2a-sdk's own handler (stock), the stock\n"
            "handler around a CancellableExecutor, and a2a-cancelfix's handler. Print a table, then a\n"
            "verdict on whether this a2a-sdk still needs a2a-cancelfix, naming the scenarios stock\n"
            "fails and those that did not run."
        ),
        epilog="exit status:\n" + "\n".join(f"  {code}  {meaning}" for code, meaning in EXIT_CODES.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check.add_argument("--json", action="store_true", help="print the results as JSON")
    check.add_argument(
        "--fail-when-removable",
        action="store_true",
        help="exit 3 once a2a-cancelfix can be removed (every scenario ran and stock a2a-sdk passes "
        "each): a CI job then fails to tell you",
    )
    check.add_argument(
        "--repro",
        metavar="SCENARIO",
        help="print a standalone script (a2a-sdk only) that reproduces a scenario stock fails, for "
        "an upstream bug report; exit 2 if stock passes it",
    )
    demo = commands.add_parser("demo", help="serve a demo A2A agent to cancel by hand")
    demo.add_argument("--host", default="127.0.0.1")
    demo.add_argument("--port", type=_port, default=8000)
    sweep = commands.add_parser(
        "sweep", help="cancel your executor at each of its cancel points; exit 0 if every row holds"
    )
    sweep.add_argument("executor", metavar="MODULE:NAME", help="an executor class or zero-argument factory")
    sweep.add_argument(
        "--message", action="append", help="the message that starts the task; again for each follow-up"
    )
    sweep.add_argument(
        "--origin",
        action="append",
        choices=("local", "remote", "client leaves", "unwatched"),
        help="only these origins (unwatched: only when asked)",
    )
    sweep.add_argument("--grace-period", type=float, default=1.0, help="the handler's cancel_grace_period")
    sweep.add_argument(
        "--released",
        metavar="MODULE:NAME",
        help="released(executor) -> bool (may be async): true once the executor let go of what it holds",
    )
    sweep.add_argument(
        "--every-occurrence",
        action="store_true",
        help="cancel at every occurrence of a repeated code path (a loop's iterations), not only at "
        "its first, second and last",
    )
    sweep.add_argument("--fail-fast", action="store_true", help="stop at the first failing row")
    sweep.add_argument(
        "--write",
        metavar="DIR",
        help="write each failing row's scenario file (cancel_*.toml) into DIR, for play and pytest",
    )
    sweep.add_argument(
        "--real-time",
        action="store_true",
        help="run on the real clock, for an executor that paces itself by the wall clock (by "
        "default, waits that only the loop's own timers end take no real time)",
    )
    sweep.add_argument("--json", action="store_true", help="print the rows as JSON")
    play = commands.add_parser("play", help="replay the cancel moment a scenario file describes; exit 0/1")
    play.add_argument("file", help="a cancel_*.toml scenario file")
    arguments, unknown = parser.parse_known_args(argv)
    if unknown:  # Said with the command's usage, not the top level's, which lists no option of it.
        commands.choices[arguments.command].error(f"unrecognized arguments: {' '.join(unknown)}")

    if arguments.command == "demo":
        from a2a_cancelfix.tools import demo as server

        return server.run(arguments.host, arguments.port)
    if arguments.command in ("sweep", "play"):
        return _kit(arguments)

    # The scenarios provoke misbehaving executors on purpose: keep their log lines quiet.
    logging.basicConfig(level=logging.CRITICAL)
    from a2a_cancelfix.tools import check as report

    if arguments.repro is not None:
        return _repro(arguments.repro)
    rows = report.run_all()
    print(report.as_json(rows) if arguments.json else report.render(rows))
    return report.exit_status(rows, fail_when_removable=arguments.fail_when_removable)


def _port(text: str) -> int:
    """A TCP port to serve on: refused here, as argparse refuses, not by the server's traceback."""
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 1 to 65535, not {text!r}")
    return port


def _repro(name: str) -> int:
    """``check --repro``: print the scenario's script, or say why there is none (exit 2)."""
    from a2a_cancelfix.tools import check, repro

    try:
        print(repro.script_for(name))
    except repro.NoRepro as reason:
        print(f"a2a-cancelfix check --repro: {reason}", file=sys.stderr)
        return check.USAGE
    return 0


def _kit(arguments: argparse.Namespace) -> int:
    """``sweep`` and ``play``: 0 when every row holds, 1 when one fails, 2 for bad input."""
    import asyncio
    import json
    import os

    # The sweep provokes the executor on purpose: the rows say what happened, not the logs.
    logging.basicConfig(level=logging.CRITICAL)
    sys.path.insert(0, os.getcwd())
    from a2a_cancelfix.testing import ORIGINS, play, sweep
    from a2a_cancelfix.testing.scenario_file import load

    try:
        if arguments.command == "play":
            report = play(arguments.file)
        else:
            progress = _Progress(sys.stderr, arguments.write)
            factory = load(arguments.executor)
            released = load(arguments.released) if arguments.released else None
            messages = arguments.message or ["hello"]
            origins = arguments.origin or ORIGINS
            report = asyncio.run(
                sweep(
                    factory,
                    message=messages,
                    origins=origins,
                    grace_period=arguments.grace_period,
                    released=released,
                    every_occurrence=arguments.every_occurrence,
                    fail_fast=arguments.fail_fast,
                    real_time=arguments.real_time,
                    progress=progress,
                )
            )
            progress.end()
    except (ValueError, ImportError, OSError) as error:
        print(f"a2a-cancelfix {arguments.command}: {error}", file=sys.stderr)
        return 2
    if arguments.command == "sweep" and arguments.json:
        print(json.dumps([row.as_dict() for row in report.rows], indent=2))
        for note in report.notes():
            print(note, file=sys.stderr)
    else:
        print(report)
    return 0 if report.ok else 1


class _Progress:
    """The sweep's progress on ``stream``: one line that updates on a terminal, a line per row
    otherwise, and a line that stays for each failing row; its scenario file written into
    ``folder``, if given."""

    def __init__(self, stream: TextIO, folder: str | None) -> None:
        self.stream, self.failing = stream, 0
        self.folder = Path(folder) if folder else None
        self.updating = stream.isatty()
        self.open = False  # A terminal's line that the next row updates.

    def __call__(self, row: Row, done: int, total: int) -> None:
        self.failing += not row.ok
        line = f"sweep: {done} of {total} rows, {self.failing} failing"
        if not row.ok:
            line += f"; FAILS: {row.moment} ({row.origin or 'no cancel'})"
            if self.folder is not None and row.scenario:
                self.folder.mkdir(parents=True, exist_ok=True)
                path = self.folder / f"cancel_{done:03d}_{_slug(row)}.toml"
                path.write_text(row.scenario, encoding="utf-8")
                line += f", written to {path}"
        if not self.updating:
            print(line, file=self.stream, flush=True)
        else:  # Rows that hold update one line; a failing row's stays.
            print(f"\r{line}\x1b[K", end="" if row.ok else "\n", file=self.stream, flush=True)
            self.open = row.ok

    def end(self) -> None:
        if self.open:
            print(file=self.stream, flush=True)


def _slug(row: Row) -> str:
    words = f"{row.point.kind if row.point else 'run'} {row.origin} {row.landing}"
    return re.sub(r"[^a-z0-9]+", "_", words.lower()).strip("_")


if __name__ == "__main__":
    sys.exit(main())

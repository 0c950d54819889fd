"""Every code block of README.md and docs/ runs as written, read from the pages themselves.

A ```python block runs as a script, in a directory of its own (a block that defines tests
has them run too); one that starts with ``# examples/NAME.py`` is an excerpt of that file, word
for word, and the file is what runs. A ```bash block's commands are checked for shape (what
they install exists, `a2a-cancelfix` has the subcommand), and the sweep's commands are run. A
block with no language, or ```text, is output: it is compared where a test says so, never run.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import importlib.util
import inspect
import io
import logging
import os
import re
import runpy
import shlex
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

import a2a_cancelfix
from a2a_cancelfix import _sdk
from a2a_cancelfix.tools.scenarios import SCENARIOS

from .expected import COLUMNS, STOCK, WRAPPED
from .support import PYPROJECT, create_mysql_database, drop_mysql_database, noxfile_list

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
BEHAVIOUR = ROOT / "docs" / "behaviour.md"
PG_TEST = "@127.0.0.1:5432/test"
"""The database the docs' PostgreSQL blocks name; each runs on a fresh one in its place."""
MYSQL_TEST = "@127.0.0.1:3306/test"
"""The database the docs' MariaDB blocks name; each runs on a fresh one in its place."""


@dataclass(frozen=True)
class Block:
    """A fenced code block of a page."""

    page: Path
    line: int
    language: str
    code: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(language: str | None, pages: list[Path] = PAGES) -> list[Block]:
    """The ``language`` code blocks of ``pages`` (None: all of them), in order."""
    found = []
    for page in pages:
        opened: tuple[int, str] | None = None
        body: list[str] = []
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if not line.startswith("```"):
                body.append(line)
            elif opened is None:
                opened, body = (number, line[3:].strip()), []
            else:
                if language in (None, opened[1]):
                    found.append(Block(page, opened[0], opened[1], "\n".join(body) + "\n"))
                opened = None
    return found


def text(*pages: str) -> str:
    """The text of the pages named, relative to the repository (``docs/x.md``)."""
    return "\n".join((ROOT / page).read_text() for page in pages)


def docs_text() -> str:
    """The README and every page of docs/, as one text."""
    return "\n".join(page.read_text() for page in PAGES)


def table_after(heading: str) -> list[list[str]]:
    """The rows of the first markdown table after ``heading`` in docs/behaviour.md."""
    lines = BEHAVIOUR.read_text().split(heading, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return [row for row in rows if not set("".join(row)) <= {"-"}]


def test_behaviour_table_matches_the_tests() -> None:
    """Stock columns and our column say exactly what the tests assert."""
    header, *rows = table_after("## Behaviour per a2a-sdk version")
    assert header == ["scenario", *COLUMNS, "with a2a-cancelfix"]
    expected = {scenario.name: [*STOCK[scenario.name], scenario.expected] for scenario in SCENARIOS}
    assert {row[0]: row[1:] for row in rows} == expected


def test_wrapper_table_matches_the_tests() -> None:
    """The wrapper-alone table lists exactly where the wrapper differs from the handler."""
    header, *rows = table_after("### If you cannot swap the handler")
    assert header == ["scenario", *COLUMNS]
    expected = {name: [cell or "as the handler" for cell in cells] for name, cells in WRAPPED.items()}
    assert {row[0]: row[1:] for row in rows} == expected


FRAMEWORK_MODULES = {"google.adk": "google.adk", "a2a_adapter": "a2a_adapter", "a2a_lite": "a2a_lite"}
"""A block that imports one of these runs in `nox -s frameworks`, which installs them."""


def needs_frameworks(code: str) -> bool:
    return any(re.search(rf"\b(import|from) {re.escape(name)}\b", code) for name in FRAMEWORK_MODULES)


# ADK's own, on every use of its A2A support.
ADK_EXPERIMENTAL = pytest.mark.filterwarnings(r"ignore:\[EXPERIMENTAL\]:UserWarning")


def python_params() -> list[Any]:
    marks = {True: [pytest.mark.frameworks, ADK_EXPERIMENTAL], False: []}
    return [
        pytest.param(block, id=str(block), marks=marks[needs_frameworks(block.code)])
        for block in blocks("python")
    ]


@contextlib.contextmanager
def fresh_database(code: str) -> Iterator[str]:
    """``code`` with the PostgreSQL database it names replaced by a fresh one, dropped after:
    what a block shows to set up must be all a new database needs (on MariaDB too)."""
    if MYSQL_TEST in code:
        with fresh_mysql_database(code) as code_there:
            yield code_there
        return
    if PG_TEST not in code:
        yield code
        return
    import asyncpg

    name = f"a2acf_docs_{uuid.uuid4().hex[:12]}"

    async def admin(statement: str) -> None:
        try:
            connection = await asyncpg.connect("postgresql://postgres@127.0.0.1:5432/test", timeout=5)
        except (TimeoutError, OSError, asyncpg.PostgresError) as error:
            pytest.skip(f"PostgreSQL at 127.0.0.1:5432 is unreachable: {error!r}")
        try:
            await connection.execute(statement)
        finally:
            await connection.close()

    asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    try:
        yield code.replace(PG_TEST, f"@127.0.0.1:5432/{name}")
    finally:
        asyncio.run(admin(f'DROP DATABASE "{name}" WITH (FORCE)'))


@pytest.mark.parametrize("block", python_params())
def test_a_python_block_runs_as_written(
    block: Block,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The block runs as a script (its tests too), or is word for word in the file it quotes;
    without a WARNING from the SDK about what it was given (an AgentCard lacking a required field)."""
    first, _, rest = block.code.partition("\n")
    if first.startswith("# examples/"):
        assert rest.strip() in (ROOT / first.removeprefix("# ")).read_text(), f"{block} is not in {first}"
        return
    for module in FRAMEWORK_MODULES:
        if needs_frameworks(block.code) and module in block.code:
            pytest.importorskip(module)
    if "a2a.server.cluster" in block.code and not _sdk.HAS_CLUSTER:
        pytest.skip("upstream's cluster mode is a2a-sdk 1.2.0+")
    script = tmp_path / "block.py"
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    try:
        with fresh_database(block.code) as code:
            script.write_text(code)
            namespace = runpy.run_path(str(script), run_name="__main__")
        tests = [value for name, value in namespace.items() if name.startswith("test_") and callable(value)]
        defined = [
            value
            for value in namespace.values()
            if is_executor_class(value) and value.__module__ == "__main__"
        ]
        assert not defined or tests or "asyncio.run(" in block.code, (
            f"{block} never runs the executor it defines"
        )
        for test in tests:
            if inspect.iscoroutinefunction(test):
                marks = [mark.name for mark in getattr(test, "pytestmark", [])]
                assert "asyncio" in marks, f"{block}: pytest-asyncio's strict mode needs @pytest.mark.asyncio"
                asyncio.run(test())
            else:
                test()
    finally:
        a2a_cancelfix.unpatch()
    warned = [
        r.getMessage() for r in caplog.records if r.name.startswith("a2a.") and r.levelno >= logging.WARNING
    ]
    assert not warned, f"{block}: the SDK warned: {warned}"


@contextlib.contextmanager
def fresh_mysql_database(code: str) -> Iterator[str]:
    """``code`` with the MariaDB database it names replaced by a fresh one, dropped after."""
    name = asyncio.run(create_mysql_database("a2acf_docs"))
    try:
        yield code.replace(MYSQL_TEST, MYSQL_TEST.replace("/test", f"/{name}"))
    finally:
        asyncio.run(drop_mysql_database(name))


def is_executor_class(value: object) -> bool:
    from a2a.server.agent_execution import AgentExecutor

    return isinstance(value, type) and issubclass(value, AgentExecutor)


# The bash blocks: checked for shape, and the sweep's commands run.

PROJECT = PYPROJECT["project"]


def commands(block: Block) -> list[list[str]]:
    """The commands of a bash block, each split into words, comments and redirections left out."""
    found = []
    for line in block.code.splitlines():
        for command in line.split("#", 1)[0].split("&&"):
            words = shlex.split(command.split(">", 1)[0])
            if words:
                found.append(words)
    return found


def subcommands() -> set[str]:
    from a2a_cancelfix.tools import cli

    shown = io.StringIO()
    with redirect_stdout(shown), pytest.raises(SystemExit):
        cli.main(["--help"])
    return set(re.search(r"\{([a-z,]+)\}", shown.getvalue()).group(1).split(","))  # type: ignore[union-attr]


def installable(requirement: str) -> str | None:
    """Why ``requirement``, as a pip argument in the docs, would not install; None if it would."""
    pins = noxfile_list("FRAMEWORKS") + noxfile_list("LITE")
    name, _, extras = requirement.partition("[")
    extras_named = set(re.findall(r"[\w-]+", extras.split("]", 1)[0])) if extras else set()
    if name == ".":
        unknown = extras_named - set(PROJECT["optional-dependencies"])
        return f"no extra {sorted(unknown)} in pyproject.toml" if unknown else None
    if name == "a2a-sdk":
        offered = set(importlib.metadata.metadata("a2a-sdk").get_all("Provides-Extra") or [])
        unknown = extras_named - offered
        return f"a2a-sdk has no extra {sorted(unknown)}" if unknown else None
    if name == PROJECT["name"]:
        return "a2a-cancelfix is not on the package index: install it from a clone or a wheel"
    if name.endswith(".whl") or requirement in ("nox[uv]",):
        return None
    if "==" in requirement:
        return None if requirement in pins else f"{requirement}: noxfile.py pins {pins}"
    return None if requirement in ("build",) else f"{requirement}: not a requirement the docs may name"


@pytest.mark.parametrize("block", [pytest.param(b, id=str(b)) for b in blocks("bash")])
def test_a_bash_blocks_commands_are_ones_that_work(block: Block) -> None:
    """What a block installs exists (an extra we or a2a-sdk offer, a framework at noxfile.py's
    pin, never the package from the index), and `a2a-cancelfix` has each subcommand used."""
    for words in commands(block):
        if words[:2] == ["pip", "install"]:
            problems = [p for w in words[2:] if not w.startswith("-") and (p := installable(w))]
            assert not problems, f"{block}: {problems}"
        elif words[0] == "a2a-cancelfix":
            assert words[1] in subcommands(), f"{block}: no subcommand {words[1]}"
        else:
            assert words[0] in ("cd", "nox", "python", "pip", "git"), f"{block}: {words}"


def test_the_first_screen_has_the_two_set_up_commands_and_ci_runs_the_second() -> None:
    """The README's first screen (before its first section) shows exactly two commands, the
    main job and the whole test suite; `.ci/run` runs that suite's command. It says how to
    run the quick loop too, as CONTRIBUTING.md's loop does (the suite alone took 17 minutes)."""
    text = README.read_text().split("\n## ", 1)[0]
    first_screen = text.count("\n") + 1
    assert first_screen <= 40
    (loop,) = blocks("console", [ROOT / "CONTRIBUTING.md"])[:1]
    assert f"`{loop.code.strip()}`" in text
    shown = [block for block in blocks("bash", [README]) if block.line <= first_screen]
    assert [block.code.count("\n") for block in shown] == [2]
    assert [" ".join(words) for words in commands(shown[0])] == [
        "pip install .",
        "a2a-cancelfix check",
        "pip install nox[uv]",
        "nox",
    ]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install --quiet --upgrade 'nox[uv]'" in ci and "python -m nox " in ci


def runnable(block: Block) -> bool:
    """Whether the block is sweep commands, which run in seconds (the others serve, or fail on
    purpose, and are tested where their commands are: test_cli.py, test_repro.py)."""
    words = commands(block)
    return bool(words) and all(
        w[0] == "cd" or w[:2] in (["a2a-cancelfix", "sweep"], ["a2a-cancelfix", "play"]) for w in words
    )


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # Its parent package is not installed.
        return False


def sweep_params() -> list[Any]:
    marks = {True: [pytest.mark.frameworks], False: [pytest.mark.edges_only]}
    return [
        pytest.param(block, id=str(block), marks=marks["cd examples" in block.code])
        for block in blocks("bash")
        if runnable(block)
    ]


@pytest.mark.parametrize("block", sweep_params())
def test_the_sweep_commands_run_as_written(block: Block) -> None:
    """Each sweep command shown exits 0, run from the repository as a user would."""
    for module, package in {"adk_agent": "google.adk", "langgraph_agent": "a2a_adapter"}.items():
        if module in block.code and not installed(package):
            pytest.skip(f"needs {package}, which `nox -s frameworks` installs")
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    result = subprocess.run(
        ["bash", "-e", "-c", block.code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PATH": path},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rows hold." in result.stdout
    shown = output_after(block)
    if shown is not None:
        assert result.stdout == shown.code


def output_after(block: Block) -> Block | None:
    """The ```text block that comes next on the block's page, if the next one is: what the
    page says the command prints."""
    later = [each for each in blocks(None, [block.page]) if each.line > block.line]
    return later[0] if later and later[0].language == "text" else None


# The complete server the README shows.


def test_the_readme_shows_the_example_server_whole() -> None:
    """The README's server is examples/server.py, every line of it."""
    shown = [b.code for b in blocks("python", [README]) if b.code.startswith("# examples/server.py\n")]
    assert shown == ["# examples/server.py\n" + (ROOT / "examples" / "server.py").read_text()]


@pytest.mark.asyncio
async def test_the_example_server_serves_its_card_cancels_and_closes_the_handler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """examples/server.py serves its card and JSON-RPC; a task cancelled mid-run ends CANCELED,
    and the app's shutdown awaits the handler's ``aclose()``."""
    spec = importlib.util.spec_from_file_location("example_server", ROOT / "examples" / "server.py")
    assert spec and spec.loader
    server = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(server)
    closed = []
    aclose = server.handler.aclose

    async def noted_aclose() -> None:
        closed.append(True)
        await aclose()

    monkeypatch.setattr(server.handler, "aclose", noted_aclose)
    async with server.app.router.lifespan_context(server.app):
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url=server.URL, timeout=10) as client:
            card = (await client.get("/.well-known/agent-card.json")).json()
            assert card["name"] == "summariser"
            answer = await send_and_cancel(client)
            assert answer["result"]["status"]["state"] == "TASK_STATE_CANCELED"
        assert not closed
    assert closed == [True]


async def send_and_cancel(client: httpx.AsyncClient) -> Any:
    """Send the example server a message, cancel its task at once: the cancel's answer."""
    headers = {"A2A-Version": "1.0"}
    message = {"role": "ROLE_USER", "messageId": "m-1", "parts": [{"text": "summarise this"}]}
    send = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "SendMessage",
        "params": {"message": message, "configuration": {"returnImmediately": True}},
    }
    task_id = (await client.post("/", json=send, headers=headers)).json()["result"]["task"]["id"]
    cancel = {"jsonrpc": "2.0", "id": 2, "method": "CancelTask", "params": {"id": task_id}}
    return (await client.post("/", json=cancel, headers=headers)).json()


# Runs examples/server.py as its command does, uvicorn.run serving the app in process instead
# of on a port: a message, and its cancel.
RUN_THE_EXAMPLE = """
import asyncio, runpy, sys
import httpx, uvicorn
from tests.test_docs import send_and_cancel

async def serve(app):
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000/", timeout=10) as client:
            await send_and_cancel(client)

uvicorn.run = lambda app, **options: asyncio.run(serve(app))
runpy.run_path("examples/server.py", run_name="__main__")
"""


@pytest.mark.edges_only  # Its own interpreter, for what runs in process on every release (see noxfile.py).
def test_the_example_server_logs_a_line_per_cancel() -> None:
    """`python examples/server.py` shows the INFO line per cancel the README promises (its
    logging was left unconfigured: Python's default shows WARNING and above only)."""
    result = subprocess.run(
        [sys.executable, "-c", RUN_THE_EXAMPLE], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert re.search(r"INFO: +a2a_cancelfix: cancel task=\S+ path=\S+ outcome=CANCELED", result.stderr), (
        result.stderr
    )

"""The test matrix: the whole suite against each supported a2a-sdk release, one environment each,
on Python 3.11, and against the oldest and the newest on Python 3.13."""

import email
import os
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

import nox
from packaging.requirements import Requirement

nox.options.default_venv_backend = "uv|virtualenv"
# Lint and types first: they fail in seconds where the matrix takes minutes. The frameworks on
# a2a-sdk 1.0.0 (`nox -s "frameworks(sdk='1.0.0')"`) are left out of the default run, to keep
# CI within its 25 minutes (24 with them): what they sweep is our kit, which the newest covers.
nox.options.sessions = ["lint", "typecheck", "package", "python3.13", "tests", "frameworks(sdk='newest')"]
nox.options.error_on_missing_interpreters = True
# The Pythons below are the machine's (or the one .ci/python3.13 built), never one nox downloads:
# what CI runs is what the README says is tested.
nox.options.download_python = "never"

# Every minor line's first and last release we support, the releases where the SDK's behaviour
# changed in between (1.1.3: the store's lock; 1.2.2: the last whose runs never close by
# themselves, with upstream's cluster layer), and whatever 1.x is newest today.
SDK_RELEASES = ["1.0.0", "1.0.3", "1.1.2", "1.1.3", "1.1.5", "1.2.2", "1.2.3", "newest"]

# The oldest and the newest release run every test (on 3.11; on 3.13, see `tests`). Those
# between skip the tests marked `edges_only`, which are slow and whose code path does not differ
# between releases:
# - tests/test_replica_servers.py, real server processes on SQLite and PostgreSQL: they add
#   processes, sockets and databases to what tests/test_replicas.py, test_notices.py and
#   test_cluster.py check in process on every release. Where the path does depend on the
#   release, those check it on each: a cancel of a task not live on that replica (our store
#   write up to 1.1.x, the SDK's own from 1.2.0, both sides taken by the edges too) and
#   upstream's cluster mode (1.2.0+).
# - tests/test_sigterm.py's server processes, stopped with SIGTERM: what they add to the hook's
#   tests in process and tests/test_shutdown.py (both on every release) is uvicorn's and
#   sse-starlette's order at the signal, which no a2a-sdk release changes.
# - tests/test_store.py's race between processes: FinalStateTaskStore's guarded write is one SQL
#   statement of ours, the same on every release, through accessors `_sdk` probes at import.
# - tests/test_liveness.py's leases beyond a dying replica's own (two survivors, parked tasks,
#   fencing, a replica coming back, shutdown, restart): each waits out a lease of a second or
#   more, and what it checks is our own SQL and timers, the same on every release. A dying
#   replica's task ended by a survivor, and upstream's cluster mode (1.2+), run on every release.
# - the tests that run our own entry points in an interpreter of their own: the docs' sweep
#   commands as written (test_docs.py), `python -m a2a_cancelfix` (test_layout.py, test_cli.py),
#   the sweep command (test_sweep.py, test_sweep_field.py) and the runtime's imports
#   (test_layout.py). Each interpreter imports a2a-sdk anew, over a second of CPU. What they run,
#   `cli.main` and the sweep, runs in process on every release; what they add (an entry point, a
#   recipe's text, our own imports, none of them conditional) does not depend on the release.
#   test_repro.py's scripts and test_telemetry.py's switch start interpreters too, but what those
#   show is the release's own: they run on every release.
# - tests/test_crash_recovery.py, replicas killed, stopped and cut off from their database: the
#   leases' code is ours alone (SQL of ours, through accessors `_sdk` probes at import), and
#   each test waits out a lease of seconds.
# - every test's MariaDB case (tests/conftest.py marks it): its SQL is ours (_databases.py), the
#   same on every release, while its SQLite and PostgreSQL cases run on each release.
# `nox -s "tests(sdk='1.1.3')" -- -m ""` runs them there too.
EDGES = (SDK_RELEASES[0], SDK_RELEASES[-1])
# The chaos soak (a minute of killed and cut-off replicas, marked `soak`) runs once, on the
# newest release, alone after the rest of its session: the other tests' load would be chaos it
# did not choose. What it adds to the edges' crash tests is the mix, not anything a release does.
# `nox -s soak` runs it by itself.
SOAK_RELEASE = SDK_RELEASES[-1]
SOAKED = "tests/test_crash_recovery.py"

# The Pythons the suite runs on: 3.11 with every release above, and Debian 13's Python (CPython
# 3.13.5) with the edges. No 3.13 is on a fresh machine: `.ci/python3.13` builds it once per
# machine into a cache outside the clone and prints its path. .ci/run calls it and passes the path
# in A2A_CANCELFIX_PYTHON313 (which may also name a 3.13 of your own, Debian 13's /usr/bin/python3.13
# say); otherwise the path is where the script builds it, and the session `python3.13`, which
# the default run has before the tests, runs the script.
PYTHON = "3.11"
SCRIPT_313 = Path(__file__).parent / ".ci" / "python3.13"
PYTHON_313 = (
    os.environ.get("A2A_CANCELFIX_PYTHON313")
    or subprocess.run([str(SCRIPT_313), "--path"], capture_output=True, text=True, check=True).stdout.strip()
)
# The 3.11 sessions keep their names (`tests(sdk='newest')`); the 3.13 ones say their Python.
TESTS = [nox.param(PYTHON, sdk, id=f"sdk={sdk!r}") for sdk in SDK_RELEASES] + [
    nox.param(PYTHON_313, sdk, id=f"python='3.13', sdk={sdk!r}") for sdk in EDGES
]


# Run after the rest, in a process of its own: it sets OpenTelemetry's tracer and meter providers,
# which a process gets once and keeps. The xdist workers that died in it without a word ("node
# down") were segfaults: the collector ran inside a ContextVar.set (cpython#148891), which
# tests/conftest.py now keeps it from doing; alone, a crash there would print its stack.
OWN_PROCESS = "tests/test_telemetry.py"


# Pinned, so that a new release of a checker fails nobody's build until it is adopted here.
LINTERS = ["ruff==0.17.6"]
TYPE_CHECKERS = ["mypy==2.4.1", "types-protobuf==7.35.1.20261122"]
PACKAGERS = ["build[uv]==1.6.1", "twine==7.0.0"]

# A library stand-in that the sweep must class as installed code (tests/test_sweep_field.py): it
# goes beside the `test` extra, installed into site-packages, as no published package can name it.
FAKELIB = "./tests/fakelib"


# What `lint` checks: every Python file of ours, check --repro's scripts included.
LINTED = ["a2a_cancelfix", "tests", "benchmarks", "examples", "noxfile.py"]


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff's rules (pyproject.toml's [tool.ruff.lint]) and its formatting, checked, not applied."""
    session.install(*LINTERS)
    session.run("ruff", "check", *LINTED)
    session.run("ruff", "format", "--check", *LINTED)


@nox.session
@nox.parametrize("sdk", ["1.0.0", "newest"])
def typecheck(session: nox.Session, sdk: str) -> None:
    """mypy against one a2a-sdk release: strict for the runtime, plain for the kit and tools.

    The oldest and the newest release, whose annotations differ (_sdk.py probes for what each
    has); pyproject.toml's [tool.mypy] says what is checked, tests/typecheck/ included.
    """
    session.install("-e", ".[test]", FAKELIB, _sdk_requirement(sdk), *TYPE_CHECKERS)
    # A cache per release: one shared between them would be rebuilt at every switch.
    session.run("mypy", "--cache-dir", f"{session.virtualenv.location}/mypy_cache", *session.posargs)


@nox.session
def package(session: nox.Session) -> None:
    """Build the sdist and the wheel, check them as the index would, and run the installed wheel.

    The wheel goes into an environment of its own, holding it and its dependencies only, and
    runs `a2a-cancelfix check` outside the tree, so that nothing but what it installed is imported.
    """
    session.install(*PACKAGERS)
    tmp = Path(session.create_tmp()).resolve()
    dist, fresh = tmp / "dist", tmp / "fresh"
    shutil.rmtree(dist, ignore_errors=True)
    shutil.rmtree(fresh, ignore_errors=True)
    session.run("python", "-m", "build", "--installer=uv", "--outdir", str(dist))
    (wheel,), (sdist,) = dist.glob("*.whl"), dist.glob("*.tar.gz")
    session.run("twine", "check", "--strict", str(wheel), str(sdist))
    tracked = session.run("git", "ls-files", *_SDIST, silent=True, external=True)
    problems = _dist_problems(wheel, sdist, set(str(tracked).split()))
    if problems:
        session.error("\n".join(problems))
    session.run("python", "-m", "venv", "--without-pip", str(fresh))
    session.run("uv", "pip", "install", "--quiet", "--python", str(fresh / "bin" / "python"), str(wheel))
    session.chdir(tmp)
    session.run(str(fresh / "bin" / "a2a-cancelfix"), "--version", external=True)
    session.run(str(fresh / "bin" / "a2a-cancelfix"), "check", external=True)


# What the sdist must hold of the tree for a distributor to run the tests (pyproject.toml's
# [tool.hatch.build.targets.sdist] puts them there).
_SDIST = ["a2a_cancelfix", "tests", "docs", "examples", "pyproject.toml", "README.md", "LICENSE"]


def _dist_problems(wheel: Path, sdist: Path, tracked: set[str]) -> list[str]:
    """What the index would refuse, or a user or distributor miss, in the two archives."""
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = archive.namelist()
        (info,) = (name for name in in_wheel if name.endswith(".dist-info/METADATA"))
        metadata = {"wheel": email.message_from_bytes(archive.read(info))}
    with tarfile.open(sdist) as archive:
        in_sdist = {name.partition("/")[2]: archive.getmember(name) for name in archive.getnames()}
        metadata["sdist"] = email.message_from_bytes(archive.extractfile(in_sdist["PKG-INFO"]).read())
    problems = [
        f"{where}: {requirement!r} is a direct reference, which the index refuses"
        for where, fields in metadata.items()
        for requirement in fields.get_all("Requires-Dist", [])
        if Requirement(requirement).url
    ]
    problems += [
        f"{where}: a License classifier beside the license expression, which the index refuses"
        for where, fields in metadata.items()
        if any(classifier.startswith("License ::") for classifier in fields.get_all("Classifier", []))
    ]
    if "LICENSE" not in metadata["wheel"].get_all("License-File", []):
        problems.append("the wheel does not carry LICENSE")
    problems += [
        f"the wheel holds {name}, not the package"
        for name in in_wheel
        if not name.startswith("a2a_cancelfix")
    ]
    problems += [f"the sdist lacks {name}, which the tests need" for name in sorted(tracked - set(in_sdist))]
    return problems


def _sdk_requirement(sdk: str) -> str:
    extras = "[http-server,grpc,sqlite,postgresql,mysql,telemetry]"
    return f"a2a-sdk{extras}>=1,<2" if sdk == "newest" else f"a2a-sdk{extras}=={sdk}"


@nox.session(name="python3.13", python=False)
def python313(session: nox.Session) -> None:
    """CPython 3.13.5 for the 3.13 sessions: built by `.ci/python3.13` once per machine (about
    6 minutes on 2 cores; nothing the next time), or the one A2A_CANCELFIX_PYTHON313 names.

    Part of the default run, before the tests: alone, on a fresh machine, run it first
    (`nox -s python3.13 "tests(python='3.13', sdk='newest')"`), or nox finds no interpreter.
    """
    if "A2A_CANCELFIX_PYTHON313" in os.environ:
        session.run(PYTHON_313, "--version", external=True)
    else:
        session.run(str(SCRIPT_313), external=True)


@nox.session
@nox.parametrize(("python", "sdk"), TESTS)
def tests(session: nox.Session, sdk: str) -> None:
    """Run the suite against one a2a-sdk release, on one Python."""
    session.install("-e", ".[test]", FAKELIB, _sdk_requirement(sdk))
    on_313 = session.python != PYTHON
    # On 3.13 the edges skip the tests marked `edges_only`, as the middle releases do, and the
    # soak: CI's 25 minutes would not hold them. The newest release's 3.13 session took 216 s
    # with them (six workers, the machine busy: load 4 to 7) and 105 s without (four workers,
    # load 3), 1.0.0's 111 s: CI's whole run goes from about 17.5 to about 21 minutes, plus
    # six the first time on a machine, for the build. What such a test adds to its in-process twin, which runs
    # on 3.13 (see EDGES), is processes, sockets, databases, signals, and leases and timers
    # waited out in wall-clock seconds: uvicorn's, the operating system's and our own SQL, none
    # of which Python 3.13 changed for us. What 3.12 and 3.13 did change (asyncio.wait_for runs
    # what it awaits in the caller's task; a2a-sdk's queues are asyncio.Queue, whose shutdown
    # wakes join() differently; enqueueing no longer yields) shows in process, in loop turns,
    # where every 3.13 session runs it; and interpreters started anew run on 3.13 too
    # (test_repro.py's scripts, test_telemetry.py's switch).
    selection = ["-m", "not soak"] if sdk in EDGES and not on_313 else ["-m", "not edges_only and not soak"]
    # Four workers on two cores: most of the suite waits (server processes starting, databases,
    # timers, grace periods), so two kept the cores half idle. On an idle machine a middle
    # release took 102 s with two, 59 s with four, 56 s with six (at a fifth more CPU). The
    # edges' own tests wait far more (leases run out, processes are killed and restarted): six
    # there, 1.0.0 took 143 s against 257 s with four; with their MariaDB cases, 254 s with six
    # and 238 s with eight, where a replica's run then took over 10 s to start: six. On a
    # machine busy with other work (load 8-11), three or four starved the scenarios' 2.5 s
    # bounds: `-- -n 2` there.
    workers = "--numprocesses=6" if sdk in EDGES and not on_313 else "--numprocesses=4"
    # With bytecode written (PYTHONDONTWRITEBYTECODE is set on some CI images), every worker and
    # every interpreter a test starts would compile the package, the tests and the SDK anew.
    run = ("pytest", *selection)
    environment = {"PYTHONDONTWRITEBYTECODE": None}
    if session.posargs:
        session.run(*run, workers, *session.posargs, env=environment)
        return
    session.run(*run, workers, f"--ignore={OWN_PROCESS}", env=environment)
    session.run(*run, "-p", "no:xdist", OWN_PROCESS, env=environment)
    if sdk == SOAK_RELEASE and not on_313:
        session.run("pytest", "-p", "no:xdist", "-m", "soak", SOAKED, env=environment)


# Pinned: the versions docs/frameworks.md's recipes and tests/test_frameworks.py were written against.
FRAMEWORKS = ["google-adk[a2a]==2.13.0", "a2a-adapter[langgraph]==0.2.14", "langgraph==1.2.24"]
LITE = "a2a-lite==1.2.1"


@nox.session
@nox.parametrize("sdk", ["1.0.0", "newest"])
def frameworks(session: nox.Session, sdk: str) -> None:
    """Sweep real frameworks' executors (ADK, LangGraph behind a2a-adapter, a2a-lite) with fake models.

    In the default run: what executors are handed (a run's queue, say) is ours, and what
    users build on is these frameworks. It installs them, about 200 MB.
    """
    requirement = "a2a-sdk>=1,<2" if sdk == "newest" else f"a2a-sdk=={sdk}"
    # a2a-lite needs a2a-sdk 1.2.2+: its tests skip, saying so, on older releases.
    lite = [LITE] if sdk == "newest" else []
    session.install("-e", ".[test]", FAKELIB, *FRAMEWORKS, *lite, requirement)
    # With docs/frameworks.md's blocks (tests/test_docs.py marks those that need a framework).
    session.run("pytest", "tests/test_frameworks.py", *session.posargs)
    session.run("pytest", "-m", "frameworks", "tests/test_docs.py", *session.posargs)


@nox.session
def soak(session: nox.Session) -> None:
    """The chaos soak alone, on the newest release (also the last step of its `tests` session)."""
    session.install("-e", ".[test]", FAKELIB, _sdk_requirement(SOAK_RELEASE))
    session.run("pytest", "-m", "soak", SOAKED, *session.posargs)

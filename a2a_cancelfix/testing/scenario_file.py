"""Scenario files: one cancel moment in TOML, replayed by `play` (and by the pytest plugin).

A sweep prints one for each failing row, with what every observer must see: saved as
``cancel_<name>.toml`` next to your tests, it is a regression test of that moment::

    executor = "agent:Pipeline"          # MODULE:NAME, a class or a zero-argument factory
    messages = ["hello"]                  # the first starts the task; each next answers it
    grace_period = 1.0
    released = "agent:claim_released"     # optional: released(executor) -> bool

    [cancel]
    point = 7                             # the moment's place among the run's points
    kind = "await"
    at = "await asyncio.sleep in scrub (agent.py:31)"
    origin = "remote"                     # local, remote or client leaves
    landing = "as it returns"

    [expect]                              # each observer's last state (any of a list)
    answer = "CANCELED"
    store = "CANCELED"
    stream = "CANCELED"
"""

from __future__ import annotations

import concurrent.futures
import importlib
import sys
from pathlib import Path
from typing import Any

from a2a_cancelfix.testing._probe import Point
from a2a_cancelfix.testing.sweep import Report, _Plan
from a2a_cancelfix.testing.waits import in_own_loop

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


def play(path: str | Path) -> Report:
    """Replay the cancel moment a scenario file describes; the report has its one row.

    The file's folder is importable while it plays, as pytest makes a test's. It runs in an
    event loop of its own; from a coroutine, ``await asyncio.to_thread(play, path)`` keeps
    yours free meanwhile.

    Raises:
        ValueError: a file that does not describe a moment.
    """
    path = Path(path)
    spec = tomllib.loads(path.read_text(encoding="utf-8"))
    try:
        cancel, expect = spec["cancel"], spec.get("expect", {})
        folder = str(path.resolve().parent)
        sys.path.insert(0, folder)
        try:
            factory = load(spec["executor"])
            released = load(spec["released"]) if "released" in spec else None
        finally:
            sys.path.remove(folder)
        messages = spec.get("messages", ["hello"])
        point = Point(int(cancel["point"]), cancel["kind"], cancel["at"], bool(cancel.get("shielded", False)))
        origin, landing = cancel.get("origin", "local"), cancel.get("landing", "")
    except (KeyError, TypeError) as error:
        raise ValueError(f"{path} is not a scenario file: {error!r} is missing or wrong") from error
    plan = _Plan(factory, list(messages), float(spec.get("grace_period", 1.0)), released, spec["executor"])
    plan.expect = {name: _allowed(value) for name, value in expect.items()}
    with concurrent.futures.ThreadPoolExecutor(1) as thread:  # Its own loop, whoever calls.
        row = thread.submit(in_own_loop, plan.row, point, origin, landing).result()
    return Report([row])


def load(spec: str) -> Any:
    """The object ``MODULE:NAME`` names (``NAME`` may be dotted).

    Raises:
        ValueError: not of that form, or nothing by that name.
    """
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ValueError(f"expected MODULE:NAME, not {spec!r}")
    found: Any = importlib.import_module(module_name)
    for part in name.split("."):
        try:
            found = getattr(found, part)
        except AttributeError as error:
            raise ValueError(f"{module_name} has no {name}") from error
    return found


def _allowed(value: Any) -> tuple[str, ...]:
    return tuple(str(each) for each in value) if isinstance(value, list) else (str(value),)

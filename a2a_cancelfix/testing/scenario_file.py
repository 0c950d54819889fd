"""Scenario files: one cancel moment in TOML, replayed by `play` (and by the pytest plugin).

A sweep prints one for each failing row, with what every observer must see: saved as
``cancel_<name>.toml`` next to your tests, it is a regression test of that moment::

    executor = "agent:Pipeline"          # MODULE:NAME, a class or a zero-argument factory
    messages = ["hello"]                  # the first starts the task; each next answers it
    grace_period = 1.0
    released = "agent:claim_released"     # optional: released(executor) -> bool

    [cancel]
    kind = "await"
    at = "await asyncio.sleep in execute > scrub"   # the path to the point: no line numbers
    occurrence = 1                        # the first point of this kind and path
    origin = "remote"                     # local, remote, client leaves or unwatched
    landing = "as it returns"

    [expect]                              # each observer's last state (any of a list)
    answer = "CANCELED"
    store = "CANCELED"
    stream = "CANCELED"

A point is found by its path and occurrence, so an edit that does not change the path to it
(a comment above it, the fix of the bug) leaves the file valid. The file is checked against its
schema before anything runs: an unknown key, section or value is an error that names it.
"""

from __future__ import annotations

import concurrent.futures
import difflib
import importlib
import sys
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from a2a_cancelfix.testing._origins import BY_NAME
from a2a_cancelfix.testing._probe import Point
from a2a_cancelfix.testing._report import Report
from a2a_cancelfix.testing._world import Plan
from a2a_cancelfix.testing.sweep import cancelled, check_setup
from a2a_cancelfix.testing.waits import in_own_loop


class ScenarioError(ValueError):
    """A scenario file that does not describe a moment; the message names what is wrong."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


States = str | list[str]


class _Cancel(_Section):
    kind: Literal["await", "checkpoint", "publish", "published", "start", "parked", "ended"]
    at: str
    occurrence: int = Field(1, ge=1)
    shielded: bool = False  # Said for people; the run tells.
    origin: Literal["local", "remote", "client leaves", "unwatched"] = "local"
    landing: Literal["as it returns", "interrupted", "while pending", "alone", "follow-up racing", ""] = ""


class _Expect(_Section):
    answer: States | None = None
    store: States | None = None
    stream: States | None = None
    subscriber: States | None = None
    push: States | None = None
    sender: States | None = None


class _Scenario(_Section):
    executor: str
    messages: list[str] = Field(default_factory=lambda: ["hello"], min_length=1)
    grace_period: float = Field(1.0, gt=0, allow_inf_nan=False)
    released: str | None = None
    cancel: _Cancel
    expect: _Expect = Field(default_factory=_Expect)


def read(path: str | Path) -> _Scenario:
    """The scenario ``path`` describes, checked against the schema; nothing imported or run.

    Raises:
        ScenarioError: not TOML, or not a scenario: each key, section or value in error named.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        scenario = _Scenario.model_validate(data)
    except tomllib.TOMLDecodeError as error:
        raise ScenarioError(f"{path} is not TOML: {error}") from None
    except ValidationError as error:
        problems = "; ".join(_problem(each) for each in error.errors())
        raise ScenarioError(f"{path} is not a scenario file: {problems}") from None
    cancel = scenario.cancel
    point = Point(-1, cancel.kind, cancel.at, shielded=cancel.shielded)
    landings = BY_NAME[cancel.origin].landings(point)
    if cancel.landing not in landings:
        raise ScenarioError(
            f"{path} is not a scenario file: landing = {cancel.landing!r} is not a landing of a"
            f" {cancel.origin} cancel at a point of kind {cancel.kind!r}: {' or '.join(map(repr, landings))}"
        )
    return scenario


def _problem(error: Any) -> str:
    """One schema error, in words: where it is, and what would be right."""
    *section, key = [str(part) for part in error["loc"]] or ["?"]
    where = f"[{'.'.join(section)}] " if section else ""
    if error["type"] == "extra_forbidden":
        model = _model_at(section)
        if isinstance(error["input"], dict):
            what = f"unknown section [{'.'.join([*section, key])}]"
        else:
            what = f"{where}unknown key {key!r}"
        close = difflib.get_close_matches(key, list(model.model_fields), n=1)
        return what + (f" (did you mean {close[0]!r}?)" if close else "")
    if error["type"] == "missing":
        return f"{where}{key} is missing"
    return f"{where}{key} = {error.get('input')!r}: {error['msg']}"


def _model_at(section: list[str]) -> type[BaseModel]:
    model: type[BaseModel] = _Scenario
    for name in section:
        model = model.model_fields[name].annotation  # type: ignore[assignment]
    return model


def play(path: str | Path) -> Report:
    """Replay the cancel moment a scenario file describes; the report has its one row.

    The file's folder is importable while it plays, as pytest makes a test's. It runs in an
    event loop of its own; from a coroutine, ``await asyncio.to_thread(play, path)`` keeps
    yours free meanwhile.

    Raises:
        ScenarioError: a file that does not describe a moment (a ``ValueError``).
        ValueError: an executor or ``released`` that cannot be loaded or used.
    """
    path = Path(path)
    scenario = read(path)
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        factory = load(scenario.executor)
        released = load(scenario.released) if scenario.released else None
    finally:
        sys.path.remove(folder)
    check_setup(factory, scenario.grace_period)
    cancel = scenario.cancel
    point = Point(-1, cancel.kind, cancel.at, "", cancel.occurrence, cancel.shielded)
    expect = {name: _allowed(value) for name, value in scenario.expect.model_dump(exclude_none=True).items()}
    plan = Plan(factory, scenario.messages, scenario.grace_period, released, scenario.executor, expect=expect)
    with concurrent.futures.ThreadPoolExecutor(1) as thread:  # Its own loop, whoever calls.
        row = thread.submit(in_own_loop, cancelled, plan, point, cancel.origin, cancel.landing).result()
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

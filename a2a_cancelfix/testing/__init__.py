"""The kit for testing how an executor behaves when its task is cancelled.

* ``sweep(executor_factory)``: cancel the executor at each of its cancel points, from each
  origin, and report what every observer saw (a ``Report``: a ``Row`` per ``Point``, origin and
  landing); ``play(path)`` replays one moment from a scenario file. The pytest plugin
  collects ``cancel_*.toml`` scenario files as tests.

The building blocks it is made of:

* Waits that fail fast instead of hanging (``within``, ``Changes``, ``wait_all_tasks_blocked``,
  all bounded by ``BOUND``) and a ``Gate`` that holds the code under test at a known point.
* A ``ScriptedExecutor``, an agent whose steps and whose answer to a cancel the test scripts.
* Servers around it (``make_server``, or a ``Bench`` that serves them over a real socket): the
  SDK's handler, the SDK's handler around a ``CancellableExecutor``, or ours.
* What a client sees: ``start`` a task, ``cancel`` it, read it back (``stored``); a ``Stream``
  records a task's events, a ``PushReceiver`` the notifications its push configs are sent.

``a2a-cancelfix check`` and this package's own tests and benchmarks are built from it.
"""

from a2a_cancelfix.testing._origins import ORIGINS
from a2a_cancelfix.testing._probe import Point
from a2a_cancelfix.testing._report import Report, Row
from a2a_cancelfix.testing.executors import ScriptedExecutor
from a2a_cancelfix.testing.observers import PushReceiver, Stream, state_of
from a2a_cancelfix.testing.scenario_file import play
from a2a_cancelfix.testing.servers import (
    IN_PROCESS,
    Bench,
    Server,
    caller,
    cancel,
    make_server,
    message,
    outcome,
    reached_step,
    start,
    stored,
)
from a2a_cancelfix.testing.sweep import sweep
from a2a_cancelfix.testing.waits import BOUND, Changes, Gate, wait_all_tasks_blocked, within

__all__ = [
    "BOUND",
    "IN_PROCESS",
    "ORIGINS",
    "Bench",
    "Changes",
    "Gate",
    "Point",
    "PushReceiver",
    "Report",
    "Row",
    "ScriptedExecutor",
    "Server",
    "Stream",
    "caller",
    "cancel",
    "make_server",
    "message",
    "outcome",
    "play",
    "reached_step",
    "start",
    "state_of",
    "stored",
    "sweep",
    "wait_all_tasks_blocked",
    "within",
]

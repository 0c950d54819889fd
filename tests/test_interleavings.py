"""Random orders of sends, subscribes, cancels, resumes and executor steps keep the contract.

CI runs a few hundred examples per a2a-sdk release; for tens of thousands:
    A2A_CANCELFIX_EXAMPLES=20000 nox -- tests/test_interleavings.py
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field

from a2a.server.tasks import InMemoryTaskStore
from a2a.types import (
    CancelTaskRequest,
    SendMessageConfiguration,
    SendMessageRequest,
    SubscribeToTaskRequest,
    Task,
)
from a2a.utils.errors import A2AError, InternalError, TaskNotCancelableError, TaskNotFoundError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from a2a_cancelfix import _sdk
from a2a_cancelfix.testing import (
    ScriptedExecutor,
    Stream,
    caller,
    make_server,
    message,
    reached_step,
    state_of,
)
from a2a_cancelfix.testing.waits import eventually

from .support import tasks_since

GRACE = 0.05
BOUND = GRACE + 1.5
EXAMPLES = int(os.environ.get("A2A_CANCELFIX_EXAMPLES", "200"))


class RecordingStore(InMemoryTaskStore):
    """An in-memory store that remembers every state it was asked to save.

    Slow, each read and write answers a few loop turns later, as a database's would (turns,
    not a thread: hypothesis needs each example to replay the same); armed, its next read
    fails as a dropped connection would.
    """

    def __init__(self, slow: bool = False) -> None:
        super().__init__()
        self.saved: list[int] = []
        self.slow = slow
        self.fail_next_read = False

    async def get(self, *args, **kwargs) -> Task | None:
        await self._latency()
        if self.fail_next_read:
            self.fail_next_read = False
            raise ConnectionError("the database went away")
        return await super().get(*args, **kwargs)

    async def save(self, task: Task, *args, **kwargs) -> None:
        self.saved.append(task.status.state)
        await self._latency()
        await super().save(task, *args, **kwargs)

    async def _latency(self) -> None:
        for _ in range(3 if self.slow else 0):
            await asyncio.sleep(0)


@dataclass
class Play:
    """What happened in one example, for the invariants to judge."""

    cancels: list[asyncio.Future] = field(default_factory=list)
    senders: list[asyncio.Future] = field(default_factory=list)
    streams: list[tuple[str, Stream]] = field(default_factory=list)


setups = st.fixed_dictionaries(
    {
        "park": st.booleans(),
        "cancel": st.sampled_from(["empty", "publish", "raise", "hang"]),
        "swallow": st.booleans(),
        "send": st.sampled_from(["stream", "blocking", "immediate"]),
        "shield": st.booleans(),
        "burst": st.sampled_from([0, 60]),
        "store": st.sampled_from(["fast", "slow"]),
    }
)
actions = st.lists(
    st.one_of(
        st.sampled_from(
            ["cancel", "cancels", "leave", "subscribe", "resume", "resume stream", "step", "fail read"]
        ),
        st.integers(min_value=1, max_value=30),  # let the loop run this many turns
    ),
    min_size=1,
    max_size=7,
)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=os.environ.get("A2A_CANCELFIX_EXAMPLES") is None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(setup=setups, steps=actions)
def test_any_interleaving_keeps_the_contract(setup: dict, steps: list) -> None:
    """Cancels answer CANCELED or an A2A error in time, terminal states stay, streams end, nothing leaks."""
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(asyncio.wait_for(play(setup, steps), 30))
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


async def play(setup: dict, steps: list) -> None:
    baseline = asyncio.all_tasks()
    store = RecordingStore(slow=setup["store"] == "slow")
    executor = ScriptedExecutor(
        park=setup["park"],
        cancel=setup["cancel"],
        swallow=setup["swallow"],
        shield=setup["shield"],
        burst=setup["burst"],
    )
    server = make_server("ours", executor, store=store, cancel_grace_period=GRACE)
    handler = server.handler
    happened = Play()

    configuration = SendMessageConfiguration(return_immediately=setup["send"] == "immediate")
    request = SendMessageRequest(message=message(), configuration=configuration)
    if setup["send"] == "stream":
        happened.streams.append(("sender", Stream(handler.on_message_send_stream(request, caller()))))
    else:
        sender = asyncio.ensure_future(handler.on_message_send(request, caller()))
        happened.senders.append(("immediate" if setup["send"] == "immediate" else "sender", sender))
    await reached_step(server)
    task_id = executor.task_id

    def cancel() -> asyncio.Future:
        return asyncio.ensure_future(
            asyncio.wait_for(handler.on_cancel_task(CancelTaskRequest(id=task_id), caller()), BOUND)
        )

    for step in steps:
        if step == "cancel":
            happened.cancels.append(cancel())
        elif step == "cancels":
            happened.cancels += [cancel(), cancel()]
        elif step == "leave":
            if happened.cancels:
                happened.cancels[-1].cancel()  # That cancel's client went away.
        elif step == "subscribe":
            subscription = handler.on_subscribe_to_task(SubscribeToTaskRequest(id=task_id), caller())
            happened.streams.append(("subscriber", Stream(subscription)))
        elif step == "resume":
            resume = SendMessageRequest(message=message("more", task_id=task_id))
            happened.senders.append(
                ("resume", asyncio.ensure_future(handler.on_message_send(resume, caller())))
            )
        elif step == "resume stream":
            resume = SendMessageRequest(message=message("more", task_id=task_id))
            happened.streams.append(("resume", Stream(handler.on_message_send_stream(resume, caller()))))
        elif step == "fail read":
            store.fail_next_read = True
        elif step == "step":
            executor.step.open()
        else:
            # Not a wait: hypothesis picks how many turns the loop runs before the next action,
            # to reach orders that no gate names. No invariant below relies on what they ran.
            for _ in range(step):
                await asyncio.sleep(0)

    if happened.cancels:
        await asyncio.wait(happened.cancels, timeout=BOUND * 2)
    store.fail_next_read = False  # The failure was transient.
    final_cancel = cancel()  # Ends any task the steps left running, so every stream must end.
    await asyncio.wait([final_cancel], timeout=BOUND * 2)
    happened.cancels.append(final_cancel)
    executor.released.set()

    # 1. Every cancel answered in time (but those whose client left): CANCELED, TaskNotFound
    # or TaskNotCancelable; InternalError where the executor's cancel() raised.
    expected_errors: tuple[type, ...] = (TaskNotFoundError, TaskNotCancelableError)
    if setup["cancel"] == "raise" or "fail read" in steps:
        expected_errors += (InternalError,)
    outcomes = []
    for attempt in happened.cancels:
        assert attempt.done(), "a cancel did not answer within the grace period"
        if attempt.cancelled():
            continue
        error = attempt.exception()
        assert error is None or isinstance(error, expected_errors), error
        outcomes.append("CANCELED" if error is None else type(error).__name__)
        if error is None:
            assert attempt.result().status.state == _sdk.CANCELED

    # 2. A terminal state, once saved, is never replaced.
    terminal = [state for state in store.saved if state in _sdk.TERMINAL_STATES]
    assert terminal, "the task never reached a terminal state"
    first = store.saved.index(terminal[0])
    assert set(store.saved[first:]) == {terminal[0]}, store.saved
    if "CANCELED" in outcomes:
        assert terminal[0] == _sdk.CANCELED
    if "InternalError" in outcomes and "fail read" not in steps:
        assert _state_name(terminal[0]) == "FAILED"
    final = _state_name(terminal[0])

    # 3. Every stream ended, on the stored terminal state (or an A2A error); only the first
    # sender of a parked task ends earlier, where its request ended: INPUT_REQUIRED.
    for kind, stream in happened.streams:
        assert await stream.ended(BOUND), f"a {kind} stream never ended"
        if stream.error is not None:
            assert isinstance(stream.error, A2AError), stream.error
            continue
        last = state_of(stream.events[-1]) if stream.events else None
        parked_answer = kind == "sender" and last == "INPUT_REQUIRED"
        assert parked_answer or last == final, (kind, last, final)

    # 4. Blocking senders got the stored terminal state or an A2A error, never an internal
    # exception; those that do not wait for the end (and a parked task's first sender) aside.
    if happened.senders:
        await asyncio.wait([sender for _, sender in happened.senders], timeout=BOUND)
    for kind, sender in happened.senders:
        assert sender.done(), "a blocking sender never got an answer"
        error = sender.exception()
        assert error is None or isinstance(error, A2AError), error
        if error is not None or kind == "immediate" or not isinstance(sender.result(), Task):
            continue
        state = state_of(sender.result())
        answers_at_once = kind == "resume" and _sdk.SDK_VERSION == "1.0.0"  # See test_handler.
        parked_answer = kind == "sender" and state == "INPUT_REQUIRED"
        assert answers_at_once or parked_answer or state == final, (kind, state, final)

    # 5. Nothing of the task is left behind. Up to a2a-sdk 1.2.2 a run that completed on its
    # own may never close its queues (the stock handler leaves the same run, with its tasks
    # and registry entry, after a resumed sender or a follow-up message): not ours.
    sdk_may_leak = final == "COMPLETED" and not _sdk.RUNS_CLOSE_THEMSELVES
    await eventually(lambda: _nothing_left(server, task_id, baseline, sdk_may_leak), BOUND)
    lifecycle = handler.agent_executor.cancel_lifecycle
    assert lifecycle.cancellations == {} and lifecycle.works == {}


async def _nothing_left(server, task_id: str, baseline: set, sdk_may_leak: bool) -> bool:
    left = tasks_since(baseline)
    if sdk_may_leak:  # Its tasks, and so its registry entry, may stay.
        return not {task for task in left if not task.get_coro().__qualname__.startswith(_SDK_RUN)}
    return not await _sdk.has_run(server.handler, task_id) and not left


# What a run of the SDK consists of: its producer, consumer and queues' tasks.
_SDK_RUN = ("ActiveTask.", "EventQueue", "EventConsumer.", "AsyncQueueProxy.")


def _state_name(state: int) -> str:
    from a2a.types import TaskState

    return TaskState.Name(state).removeprefix("TASK_STATE_")


def replay(setup: dict, steps: list) -> None:
    """Run one interleaving, as hypothesis would."""
    test_any_interleaving_keeps_the_contract.hypothesis.inner_test(setup=setup, steps=steps)


WORKING_STREAM = {
    "park": False,
    "cancel": "empty",
    "swallow": False,
    "send": "stream",
    "shield": False,
    "burst": 0,
    "store": "fast",
}
PARKED_STREAM = {**WORKING_STREAM, "park": True}


def test_a_message_after_the_task_ended_leaks_nothing() -> None:
    """Found by hypothesis: the SDK set up a run for a message to an ended task and leaked it."""
    replay(WORKING_STREAM, ["step", 17, "cancel", "resume"])


def test_a_subscriber_does_not_stall_the_run_teardown() -> None:
    """Found by hypothesis: a subscriber took the SDK's end-of-request marker and hung its teardown."""
    replay(WORKING_STREAM, ["subscribe", "step", 1])


def test_a_queued_message_cannot_run_after_completion() -> None:
    """Found by hypothesis: a queued message ran after COMPLETED and a cancel then wrote CANCELED over it."""
    replay(WORKING_STREAM, ["resume", "step"])


def test_subscribing_after_a_cancel_leaks_nothing() -> None:
    """Found by hypothesis: subscribing to a canceled task made the SDK set up and leak a run."""
    replay(PARKED_STREAM, ["cancel", 19, "subscribe"])


def test_a_cancel_resumed_without_its_caller_still_tears_the_run_down() -> None:
    """Found by hypothesis: resumed after its client left, a cancel found the run finished,
    took the path for a task with no run here, and left the run's bookkeeping behind."""
    replay(WORKING_STREAM, ["cancel", 4, "leave"])


def test_a_resumed_run_completing_on_a_slow_store_leaves_nothing_of_ours() -> None:
    """Found by hypothesis: on a2a-sdk up to 1.2.2 such a run never closes its queues, under the
    stock handler too; nothing of ours is left, and the cancel after it is refused."""
    replay({**PARKED_STREAM, "store": "slow"}, ["resume", "step", 21])


def test_follow_ups_to_a_running_task_that_completes_leave_nothing_of_ours() -> None:
    """Found by hypothesis: on a2a-sdk 1.1.3 the SDK keeps such a run (stock too)."""
    replay(WORKING_STREAM, ["resume", "resume stream", "step", 2])

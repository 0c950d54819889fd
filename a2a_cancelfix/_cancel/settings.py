"""A handler's options, and the time policy every cancel of it follows."""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

from a2a_cancelfix import _sdk
from a2a_cancelfix._aio import checked_seconds, deadline_in

DEFAULT_GRACE_PERIOD = 5.0
# How long a handler's aclose() may take: pushes sent, pending CANCELED writes tried once more.
DEFAULT_DRAIN_TIME = 5.0
DEFAULT_POLL_INTERVAL = 1.0


class _DefaultSeconds(float):
    """A default that is raised where the other options need more; a value given is a plain
    number, judged as given (``lease_time=30`` too)."""


# A replica's lease on its runs, where the task store is a database (see _liveness.py).
DEFAULT_LEASE_TIME: float = _DefaultSeconds(30.0)


@dataclasses.dataclass(frozen=True)
class Timing:
    """How long the parts of a cancel past its grace period may take; no user sets it.

    Attributes:
        margin: past the deadline, for the SDK's part (recording the terminal state, its own
            cancel of a task not live here, closing a run) and for a direct write of CANCELED.
        lateness: how far a loop's own lateness may stretch a margin (see `wait_patiently`).
        patience: after the answer, how long a run that can close itself gets to do so.
        retries: the waits between the attempts to record a stopped run's CANCELED that the
            store failed to take (about ten minutes in all).
    """

    margin: float = 1.0
    lateness: float = 30.0
    patience: float = 30.0
    retries: tuple[float, ...] = (0.1, 0.5, 1.0, 2.0) + (5.0,) * 120


class Timeline:
    """One cancel's bounds in the loop's time, from its deadline, fixed as it starts."""

    __slots__ = ("deadline", "timing")

    def __init__(self, grace_period: float, timing: Timing) -> None:
        self.deadline = deadline_in(grace_period)
        self.timing = timing

    def margin_from_now(self) -> tuple[float, float]:
        """A margin from now, never before the deadline's; and how far lateness may push it."""
        bound = max(self.deadline, deadline_in(0.0)) + self.timing.margin
        return bound, bound + self.timing.lateness

    @property
    def sdk_cancel_by(self) -> float:
        """Until when the SDK's own cancel of a task not live here is waited for."""
        return self.deadline + self.timing.margin

    def teardown_by(self) -> float:
        """Until when a run answered for may close itself before it is forced closed.

        Up to a2a-sdk 1.2.2 no run closes itself (`_sdk.RUNS_CLOSE_THEMSELVES`): the margin is
        a courtesy there; later, a run on a loop busy with thousands of cancels needs longer.
        """
        return deadline_in(self.timing.patience if _sdk.RUNS_CLOSE_THEMSELVES else self.timing.margin)


@dataclasses.dataclass(frozen=True)
class Settings:
    """A lifecycle's options, checked once, here (the handler's keywords of the same names).

    ``timing`` is no keyword of the handler's: the testing kit and the tests set it.

    Raises:
        TypeError: a number of seconds that is not a number.
        ValueError: zero, negative, NaN or infinite seconds; an unknown policy.
    """

    cancel_grace_period: float = DEFAULT_GRACE_PERIOD
    replica_poll_interval: float | None = DEFAULT_POLL_INTERVAL
    on_parked: Literal["cancel", "refuse"] = "cancel"
    on_canceled: Literal["raise", "return"] = "raise"
    cancel_unwatched_after: float | None = None
    cancel_unwatched_parked: bool = False
    shutdown_drain_time: float = DEFAULT_DRAIN_TIME
    lease_time: float | None = DEFAULT_LEASE_TIME
    sole_replica: bool = False
    timing: Timing = Timing()

    def __post_init__(self) -> None:
        set_checked = functools.partial(object.__setattr__, self)
        set_checked("cancel_grace_period", checked_seconds("cancel_grace_period", self.cancel_grace_period))
        set_checked("shutdown_drain_time", checked_seconds("shutdown_drain_time", self.shutdown_drain_time))
        if self.replica_poll_interval is not None:
            set_checked(
                "replica_poll_interval", checked_seconds("replica_poll_interval", self.replica_poll_interval)
            )
        if self.cancel_unwatched_after is not None:
            set_checked(
                "cancel_unwatched_after",
                checked_seconds("cancel_unwatched_after", self.cancel_unwatched_after),
            )
        if not isinstance(self.cancel_unwatched_parked, bool):
            raise TypeError(
                f"cancel_unwatched_parked must be True or False, not {self.cancel_unwatched_parked!r}"
            )
        if self.cancel_unwatched_parked and self.cancel_unwatched_after is None:
            raise ValueError("cancel_unwatched_parked needs cancel_unwatched_after")
        self._check_lease(set_checked)
        if self.on_parked not in ("cancel", "refuse"):
            raise ValueError(f"on_parked must be 'cancel' or 'refuse', not {self.on_parked!r}")
        if self.on_canceled not in ("raise", "return"):
            raise ValueError(f"on_canceled must be 'raise' or 'return', not {self.on_canceled!r}")

    def _check_lease(self, set_checked: functools.partial[None]) -> None:
        """A lease long enough for a replica that lost it to stop its runs in its first half.

        The default is raised to that minimum where a long grace period needs more; a
        ``lease_time`` given below it is refused, whatever its value (30 too).
        """
        if not isinstance(self.sole_replica, bool):
            raise TypeError(f"sole_replica must be True or False, not {self.sole_replica!r}")
        if self.lease_time is None:
            return
        lease_time = checked_seconds("lease_time", self.lease_time)
        least = self.least_lease_time
        if lease_time < least:
            if not isinstance(self.lease_time, _DefaultSeconds):
                raise ValueError(
                    f"lease_time must be at least 2 x (cancel_grace_period + 3 x {self.timing.margin:g} s) "
                    f"= {least:g} s with cancel_grace_period={self.cancel_grace_period:g}, not {lease_time:g}"
                )
            lease_time = least
        set_checked("lease_time", lease_time)

    @property
    def least_lease_time(self) -> float:
        """The shortest lease: its half holds a cancel (grace period, the SDK's part, a write)."""
        return 2 * (self.cancel_grace_period + 3 * self.timing.margin)

    def timeline(self) -> Timeline:
        """The bounds of a cancel that starts now."""
        return Timeline(self.cancel_grace_period, self.timing)

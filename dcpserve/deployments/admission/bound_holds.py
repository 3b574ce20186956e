"""The TTFT bound's holds on waiting requests (dcpserve/deployments/admission/ttft_bound.py has the rule): how much
longer each may be held back, its hold, and the queue's next look when the earliest hold ends.

A request is held at most the bound from its first hold, and is let go DEFER_MARGIN_S before its deadline or its
queue timeout would end its wait, so a hold never turns into a refusal. The queue also looks again at every report,
release or arrival before then (each calls its _fulfill); the timer is what ends a hold when nothing else happens.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable
from typing import Protocol

# A held request is let go this long before its deadline or timeout would end its wait.
DEFER_MARGIN_S = 0.05


class Held(Protocol):
    """What the holds read and write of a waiting request (the queue's _Waiter)."""

    timeout_at: float  # when its queue timeout ends its wait (the queue's clock)
    deadline_at: float | None
    defer_end: float | None  # the latest it may be held (set at its first hold)
    defer_until: float | None  # held until then


class BoundHolds:
    """The holds of one queue: `bound_s` (0: the bound is off, nothing is held) and `wake`, the queue's look at its
    waiters, called by the event loop's timer when the earliest hold ends."""

    def __init__(self, bound_s: float, wake: Callable[[], None]) -> None:
        if bound_s < 0:
            raise ValueError(f"admission_ttft_bound_s must be >= 0 (0: off), got {bound_s}")
        self.bound_s = bound_s
        self._wake = wake
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def may_wait(self, waiter: Held, now: float) -> float:
        """How much longer the bound may hold the waiter back."""
        if self.bound_s <= 0:
            return 0.0
        end = waiter.defer_end
        if end is None:
            end = min(now + self.bound_s, waiter.timeout_at - DEFER_MARGIN_S,
                      math.inf if waiter.deadline_at is None else waiter.deadline_at - DEFER_MARGIN_S)
        return max(end - now, 0.0)

    def hold(self, waiter: Held, wait_s: float, now: float) -> bool:
        """Holds the waiter back for wait_s; True at its first hold (a decision to count)."""
        first = waiter.defer_end is None
        if first:
            waiter.defer_end = now + self.may_wait(waiter, now)
        waiter.defer_until = now + wait_s
        return first

    def schedule(self, held: Iterable[Held], now: float) -> None:
        """Sets the timer for the earliest end of the holds of these waiters (those still waiting)."""
        ends = [w.defer_until for w in held if w.defer_until is not None]
        if not ends or min(ends) >= self._timer_at:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop: no waiter is held either (only acquire, on a loop, makes waiters)
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = min(ends)
        self._timer = loop.call_later(max(self._timer_at - now, 0.0), self._fire)

    def _fire(self) -> None:
        self._timer, self._timer_at = None, math.inf
        self._wake()

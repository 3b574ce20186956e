"""Refusing requests that wait in the admission queue (dcpserve/deployments/admission/queue.py): sheddable requests
under saturation, and the full queue's newcomer rule (fair_share.py `displaced`).

Sheddable requests (priority >= the app's sheddable_priority, and the order is "service_levels") are refused first:
a new one at once while a request that is not sheddable waits for KV it could use (the pools it could use are
saturated), and those waiting, newest first, as soon as one that is not sheddable has to wait. A newcomer to a full
queue (more than max_queued wait) takes the place `displaced` names (shed, if sheddable, else refused with
QueueFull), or is refused itself. Requests the TTFT bound holds (parked, bound_holds.py) count as waiting here as
any other.

`Shedding` is a base of AdmissionQueue, as ReplicaLedger (ledger.py) is: it reads and changes the queue's waiters.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from dcpserve.deployments.admission.bound_holds import BoundHolds
from dcpserve.deployments.admission.errors import QueueFull, Shed
from dcpserve.deployments.admission.fair_share import displaced, displaced_why
from dcpserve.deployments.admission.pools import pools_of
from dcpserve.deployments.admission.replica_choice import ReplicaKv
from dcpserve.deployments.admission.waiter import Waiter
from dcpserve.deployments.messages import ServiceLevel


class Shedding:
    """The queue's refusals of waiting requests: sheddable ones under saturation, and a full queue's newcomer rule."""

    # Set by the queue's constructor.
    replicas: dict[str, ReplicaKv]
    max_queued: int
    sheddable_priority: int | None
    order: str
    holds: BoundHolds[Waiter]
    num_shed: int
    num_rejected_full: int
    _waiters: deque[Waiter]
    _clock: Callable[[], float]
    _on_event: Callable[[str, float | None, ServiceLevel | None], None] | None

    def _waiting(self) -> Iterator[Waiter]:
        """Every request still waiting: those the queue's walk looks at, then those the TTFT bound holds."""
        for waiter in self._waiters:
            if not waiter.future.done():
                yield waiter
        for held in self.holds.parked():
            if not held.future.done():
                yield held

    def _remove(self, waiter: Waiter) -> None:
        """Takes a waiter out of the queue, whether the walk looks at it or it is held."""
        if self.holds.is_parked(waiter):
            self.holds.unpark(waiter)
            return
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass

    def _sheddable(self, level: ServiceLevel) -> bool:
        return (self.order != "fifo" and self.sheddable_priority is not None
                and level.priority >= self.sheddable_priority)

    def _saturated_pools(self) -> set[str]:
        """The pools a waiting request that is not sheddable could use: there, sheddable requests are refused."""
        if self.sheddable_priority is None or self.order == "fifo":
            return set()
        saturated: set[str] = set()
        for waiter in self._waiting():
            if not self._sheddable(waiter.level):
                saturated |= pools_of(waiter.need, self.replicas.values())
        return saturated

    def _newest_sheddable(self, pools: set[str]) -> Waiter | None:
        """The sheddable waiter that arrived last among those that could use `pools`."""
        candidates = [w for w in self._waiting() if self._sheddable(w.level)
                      and pools_of(w.need, self.replicas.values()) & pools]
        return max(candidates, key=lambda w: w.seq, default=None)

    def _shed_message(self, level: ServiceLevel, waited_s: float) -> str:
        waiting = sum(1 for w in self._waiting() if not self._sheddable(w.level))
        return (f"shed after {waited_s:.1f}s: priority {level.priority} is sheddable (sheddable_priority="
                f"{self.sheddable_priority}) and the app is saturated ({waiting} requests that are not sheddable wait "
                f"for KV); retry later or send a lower priority")

    def _shed(self, waiter: Waiter, why: str) -> None:
        self.num_shed += 1
        message = self._shed_message(waiter.level, self._clock() - waiter.arrived)
        waiter.future.set_exception(Shed(f"{message}; {why}"))
        self._remove(waiter)

    def _shed_under_saturation(self) -> None:
        """Under saturation (a request that is not sheddable still waits), refuses the sheddable waiters that could
        use its pools, newest first."""
        saturated = self._saturated_pools()
        while saturated:
            victim = self._newest_sheddable(saturated)
            if victim is None:
                break
            self._shed(victim, "a request that is not sheddable waits for KV it could use")

    def _admit_to_full_queue(self, waiter: Waiter, level: ServiceLevel) -> None:
        """The newcomer `waiter` made the queue hold more than max_queued: it takes `displaced`'s victim's place (the
        victim is shed or refused QueueFull), or is refused QueueFull itself (raised)."""
        waiting = list(self._waiting())
        full = (f"the admission queue is full ({len(waiting) - 1} requests wait for KV, max_queued_requests="
                f"{self.max_queued})")
        victim = None if self.order == "fifo" else displaced(waiting, waiter, self._sheddable)
        if victim is None:
            self._remove(waiter)
            waiter.future.cancel()
            self.num_rejected_full += 1
            if self._on_event is not None:
                self._on_event("rejected_queue_full", None, level)
            raise QueueFull(f"{full}; retry later")
        if self._sheddable(victim.level):
            self._shed(victim, f"{full} and a request that is not sheddable arrived")
        else:
            self._remove(victim)
            self.num_rejected_full += 1
            victim.future.set_exception(QueueFull(
                f"{full} and a request of priority {level.priority} from tenant {level.tenant!r} took this "
                f"one's place (the newest of {displaced_why(waiting, victim)}); retry later"))

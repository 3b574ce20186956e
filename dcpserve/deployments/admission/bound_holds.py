"""The holds on waiting requests: the TTFT bound's (dcpserve/deployments/admission/ttft_bound.py has the rule) and
the prefix hold's (dcpserve/deployments/admission/replica_choice.py); how much longer each may be held back, its hold,
which held requests the queue looks at again, and when.

A prefix hold parks the request the same way, watching one replica for room: it wakes when its hold ends or as soon
as that replica (grantable) has its need there free (`free_of`, looked at on every event of the queue). The requests
waiting for one replica wake in the order they were first held, only as many as its free blocks hold (the first
that does not fit stops the look), so a release wakes the requests it can grant, not all of them.

A request is held at most the bound from its first hold, and is let go DEFER_MARGIN_S before its deadline or its
queue timeout would end its wait, so a hold never turns into a refusal.

A held request is parked: out of the queue's walk (it closes no pool, and takes no place in the order: its tenant's
and session's turns there go to requests that can be granted now), so that a deep queue of held requests costs the
walk nothing (looking at each of them again at every report, release or arrival made
every event cost O(waiters x replicas), quadratic over a run). It comes back to the walk when its hold ends
(`defer_until`), or earlier when one of the replicas it could be granted to at its hold (room, balance) could start it
within the bound: each such replica is watched with the request's own prefill there (`own_s`), and the request wakes
once the replica's queued prefill is done (replica_choice.drained_at, which moves only when the replica reports, is
granted a request, or a grant its report does not name goes back) within bound_s - own_s of now. So a report that
finds a backlog drained faster than estimated, or a grant that went back, ends the hold at once, as before; a grant
to a replica (which only delays its drain) wakes nobody. The queue wakes every held request when its replicas change
(one joins, leaves, or becomes grantable or not).

What a parked request no longer sees before its hold ends, by design (the walk did, at every event): a replica that
had no room for it or was out of balance at its hold and gets room (it is looked at when the hold ends, within the
bound; so is one within the bound at its hold that the walk passed over, its pool closed by a request ahead), a
prefix the replica caches since (it only lowers the request's own prefill there), and backlogs growing past
what the hold allows (it was granted at once where it starts soonest; now at the hold's end: the request then misses
the bound either way, and the prefill granted meanwhile within the bound does not wait behind its prompt). A parked
request that finds no room when its hold ends waits for KV as any other, closing its pools to those behind it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Generic, Protocol, TypeVar

from dcpserve.deployments.admission.ttft_bound import BOUND_TOLERANCE_S

# A held request is let go this long before its deadline or timeout would end its wait.
DEFER_MARGIN_S = 0.05
# The heaps are compacted once their entries pass twice the live ones at the last compaction plus this many.
COMPACT_SLACK = 64


class Held(Protocol):
    """What the holds read and write of a waiting request (the queue's Waiter)."""

    timeout_at: float  # when its queue timeout ends its wait (the queue's clock)
    deadline_at: float | None
    defer_end: float | None  # the latest it may be held (set at its first hold)
    defer_until: float | None  # held until then


H = TypeVar("H", bound=Held)
K = TypeVar("K", int, float)


class BoundHolds(Generic[H]):
    """The holds of one queue: `bound_s` (0: the bound is off, nothing is held), the parked requests, and `wake`, the
    queue's look at its waiters, called by the event loop's timer when the earliest hold ends or a watched replica
    drains far enough."""

    def __init__(self, bound_s: float, wake: Callable[[], None]) -> None:
        if bound_s < 0:
            raise ValueError(f"admission_ttft_bound_s must be >= 0 (0: off), got {bound_s}")
        self.bound_s = bound_s
        self._wake = wake
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._ids = itertools.count()
        self._parked: dict[int, H] = {}  # park id -> the request, while parked
        self._park_id: dict[int, int] = {}  # id(request) -> its park id, while parked
        self._ends: list[tuple[float, int]] = []  # (defer_until, park id), a heap; entries of woken ones linger
        # replica id -> (the request's own_s - bound_s, park id), a heap: the request wakes once the replica's
        # queued prefill is done by now + bound_s - own_s
        self._watch: dict[str, list[tuple[float, int]]] = {}
        # replica id -> (first held at, park id), a heap: prefix holds, woken in that order once the replica has room
        # for their need there (`_room_need`, by park id)
        self._room: dict[str, list[tuple[float, int]]] = {}
        self._room_need: dict[int, int] = {}
        # Heap entries pushed, live or stale (pops are not counted), and how many were live at the last compaction.
        # A park pushes one entry per replica it watches (up to every replica of the app), so the live entries alone
        # may be many times the parked requests: compacting when the entries outgrew a multiple of the parked ones
        # compacted at every park, O(parked x replicas) each, quadratic in a deep queue at 64 replicas (the
        # simulator at 512 GPUs). Compacting when they doubled since the last keeps the heaps within twice their
        # live size plus one park's, at O(1) amortized per entry.
        self._entries = 0
        self._entries_compacted = 0

    def __len__(self) -> int:
        return len(self._parked)

    def parked(self) -> Iterable[H]:
        """The requests parked now."""
        return self._parked.values()

    def is_parked(self, waiter: H) -> bool:
        return id(waiter) in self._park_id

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

    def park(self, waiter: H, own_s: Iterable[tuple[str, float]], room: tuple[str, int] | None = None,
             held_at: float = 0.0) -> None:
        """Parks a held waiter until its hold ends (defer_until) or one of the replicas in `own_s` (replica id, the
        waiter's own prefill there, for those it could be granted to now) could start it within the bound, or
        (`room`: a prefix hold's replica id and the waiter's need there; `held_at`: when it was first held for it,
        its place among those waiting for that replica) that replica has room for it."""
        if waiter.defer_until is None:
            raise ValueError("park() takes a held waiter: hold() it first")
        self.unpark(waiter)
        park_id = next(self._ids)
        self._parked[park_id] = waiter
        self._park_id[id(waiter)] = park_id
        heapq.heappush(self._ends, (waiter.defer_until, park_id))
        self._entries += 1
        if room is not None:
            heapq.heappush(self._room.setdefault(room[0], []), (held_at, park_id))
            self._room_need[park_id] = room[1]
            self._entries += 1
        for replica_id, own in own_s:
            if own < self.bound_s:  # draining never starts a prompt whose own prefill is past the bound within it
                heapq.heappush(self._watch.setdefault(replica_id, []), (own - self.bound_s, park_id))
                self._entries += 1
        if self._entries > 2 * self._entries_compacted + COMPACT_SLACK:
            self._compact()

    def unpark(self, waiter: H) -> None:
        """Takes the waiter out (granted, refused, gone, or back to the walk); its heap entries go stale."""
        park_id = self._park_id.pop(id(waiter), None)
        if park_id is not None:
            del self._parked[park_id]
            self._room_need.pop(park_id, None)

    def wake(self, now: float, drained: Mapping[str, float | None],
             free_of: Callable[[str], int | None] = lambda _: None) -> list[H]:
        """Unparks and returns, in park order, the waiters whose hold has ended, those a watched replica could now
        start within the bound, and those whose prefix hold's replica has room for them; `drained`: replica id ->
        replica_choice.drained_at, for the grantable replicas; `free_of`: a grantable replica's free blocks (None
        for any other)."""
        woken: dict[int, H] = {}
        while self._ends and self._ends[0][0] <= now + BOUND_TOLERANCE_S:
            self._take(heapq.heappop(self._ends)[1], woken)
        for replica_id in list(self._room):
            free = free_of(replica_id)
            if free is None:  # gone or not grantable: the queue wakes everyone when that changes
                continue
            room = self._room[replica_id]
            while room:
                park_id = room[0][1]
                need = self._room_need.get(park_id) if park_id in self._parked else None
                if need is not None:
                    if need > free:
                        break
                    free -= need
                    self._take(park_id, woken)
                heapq.heappop(room)
            if not room:
                del self._room[replica_id]
        for replica_id in list(self._watch):
            if replica_id not in drained:  # gone or not grantable: the queue wakes everyone when that changes
                continue
            heap = self._watch[replica_id]
            done_at = drained[replica_id]
            # within the bound there once done_at - now + own_s <= bound_s (no estimate: within any bound); half
            # the rule's tolerance, so that a waiter woken here is within the rule's bound despite rounding
            limit = math.inf if done_at is None else now - done_at + BOUND_TOLERANCE_S / 2
            while heap and heap[0][0] <= limit:
                self._take(heapq.heappop(heap)[1], woken)
            if not heap:
                del self._watch[replica_id]
        return [woken[park_id] for park_id in sorted(woken)]

    def wake_all(self) -> list[H]:
        """Unparks every waiter (the replicas changed: what each was watching no longer says when it may go)."""
        woken = list(self._parked.values())
        self._parked.clear()
        self._park_id.clear()
        self._ends.clear()
        self._watch.clear()
        self._room.clear()
        self._room_need.clear()
        self._entries = self._entries_compacted = 0
        return woken

    def _take(self, park_id: int, woken: dict[int, H]) -> None:
        self._room_need.pop(park_id, None)
        waiter = self._parked.pop(park_id, None)
        if waiter is not None:
            del self._park_id[id(waiter)]
            woken[park_id] = waiter

    def _compact(self) -> None:
        """Drops the heap entries of waiters no longer parked (they are left behind by unpark and wake)."""
        self._ends = [entry for entry in self._ends if entry[1] in self._parked]
        heapq.heapify(self._ends)
        self._watch = self._live(self._watch)
        self._room = self._live(self._room)
        self._entries = self._entries_compacted = (len(self._ends) + sum(len(heap) for heap in self._watch.values())
                                                   + sum(len(heap) for heap in self._room.values()))

    def _live(self, watches: dict[str, list[tuple[K, int]]]) -> dict[str, list[tuple[K, int]]]:
        """The watch heaps with only the entries of waiters still parked (empty ones dropped)."""
        live: dict[str, list[tuple[K, int]]] = {}
        for replica_id, heap in watches.items():
            entries = [entry for entry in heap if entry[1] in self._parked]
            if entries:
                heapq.heapify(entries)
                live[replica_id] = entries
        return live

    def next_look(self, drained: Mapping[str, float | None]) -> float:
        """When the earliest parked waiter wakes if nothing else happens (inf: none is parked)."""
        while self._ends and self._ends[0][1] not in self._parked:
            heapq.heappop(self._ends)
        at = self._ends[0][0] if self._ends else math.inf
        for replica_id, heap in self._watch.items():
            done_at = drained.get(replica_id)
            if done_at is None:
                continue
            while heap and heap[0][1] not in self._parked:
                heapq.heappop(heap)
            if heap:
                at = min(at, done_at + heap[0][0])
        return at

    def schedule(self, now: float, drained: Mapping[str, float | None]) -> None:
        """Sets the timer for the earliest wake of the parked waiters (next_look), unless one is set before it."""
        at = self.next_look(drained)
        if at == math.inf or at >= self._timer_at:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop: no waiter is held either (only acquire, on a loop, makes waiters)
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = loop.call_later(max(at - now, 0.0), self._fire)

    def _fire(self) -> None:
        self._timer, self._timer_at = None, math.inf
        self._wake()

"""Service levels in the admission queue: who a request is, how urgent, and the order waiting requests are granted in.

A request's `ServiceLevel` is its tenant (the name of its API key; "anonymous" when the app has no keys), its
priority (the request's `priority` field, lower first as in vLLM, or its key's default), its tenant's weight and
how long it may wait (its deadline, as seconds from when it reached the queue).

The order (`admission_order`, a pure function of the waiters, the tenants' shares and the time):
1. requests a replica refused or did not take after a grant, first (they had been granted; as before);
2. priority bands, lowest value first;
3. within a band, tenants by their fair share: each tenant's attained KV-seconds (`TenantShares`: token-seconds of
   KV its grants held, decayed with a half-life, so that what counts is recent use) over its weight, least first.
   Each grant is also charged its tokens x `quantum_s` at once, and the order charges the same for every request it
   places ahead, so that requests granted at one instant alternate between tenants as deficit round robin's rounds
   do, in proportion to the weights;
4. within a tenant, its sessions (ServiceLevel.session: dcpserve/deployments/admission/session_affinity.py) by the
   same measure: each session's attained KV-seconds, least first, each request placed charging its session its
   tokens x `quantum_s`, so one agent with many queued turns or long prompts alternates with the tenant's other
   sessions instead of going ahead of them all. A request without a session is a session of its own, with nothing
   attained: such requests keep the order they had before sessions;
5. within a session (and between sessions alike), requests with a deadline by deadline (earliest first), then the
   rest by arrival.

Why attained KV-seconds and not deficit round robin's counters: DRR charges a packet its size when it is sent, but
what a request costs (KV held x how long) is known only as it runs; the queue's ledger knows every grant's KV and
age, so the share is measured, not estimated. The decay keeps a tenant that was idle from banking credit without
bound, and one that was busy from being penalized forever.

Sheddable requests (priority >= the app's sheddable_priority) are what the queue refuses first under saturation: it
refuses a new one at once while a request that is not sheddable waits for KV it could use, and refuses those
waiting, newest first, as soon as one that is not sheddable has to wait (dcpserve/deployments/admission/queue.py).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, TypeVar

from dcpserve.deployments.messages import ServiceLevel


class Waiting(Protocol):
    """What the order reads of a waiting request."""

    @property
    def level(self) -> ServiceLevel: ...
    @property
    def seq(self) -> int: ...
    @property
    def front(self) -> bool: ...
    @property
    def deadline_at(self) -> float | None: ...
    @property
    def tokens(self) -> int: ...


class TenantShares:
    """Each tenant's attained KV token-seconds, exponentially decayed with `half_life_s`, and the tokens its live
    grants hold. Exact between events: the holdings are constant between grants and releases, so the decayed
    integral advances in closed form."""

    def __init__(self, half_life_s: float = 60.0, quantum_s: float = 1.0) -> None:
        if half_life_s <= 0:
            raise ValueError(f"fair_share_half_life_s must be > 0, got {half_life_s}")
        if quantum_s < 0:
            raise ValueError(f"fair_share_quantum_s must be >= 0, got {quantum_s}")
        self.tau = half_life_s / math.log(2)
        self.quantum_s = quantum_s
        self._value: dict[str, float] = {}  # decayed token-seconds as of _as_of
        self._as_of: dict[str, float] = {}
        self.holding: dict[str, int] = {}  # tokens of KV the tenant's live grants hold
        self._seen: dict[str, tuple[float, int, float]] = {}  # tenant -> (its last request's arrival, tokens, weight)

    def seen(self, level: ServiceLevel, tokens: int, now: float) -> None:
        """A request of the tenant arrived (what reserve_against remembers of it)."""
        self._seen[level.tenant] = (now, tokens, level.weight)

    def reserve_against(self, tenant: str, holding_after: int, capacity: int, now: float) -> int:
        """The KV tokens a grant to `tenant` must leave free, so that a tenant that sent requests in the last
        half-life and holds less than its fair share finds room for its next one at once: 0 while `tenant` would
        hold at most its own fair share (capacity x its weight over the weights of the tenants seen in the last
        half-life); else the last request's tokens of each such tenant that holds less than its share."""
        window = self.tau * math.log(2)
        active = {t: (tokens, weight) for t, (at, tokens, weight) in self._seen.items() if now - at <= window}
        if tenant not in active or len(active) < 2:
            return 0
        total = sum(weight for _, weight in active.values())
        share = capacity * active[tenant][1] / total
        if holding_after <= share:
            return 0
        return sum(tokens for t, (tokens, weight) in active.items()
                   if t != tenant and self.holding.get(t, 0) + tokens <= capacity * weight / total)

    def attained(self, tenant: str, now: float) -> float:
        value = self._value.get(tenant, 0.0)
        rate = self.holding.get(tenant, 0)
        elapsed = max(now - self._as_of.get(tenant, now), 0.0)
        decay = math.exp(-elapsed / self.tau)
        return value * decay + rate * self.tau * (1.0 - decay)

    def _advance(self, tenant: str, now: float) -> None:
        self._value[tenant] = self.attained(tenant, now)
        self._as_of[tenant] = now

    def grant(self, tenant: str, tokens: int, now: float) -> None:
        self._advance(tenant, now)
        self._value[tenant] += tokens * self.quantum_s
        self.holding[tenant] = self.holding.get(tenant, 0) + tokens

    def release(self, tenant: str, tokens: int, now: float) -> None:
        self._advance(tenant, now)
        left = self.holding.get(tenant, 0) - tokens
        if left > 0:
            self.holding[tenant] = left
        else:
            self.holding.pop(tenant, None)
            if self._value[tenant] < 1e-9:
                self._forget(tenant)

    def forget(self, tenant: str) -> None:
        """Drops what the tenant attained (it holds nothing: the caller's bound on how many it keeps)."""
        self.holding.pop(tenant, None)
        self._forget(tenant)

    def _forget(self, tenant: str) -> None:
        self._value.pop(tenant, None)
        self._as_of.pop(tenant, None)
        # _seen is kept: reserve_against reads it over its own window (bounded by the number of tenants)

    def tenants(self) -> list[str]:
        return sorted(set(self._value) | set(self.holding))


W = TypeVar("W", bound=Waiting)


class SessionMeasure(Protocol):
    """What the order reads of the sessions' shares (session_affinity.SessionShares)."""

    @property
    def quantum_s(self) -> float: ...
    def attained(self, session: tuple[str, str], now: float) -> float: ...


def admission_order(waiters: Sequence[W], shares: TenantShares, now: float,
                    sessions: SessionMeasure | None = None) -> list[W]:
    """The order the queue grants waiting requests in (module doc): the head is granted first when it fits. Without
    `sessions` every request is a session of its own."""
    return list(iter_admission_order(waiters, shares, now, sessions))


def iter_admission_order(waiters: Sequence[W], shares: TenantShares, now: float,
                         sessions: SessionMeasure | None = None) -> Iterator[W]:
    """admission_order one request at a time, for a walk that stops early (the queue's, at the first request that
    finds no room in a single pool: with thousands waiting it takes one or a few, and placing all of them at every
    report and release cost O(waiters) each). What the order reads of the shares is read before the first request
    is yielded, so grants made during the walk do not change it."""
    front = sorted((w for w in waiters if w.front), key=lambda w: w.seq)
    # priority -> tenant -> session -> its waiters, the next one last
    bands: dict[int, dict[str, dict[object, list[W]]]] = {}
    for waiter in waiters:
        if not waiter.front:
            session: object = waiter.seq if sessions is None or waiter.level.session is None else waiter.level.session
            bands.setdefault(waiter.level.priority, {}).setdefault(waiter.level.tenant, {}).setdefault(
                session, []).append(waiter)
    by_deadline: Callable[[W], tuple[float, int]] = lambda w: (  # noqa: E731 - a sort key
        w.deadline_at if w.deadline_at is not None else math.inf, w.seq)
    started = [_start_band(bands[priority], shares, now, sessions, by_deadline) for priority in sorted(bands)]
    yield from front
    for tenants, spent, heaps, projected in started:
        while tenants:
            tenant = min(tenants, key=lambda t: (projected[t], tenants[t][heaps[t][0][-1]][-1].seq))
            lines, heap = tenants[tenant], heaps[tenant]
            session = heapq.heappop(heap)[-1]
            waiter = lines[session].pop()
            yield waiter
            projected[tenant] += waiter.tokens * shares.quantum_s / waiter.level.weight
            spent[tenant][session] += waiter.tokens * (sessions.quantum_s if sessions is not None else 0.0)
            if lines[session]:
                heapq.heappush(heap, _session_key(session, lines[session], spent[tenant][session], by_deadline))
            else:
                del lines[session]
            if not lines:
                del tenants[tenant], heaps[tenant]


# A band before its first request is placed: tenant -> session -> its line; tenant -> session -> spent; tenant -> its
# heap of sessions (_session_key); tenant -> its projected share.
_Band = tuple[dict[str, dict[object, list[W]]], dict[str, dict[object, float]],
              dict[str, list[tuple[float, float, int, object]]], dict[str, float]]


def _start_band(tenants: dict[str, dict[object, list[W]]], shares: TenantShares, now: float,
                sessions: SessionMeasure | None, by_deadline: Callable[[W], tuple[float, int]]) -> _Band[W]:
    """A priority band's state before its first request is placed: each session's line (the next one last), what
    each session attained, each tenant's heap of sessions and its projected share."""
    spent: dict[str, dict[object, float]] = {}  # tenant -> session -> its attained + what the order placed
    for tenant, lines in tenants.items():
        for session, line in lines.items():
            line.sort(key=by_deadline, reverse=True)  # the next one last: pop() takes it
            spent.setdefault(tenant, {})[session] = (sessions.attained((tenant, session), now)
                                                     if sessions is not None and isinstance(session, str) else 0.0)
    # Per tenant, a heap of its sessions keyed by (spent, the next request's deadline and seq): the next session is
    # its top, and only the session just served changes its key, so the order costs O(n log n), not the O(n^2) of
    # scanning every session for each request (unkeyed requests are each a session of their own).
    heaps = {t: [_session_key(session, line, spent[t][session], by_deadline) for session, line in lines.items()]
             for t, lines in tenants.items()}
    for heap in heaps.values():
        heapq.heapify(heap)
    projected = {t: shares.attained(t, now) / tenants[t][heaps[t][0][-1]][-1].level.weight for t in tenants}
    return tenants, spent, heaps, projected


def _session_key(session: object, line: list[W], spent: float, by_deadline: Callable[[W], tuple[float, int]]
                 ) -> tuple[float, float, int, object]:
    """A tenant's session in its heap: the least spent goes next, then the one whose next request is due first (the
    request's seq is unique, so the session itself is never compared)."""
    return (spent, *by_deadline(line[-1]), session)


def displaced(waiting: Sequence[W], newcomer: W, sheddable: Callable[[ServiceLevel], bool]) -> W | None:
    """The waiter a newcomer to a full queue takes the place of (it is refused 429), or None: the newcomer is
    refused. The bound is shared the way the order is: in turn,
    1. the newest sheddable waiter, when the newcomer is not sheddable;
    2. in the least urgent band less urgent than the newcomer's, the newest waiter of the tenant with the most
       waiters there;
    3. in the newcomer's band, the newest waiter of the tenant with the most waiters there, when it has at least
       two more than the newcomer's tenant (the newcomer counted), so a flood of one tenant cannot fill the queue
       against the others.
    A waiter that had been granted (front) keeps its place."""
    others = [w for w in waiting if w is not newcomer and not w.front]
    if not sheddable(newcomer.level):
        victim = max((w for w in others if sheddable(w.level)), key=lambda w: w.seq, default=None)
        if victim is not None:
            return victim
    less_urgent = [w for w in others if w.level.priority > newcomer.level.priority]
    if less_urgent:
        band = max(w.level.priority for w in less_urgent)
        return _newest_of_largest([w for w in less_urgent if w.level.priority == band])
    band_waiters = [w for w in waiting if w.level.priority == newcomer.level.priority]
    mine = sum(1 for w in band_waiters if w.level.tenant == newcomer.level.tenant)
    victim = _newest_of_largest([w for w in others if w.level.priority == newcomer.level.priority])
    if victim is not None and victim.level.tenant != newcomer.level.tenant:
        theirs = sum(1 for w in band_waiters if w.level.tenant == victim.level.tenant)
        if theirs >= mine + 2:
            return victim
    return None


def _newest_of_largest(waiters: Sequence[W]) -> W | None:
    """The newest waiter of the tenant with the most waiters (ties: the tenant whose newest came last)."""
    by_tenant: dict[str, list[W]] = {}
    for waiter in waiters:
        by_tenant.setdefault(waiter.level.tenant, []).append(waiter)
    if not by_tenant:
        return None
    line = max(by_tenant.values(), key=lambda ws: (len(ws), max(w.seq for w in ws)))
    return max(line, key=lambda w: w.seq)


def displaced_why(waiting: Sequence[W], victim: W) -> str:
    """What made `victim` the one displaced, for its 429."""
    level = victim.level
    same = sum(1 for w in waiting if w.level.tenant == level.tenant and w.level.priority == level.priority)
    return f"{same} waiting requests of tenant {victim.level.tenant!r} at priority {victim.level.priority}"


"""KV admission for the whole app: one FIFO, exact per-replica KV accounting, grants of a replica per request.

Every request asks for `need` logical blocks (dcpserve.engine.core.block_manager.admission_blocks under the app's
policy: prompt + max_tokens for "full", the prompt for "usage"). The queue grants a replica that can hold it now,
preferring the most free KV, and counts the grant against that replica until the caller releases it. Invariants:

- never over-commit: a grant is made only while, for its replica, headroom + granted + external + need <=
  capacity, where a granted ticket counts the larger of its grant and what the replica reports it holds (under
  "usage" a request grows past its grant, and the engine preempts when growth runs out of KV), `external` is what
  the replica reports holding for requests this queue did not grant (direct handle calls, or grants lost when
  this queue restarted), and `headroom` is the growth room the replica's "usage" admission keeps. Replicas report
  what they hold every kv_report_period_s and also refuse what they cannot hold (the authority), so stale
  knowledge here delays requests but never overfills a replica;
- strict FIFO: a request waits while anyone is ahead of it, so the head is never starved by smaller requests
  behind it; a request a replica refused goes back to the head;
- bounded: at most `max_queued` wait; more get QueueFull at once; a wait past its timeout gets QueueTimeout;
- never-fits: a request larger than every replica's whole capacity gets NeverFits at once (400, with numbers);
- grants only go where they can run: to a replica that is healthy and routable (Serve's controller has been
  probing it, so it is RUNNING and the routers know it: not one still starting or already draining), and not to
  one a caller found unreachable until Serve has probed it again. A grant whose replica did not take the request
  comes back through refused() or unreachable() and the request waits at the head again;
- a replica a caller's delta stream found dead (replica_lost: its process or its node died) is forgotten at once,
  capacity and grants, not after replica_ttl_s without reports; if it reports again it comes back, grantable once
  Serve has probed it since.

Which replica: dcpserve/deployments/admission/replica_choice.py (the replica's KV as the queue knows it, balance, the
session's last replica (dcpserve/deployments/admission/session_affinity.py), and prefix-aware routing: the longest
cached run of the prompt's blocks among the replicas with room and in balance), then the TTFT bound
(dcpserve/deployments/admission/ttft_bound.py): a request no replica would start within ttft_bound_s may wait in the
queue (held back, not waiting for KV: it closes no pool to those behind it) until a replica's backlog drains under the
bound, at most the bound and never past its deadline or timeout; then it is granted where it starts soonest.

AdmissionQueue is plain asyncio (tested without Ray); dcpserve/deployments/admission/kv_admission.py serves it as the
one-replica KvAdmission deployment.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from dcpserve.deployments.admission.bound_holds import BoundHolds
from dcpserve.deployments.admission.errors import (
    AdmissionError,
    DeadlineExceeded,
    LimitExceeded,
    NoReplica,
    QueueFull,
    QueueTimeout,
    Shed,
)
from dcpserve.deployments.admission.fair_share import TenantShares, admission_order, displaced, displaced_why
from dcpserve.deployments.admission.latency_window import LatencyWindow, nearest_rank
from dcpserve.deployments.admission.ledger import Grant, ReplicaLedger
from dcpserve.deployments.admission.pools import PoolChoice, choose, pools_of, smallest_blocks
from dcpserve.deployments.admission.replica_choice import ReplicaKv, why_not_grantable
from dcpserve.deployments.admission.session_affinity import SessionHomes, SessionShares, session_of
from dcpserve.deployments.admission.tenant_limits import TenantLimits
from dcpserve.deployments.messages import (
    DECISION_REASONS,
    Acquire,
    AcquireReply,
    AdmissionStats,
    Granted,
    Need,
    PrefixAsk,
    QueueReplicaView,
    ServiceLevel,
    TenantStats,
)


@dataclass(eq=False)
class _Waiter:
    ticket: str
    need: Need
    future: asyncio.Future[str]
    ask: PrefixAsk | None
    level: ServiceLevel
    seq: int  # arrival order
    front: bool  # a replica refused it after a grant: it goes first
    deadline_at: float | None  # when it stops waiting for its deadline (the queue's clock)
    tokens: int  # its KV in tokens (the smallest need over its pools), what the fair order charges it
    arrived: float
    timeout_at: float = math.inf  # when its queue timeout ends its wait (the queue's clock)
    defer_end: float | None = None  # held back by the TTFT bound: the latest it may be held (set at the first time)
    defer_until: float | None = None  # held back until then (the backlog's estimate falls under the bound)


class AdmissionQueue(ReplicaLedger):
    """One app's admission: the bounded queue of waiting requests, in the order of their service levels, granted
    from the replicas' KV as the ledger (ReplicaLedger) counts it."""

    def __init__(
        self,
        max_queued: int,
        *,
        replica_ttl_s: float = 10.0,
        leak_grace_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        on_event: Callable[[str, float | None, ServiceLevel | None], None] | None = None,
        prefix_routing: bool = True,
        on_routed: Callable[[int, int], None] | None = None,
        on_pool: Callable[[str, str], None] | None = None,
        on_limit: Callable[[ServiceLevel, str], None] | None = None,
        sheddable_priority: int | None = None,
        fair_share_half_life_s: float = 60.0,
        fair_share_quantum_s: float = 1.0,
        limits: TenantLimits | None = None,
        order: str = "service_levels",
        fair_share_reserve: bool = True,
        ttft_bound_s: float = 0.0,
        session_ttl_s: float = 600.0,
        on_decision: Callable[[str], None] | None = None,
    ) -> None:
        """on_event(outcome, waited_s, level), when given, hears every decision (dcpserve/deployments/metrics.py
        ADMISSION_OUTCOMES, plus "refused_by_replica"); waited_s is set for requests that waited in the queue, level
        is the request's ServiceLevel (None for grants that came back).
        sheddable_priority: requests with a priority at or above it are sheddable (None: none is);
        fair_share_*: the tenants' shares (dcpserve/deployments/admission/fair_share.py TenantShares); limits: the
        tenants' limits, checked before a request takes a place in the queue. order "fifo": one line in arrival order,
        priorities, tenants, deadline order and shedding ignored (what the queue did before service levels; deadlines
        still end a wait). fair_share_reserve: a tenant over its fair share of the KV leaves the next request of each
        tenant seen in the last half-life and under its share room (TenantShares.reserve_against).
        on_routed(prompt_blocks, hit_blocks) hears every grant of a request that named its prompt blocks.
        prefix_routing: prefer the session's last replica, then the one holding the longest run of the prompt's blocks
        (dcpserve/deployments/admission/replica_choice.py); off: the most free KV alone. ttft_bound_s: the TTFT bound
        (dcpserve/deployments/admission/ttft_bound.py; 0: off). session_ttl_s: a session silent this long loses its
        replica and its share. on_decision(reason) hears every grant's reason and every request held back by the
        bound (messages.DECISION_REASONS)."""
        self.max_queued = max_queued
        self._on_event = on_event
        self._on_routed = on_routed
        self._on_limit = on_limit  # on_limit(level, limit): a request refused by a tenant's limit
        self._on_pool = on_pool  # on_pool(pool, reason): every grant's pool and why (admission/pools.py)
        self.prefix_routing = prefix_routing
        self.replica_ttl_s = replica_ttl_s  # a replica silent this long gets no more grants
        self.leak_grace_s = leak_grace_s  # a grant its replica never saw this long is dropped (caller died)
        self._clock = clock
        self.replicas: dict[str, ReplicaKv] = {}
        self._waiters: deque[_Waiter] = deque()
        self._ticket_replica: dict[str, str] = {}
        self._grants: dict[str, Grant] = {}  # ticket -> its grant, until released or given back
        self.num_prefix_query_blocks = 0  # prompt blocks of granted requests that could have been cached
        self.num_prefix_hit_blocks = 0  # of those, blocks their granted replica reported cached
        self.num_granted = 0
        self.num_lost = 0  # replicas a caller's stream found dead (replica_lost)
        self._lost: dict[str, tuple[int, float]] = {}  # lost replica -> (its probes then, when), until 6 x ttl
        self.num_timeouts = 0
        self.num_rejected_full = 0
        self.num_refusals = 0
        self.num_unreachable = 0
        self.pool_grants: dict[str, int] = {}  # "pool/reason" -> grants (admission/pools.py)
        self.num_leaked = 0  # grants dropped by leak reconciliation (their caller never released them)
        self.latency = LatencyWindow()  # served requests' TTFT / ITL per pool, for service-level autoscaling
        self.sheddable_priority = sheddable_priority
        self.shares = TenantShares(fair_share_half_life_s, fair_share_quantum_s)
        self.limits = limits or TenantLimits({})
        if order not in ("service_levels", "fifo"):
            raise ValueError(f"admission_order must be 'service_levels' or 'fifo', got {order!r}")
        self.order = order
        self.fair_share_reserve = fair_share_reserve
        self.holds = BoundHolds(ttft_bound_s, self._fulfill)  # the TTFT bound's holds on waiters
        self.homes = SessionHomes(session_ttl_s)
        self.session_shares = SessionShares(fair_share_half_life_s, fair_share_quantum_s, session_ttl_s)
        self._on_decision = on_decision
        self.decisions: dict[str, int] = dict.fromkeys(DECISION_REASONS, 0)
        self._seq = 0
        self._waits: dict[str, deque[float]] = {}  # tenant -> how long its last granted requests waited
        self.num_shed = 0
        self.num_deadline = 0

    # ---- requests -------------------------------------------------------------------------------------------

    async def acquire(self, ticket: str, need: Need, timeout_s: float, *, front: bool = False,
                      ask: PrefixAsk | None = None, level: ServiceLevel | None = None) -> str:
        """Returns the replica id that holds `need` blocks for this ticket until release(ticket) (less, with `ask`,
        the blocks of its prefix the replica holds cached for running requests: grant_of(ticket) says how many it
        counts). The request takes its place in the queue's order (dcpserve/deployments/admission/fair_share.py: its
        priority band, its tenant's fair share, its deadline); front=True (a replica refused it) puts it first. It waits
        at most timeout_s, and at most level.deadline_s."""
        level = level or ServiceLevel()
        if smallest_blocks(need) < 1:
            raise ValueError(f"need must be >= 1 block on every pool, got {need}")
        if ticket in self._ticket_replica:
            raise ValueError(f"ticket {ticket!r} already holds a grant")
        now = self._clock()
        try:
            # A request back after a grant (front) passed its tenant's limits then: it is not counted again.
            exceeded = None if front else self.limits.check(level.tenant, level.tokens, self.in_flight(level.tenant),
                                                            now)
            if exceeded is not None:
                raise LimitExceeded(exceeded)
            if self.replicas and not self._healthy_replicas():
                raise NoReplica(f"no healthy engine replica ({len(self.replicas)} known, all failing); retry later")
            self._check_fits_somewhere(need)
            if level.deadline_s is not None and level.deadline_s <= 0:
                raise DeadlineExceeded(f"the request's deadline passed {-level.deadline_s:.3f}s before it reached "
                                       f"the admission queue; send a later deadline")
            saturated = self._saturated_pools()
            if self._sheddable(level) and pools_of(need, self.replicas.values()) <= saturated and saturated:
                raise Shed(self._shed_message(level, 0.0))
        except AdmissionError as err:
            self._event(err.outcome, None, level)
            raise
        if not front:
            self.limits.charge(level.tenant, ticket, level.tokens, now)
        try:
            return await self._wait(ticket, need, timeout_s, front=front, ask=ask, level=level, now=now)
        except AdmissionError:
            if not front:
                self.limits.refund(level.tenant, ticket)
            raise

    async def acquire_reply(self, request: Acquire, retry_after_s: int) -> AcquireReply:
        """acquire() as the typed answer a caller in another process gets: Granted (the replica, the blocks counted
        there, the prefix blocks found there, its pool) or Refusal (the error with its HTTP status; a 429 or 503 says
        Retry-After: retry_after_s, a tenant's token limit its own)."""
        try:
            replica_id = await self.acquire(request.ticket, request.need, request.timeout_s, front=request.front,
                                            ask=request.ask, level=request.level)
        except AdmissionError as err:
            if isinstance(err, LimitExceeded) and self._on_limit is not None:
                self._on_limit(request.level, err.limit)
            return err.refusal(retry_after_s)
        grant = self.grant_of(request.ticket)
        if grant is None:  # released between the grant and this reply: nothing is counted for it any more
            return Granted(replica_id, 0)
        return Granted(replica_id, grant.need, grant.hit_blocks, grant.pool)

    def now(self) -> float:
        """The queue's clock (what its grants, deadlines and latency window are timed with)."""
        return self._clock()

    def _waited(self, level: ServiceLevel, seconds: float) -> None:
        self._waits.setdefault(level.tenant, deque(maxlen=1000)).append(seconds)

    def tenant_stats(self) -> dict[str, TenantStats]:
        """Per tenant: its attained KV token-seconds, the KV it holds, and how long its last (up to 1,000) granted
        requests waited in the queue (p50, p90, max; 0 for those granted at once)."""
        now = self._clock()
        out: dict[str, TenantStats] = {}
        for tenant in sorted(set(self.shares.tenants()) | set(self._waits)):
            waits = sorted(self._waits.get(tenant, ()))
            out[tenant] = TenantStats(
                attained_kv_token_s=round(self.shares.attained(tenant, now), 3),
                holding_kv_tokens=self.shares.holding.get(tenant, 0), granted=len(waits),
                wait_p50_s=nearest_rank(waits, 0.5) if waits else None,
                wait_p90_s=nearest_rank(waits, 0.9) if waits else None,
                wait_max_s=waits[-1] if waits else None)
        return out

    def in_flight(self, tenant: str) -> int:
        """The tenant's sequences waiting in the queue or holding a grant."""
        return (sum(1 for grant in self._grants.values() if grant.level.tenant == tenant)
                + sum(1 for w in self._waiters if not w.future.done() and w.level.tenant == tenant))

    async def _wait(self, ticket: str, need: Need, timeout_s: float, *, front: bool, ask: PrefixAsk | None,
                    level: ServiceLevel, now: float) -> str:
        """acquire's grant, at once or after waiting in the queue's order."""
        self._seq += 1
        self.shares.seen(level, self._need_tokens(need), now)
        waiter = _Waiter(ticket, need, asyncio.get_running_loop().create_future(), ask, level, seq=self._seq,
                         front=front, deadline_at=None if level.deadline_s is None else now + level.deadline_s,
                         tokens=self._need_tokens(need), arrived=now, timeout_at=now + timeout_s)
        self._waiters.append(waiter)
        self._fulfill()
        if waiter.future.done():  # granted at once
            self._event("admitted", None, level)
            self._waited(level, 0.0)
            return waiter.future.result()
        waiting = [w for w in self._waiters if not w.future.done()]
        if len(waiting) > self.max_queued and not front:
            full = (f"the admission queue is full ({len(waiting) - 1} requests wait for KV, max_queued_requests="
                    f"{self.max_queued})")
            victim = None if self.order == "fifo" else displaced(waiting, waiter, self._sheddable)
            if victim is None:
                self._waiters.remove(waiter)
                waiter.future.cancel()
                self.num_rejected_full += 1
                self._event("rejected_queue_full", None, level)
                raise QueueFull(f"{full}; retry later")
            if self._sheddable(victim.level):
                self._shed(victim, f"{full} and a request that is not sheddable arrived")
            else:
                self._waiters.remove(victim)
                self.num_rejected_full += 1
                victim.future.set_exception(QueueFull(
                    f"{full} and a request of priority {level.priority} from tenant {level.tenant!r} took this "
                    f"one's place (the newest of {displaced_why(waiting, victim)}); retry later"))
        self._event("queued", None, level)
        wait_s = timeout_s if level.deadline_s is None else min(timeout_s, level.deadline_s)
        try:
            replica_id = await asyncio.wait_for(asyncio.shield(waiter.future), timeout=wait_s)
            self._event("admitted", self._clock() - now, level)
            self._waited(level, self._clock() - now)
            return replica_id
        except TimeoutError:
            if waiter.future.done() and not waiter.future.cancelled():
                self._event("admitted", self._clock() - now, level)
                return waiter.future.result()  # granted at the last moment
            waited = self._clock() - now
            if not any(r.grantable for r in self.replicas.values()):
                self.num_timeouts += 1
                self._event("rejected_no_replica", waited, level)
                known = ", ".join(f"{r.replica_id}: {why_not_grantable(r)}" for r in self.replicas.values())
                raise NoReplica(
                    f"no engine replica could take requests during the {waited:.1f}s this request waited"
                    f"{f' ({known})' if known else ''}; retry later"
                ) from None
            if level.deadline_s is not None and level.deadline_s < timeout_s:
                self.num_deadline += 1
                self._event("rejected_deadline", waited, level)
                raise DeadlineExceeded(
                    f"the request's deadline came after {waited:.1f}s in the admission queue and no replica had "
                    f"{smallest_blocks(need)} free KV blocks for it; it was not started late; retry later"
                ) from None
            self.num_timeouts += 1
            self._event("rejected_timeout", waited, level)
            raise QueueTimeout(
                f"waited {waited:.1f}s in the admission queue and no replica had {smallest_blocks(need)} free KV "
                f"blocks (queue_timeout_s); retry later"
            ) from None
        except (Shed, QueueFull) as err:  # refused while it waited: shed, or its place in the full queue taken
            self._event(err.outcome, self._clock() - now, level)
            raise
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                self.release(ticket)  # granted while the caller went away
            raise
        finally:
            if not waiter.future.done():
                waiter.future.cancel()  # _fulfill skips it
            try:
                self._waiters.remove(waiter)
            except ValueError:
                pass
            self._fulfill()

    def release(self, ticket: str, ttft_s: float | None = None, itl_s: float | None = None) -> None:
        """Ends a grant (request finished, failed or was cancelled). Unknown tickets are ignored: idempotent. A
        request that produced tokens hands in its TTFT and mean ITL: the window the service-level autoscaling
        policy reads (dcpserve/deployments/admission/latency_window.py), under the pool of the replica that served
        it."""
        for waiter in self._waiters:
            if waiter.ticket == ticket and not waiter.future.done():
                waiter.future.cancel()
        grant = self._grants.get(ticket)
        if grant is not None:
            self.latency.add(self._clock(), grant.pool, ttft_s, itl_s)
        granted_on = self._drop_grant(ticket, finished=True)
        for replica in self.replicas.values():
            if replica is granted_on or ticket in replica.held:
                replica.released.add(ticket)
        self._fulfill()

    @property
    def num_queued(self) -> int:
        return len(self._waiters)

    def num_queued_for(self, pool: str) -> int:
        """Waiting requests that pool could hold: what its replicas pass on to its autoscaling policy."""
        replicas = self.replicas.values()
        if all(replica.pool == pool for replica in replicas):
            # One pool: every waiter is its own (acquire refused those no replica could ever hold), counted without
            # each waiter's need against every replica at each report.
            return sum(1 for w in self._waiters if not w.future.done())
        return sum(1 for w in self._waiters if not w.future.done() and pool in pools_of(w.need, replicas))

    def queued_by_level(self) -> dict[tuple[str, int], int]:
        """Waiting requests by (tenant, priority)."""
        counts: dict[tuple[str, int], int] = {}
        for waiter in self._waiters:
            if not waiter.future.done():
                key = (waiter.level.tenant, waiter.level.priority)
                counts[key] = counts.get(key, 0) + 1
        return counts

    @property
    def queued_blocks(self) -> int:
        return sum(smallest_blocks(w.need) for w in self._waiters)

    def stats(self) -> AdmissionStats:
        return AdmissionStats(
            num_queued=self.num_queued, queued_blocks=self.queued_blocks, num_granted=self.num_granted,
            num_timeouts=self.num_timeouts, num_rejected_full=self.num_rejected_full, num_refusals=self.num_refusals,
            num_unreachable=self.num_unreachable, num_lost=self.num_lost, num_leaked=self.num_leaked,
            num_shed=self.num_shed, num_deadline=self.num_deadline,
            prefix_query_blocks=self.num_prefix_query_blocks, prefix_hit_blocks=self.num_prefix_hit_blocks,
            pool_grants=dict(self.pool_grants), tenants=self.tenant_stats(), decisions=dict(self.decisions),
            num_sessions=len(self.homes),
            replicas={r.replica_id: QueueReplicaView(
                pool=r.pool, capacity=r.capacity, granted=r.granted, external=r.external, free=r.free,
                healthy=r.healthy, grantable=r.grantable, num_grants=len(r.grants), num_granted=r.num_granted,
                cached_prefix_blocks=len(r.prefix.index.blocks), prefill_ahead_blocks=r.prefill_ahead)
                for r in self.replicas.values()},
        )

    # ---- internals ------------------------------------------------------------------------------------------

    def _waiting_needs(self) -> list[Need]:
        return [w.need for w in self._waiters if not w.future.done()]

    def _grant(self, ticket: str, choice: PoolChoice, level: ServiceLevel) -> str:
        replica, need, hit_blocks, ask = choice.replica, choice.need, choice.hit_blocks, choice.ask
        now = self._clock()
        replica.grants[ticket] = (need, now)
        tokens = need * replica.tokens_per_block
        self.shares.grant(level.tenant, tokens, now)
        self.session_shares.grant(session_of(level), tokens, now)
        self.homes.record(session_of(level), replica.replica_id, now)
        replica.grant_prefill[ticket] = choice.prefill_blocks
        replica.prefix.add(ticket, ask)
        self._ticket_replica[ticket] = replica.replica_id
        self._grants[ticket] = Grant(replica.replica_id, need, hit_blocks, pool=replica.pool, level=level,
                                     tokens=tokens, decision=choice.decision)
        self._decided(choice.decision)
        self.num_granted += 1
        replica.num_granted += 1
        key = f"{choice.pool}/{choice.reason}"
        self.pool_grants[key] = self.pool_grants.get(key, 0) + 1
        if self._on_pool is not None:
            self._on_pool(choice.pool, choice.reason)
        if ask is not None and ask.hashes:
            self.num_prefix_query_blocks += len(ask.hashes)
            self.num_prefix_hit_blocks += hit_blocks
            if self._on_routed is not None:
                self._on_routed(len(ask.hashes), hit_blocks)
        return replica.replica_id

    def _decided(self, reason: str) -> None:
        self.decisions[reason] = self.decisions.get(reason, 0) + 1
        if self._on_decision is not None:
            self._on_decision(reason)

    def _need_tokens(self, need: Need) -> int:
        """The request's KV in tokens: its smallest need over the pools (blocks x the pool's tokens per block)."""
        per_block = {r.pool: r.tokens_per_block for r in self.replicas.values()}
        if isinstance(need, int):
            return need * max(per_block.values(), default=1)
        return min(n.blocks * per_block.get(pool, 1) for pool, n in need.items())

    def _keeps_reserve(self, waiter: _Waiter, choice: PoolChoice, usable: set[str]) -> bool:
        """Whether granting `choice` would leave less free KV (in the pools the waiter could use) than its tenant
        must leave for the tenants below their fair share (TenantShares.reserve_against)."""
        replicas = [r for r in self.replicas.values() if r.pool in usable and r.healthy]
        grant_tokens = choice.need * choice.replica.tokens_per_block
        holding_after = self.shares.holding.get(waiter.level.tenant, 0) + grant_tokens
        capacity = sum(r.capacity * r.tokens_per_block for r in replicas)
        keep = self.shares.reserve_against(waiter.level.tenant, holding_after, capacity, self._clock())
        if keep <= 0:
            return False
        free = sum(max(r.free, 0) * r.tokens_per_block for r in replicas if r.grantable)
        return free - grant_tokens < keep

    def _sheddable(self, level: ServiceLevel) -> bool:
        return (self.order != "fifo" and self.sheddable_priority is not None
                and level.priority >= self.sheddable_priority)

    def _saturated_pools(self) -> set[str]:
        """The pools a waiting request that is not sheddable could use: there, sheddable requests are refused."""
        if self.sheddable_priority is None or self.order == "fifo":
            return set()
        saturated: set[str] = set()
        for waiter in self._waiters:
            if not waiter.future.done() and not self._sheddable(waiter.level):
                saturated |= pools_of(waiter.need, self.replicas.values())
        return saturated

    def _newest_sheddable(self, pools: set[str]) -> _Waiter | None:
        """The sheddable waiter that arrived last among those that could use `pools`."""
        candidates = [w for w in self._waiters if not w.future.done() and self._sheddable(w.level)
                      and pools_of(w.need, self.replicas.values()) & pools]
        return max(candidates, key=lambda w: w.seq, default=None)

    def _shed_message(self, level: ServiceLevel, waited_s: float) -> str:
        waiting = sum(1 for w in self._waiters if not w.future.done() and not self._sheddable(w.level))
        return (f"shed after {waited_s:.1f}s: priority {level.priority} is sheddable (sheddable_priority="
                f"{self.sheddable_priority}) and the app is saturated ({waiting} requests that are not sheddable wait "
                f"for KV); retry later or send a lower priority")

    def _shed(self, waiter: _Waiter, why: str) -> None:
        self.num_shed += 1
        message = self._shed_message(waiter.level, self._clock() - waiter.arrived)
        waiter.future.set_exception(Shed(f"{message}; {why}"))
        self._waiters.remove(waiter)

    def _fulfill(self) -> None:
        """Grants waiters in the queue's order (dcpserve/deployments/admission/fair_share.py admission_order); a waiter
        that finds no room closes the pools it could use to the waiters after it (one pool: the head blocks everyone, so
        a large request is never starved by smaller ones behind it). Then, under saturation (a request that is not
        sheddable still waits), the sheddable waiters that could use its pools are refused, newest first."""
        closed: set[str] = set()
        pools = {replica.pool for replica in self.replicas.values()}
        for waiter in [w for w in self._waiters if w.future.done()]:
            self._waiters.remove(waiter)
        if self.order == "fifo":
            order = sorted(self._waiters, key=lambda w: (not w.front, w.seq))
        else:
            order = admission_order(self._waiters, self.shares, self._clock(), self.session_shares)
        now = self._clock()
        for waiter in order:
            usable = pools_of(waiter.need, self.replicas.values())
            open_pools = usable - closed
            choice = choose(self.replicas.values(), waiter.need, waiter.ask, self.prefix_routing, open_pools,
                            home=self.homes.home(session_of(waiter.level), now), ttft_bound_s=self.holds.bound_s,
                            may_wait_s=self.holds.may_wait(waiter, now), now=now) if open_pools else None
            if choice is None:
                closed |= usable
                if closed >= pools:
                    break
                continue
            if choice.wait_s > 0:  # held back by the TTFT bound, not by KV: the waiters after it may go
                if self.holds.hold(waiter, choice.wait_s, now):
                    self._decided("backlog_deferred")
                continue
            if self.fair_share_reserve and self.order != "fifo" and self._keeps_reserve(waiter, choice, usable):
                continue  # over its share, and the room left is another tenant's next request: it waits
            self._waiters.remove(waiter)
            waiter.future.set_result(self._grant(waiter.ticket, choice, waiter.level))
        saturated = self._saturated_pools()
        while saturated:
            victim = self._newest_sheddable(saturated)
            if victim is None:
                break
            self._shed(victim, "a request that is not sheddable waits for KV it could use")
        self.holds.schedule((w for w in self._waiters if not w.future.done()), now)

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
bound, at most the bound and never past its deadline or timeout; then it is granted where it starts soonest. A held
request is parked out of the queue's walk until its hold ends or a replica could start it within the bound
(bound_holds.py), so each event costs the walk the requests it can grant, not every request held. A request whose
prompt a replica without room caches more of is held the same way for that replica (the prefix hold, replica_choice.py)
while that would still start it sooner than where it would go now, and wakes as soon as the replica has room for it.

AdmissionQueue is plain asyncio (tested without Ray); dcpserve/deployments/admission/kv_admission.py serves it as the
one-replica KvAdmission deployment.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Iterable

from dcpserve.deployments.admission.bound_holds import DEFER_MARGIN_S, BoundHolds
from dcpserve.deployments.admission.errors import (
    AdmissionError,
    DeadlineExceeded,
    LimitExceeded,
    NoReplica,
    QueueFull,
    QueueTimeout,
    Shed,
)
from dcpserve.deployments.admission.fair_share import TenantShares, iter_admission_order
from dcpserve.deployments.admission.latency_window import LatencyWindow
from dcpserve.deployments.admission.ledger import Grant, ReplicaLedger
from dcpserve.deployments.admission.pools import PoolChoice, choose, need_on, pools_of, smallest_blocks
from dcpserve.deployments.admission.queue_views import QueueViews
from dcpserve.deployments.admission.replica_choice import ReplicaKv, drained_at, option_starts, why_not_grantable
from dcpserve.deployments.admission.session_affinity import SessionHomes, SessionShares, session_of
from dcpserve.deployments.admission.tenant_limits import TenantLimits
from dcpserve.deployments.admission.ttft_bound import BOUND_TOLERANCE_S
from dcpserve.deployments.admission.waiter import Waiter
from dcpserve.deployments.messages import (
    DECISION_REASONS,
    Acquire,
    AcquireReply,
    Granted,
    Need,
    PrefixAsk,
    ServiceLevel,
)


class AdmissionQueue(QueueViews, ReplicaLedger):
    """One app's admission: the bounded queue of waiting requests, in the order of their service levels, granted
    from the replicas' KV as the ledger (ReplicaLedger) counts it; its counts and stats are QueueViews', its
    refusals of waiting requests Shedding's (dcpserve/deployments/admission/shedding.py)."""

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
        prefix_hold: bool = True,
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
        bound or a prefix hold (messages.DECISION_REASONS). prefix_hold: a request may wait for the replica that caches
        more of its prompt to have room, for as long as that would still start it sooner than where it would go now
        (dcpserve/deployments/admission/replica_choice.py, "The prefix hold"; needs prefix_routing)."""
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
        self._waiters: deque[Waiter] = deque()  # those the walk looks at (the held ones: self.holds)
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
        self.holds: BoundHolds[Waiter] = BoundHolds(ttft_bound_s, self._fulfill)  # the TTFT bound's and prefix holds
        self.prefix_hold = prefix_hold
        self._replica_set: tuple[tuple[str, bool], ...] = ()  # the grantable replicas the holds watch
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
            exceeded = None if front else self.limits.check(
                level.tenant, level.tokens, lambda: self.in_flight(level.tenant), now)
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

    async def _wait(self, ticket: str, need: Need, timeout_s: float, *, front: bool, ask: PrefixAsk | None,
                    level: ServiceLevel, now: float) -> str:
        """acquire's grant, at once or after waiting in the queue's order."""
        self._seq += 1
        self.shares.seen(level, self._need_tokens(need), now)
        waiter = Waiter(ticket, need, asyncio.get_running_loop().create_future(), ask, level, seq=self._seq,
                         front=front, deadline_at=None if level.deadline_s is None else now + level.deadline_s,
                         tokens=self._need_tokens(need), arrived=now, timeout_at=now + timeout_s)
        self._waiters.append(waiter)
        self._fulfill()
        if waiter.future.done():  # granted at once
            self._event("admitted", None, level)
            self._waited(level, 0.0)
            return waiter.future.result()
        if self.num_queued > self.max_queued and not front:
            self._admit_to_full_queue(waiter, level)  # raises QueueFull when the newcomer is the one refused
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
            self._remove(waiter)
            self._fulfill()

    def release(self, ticket: str, ttft_s: float | None = None, itl_s: float | None = None) -> None:
        """Ends a grant (request finished, failed or was cancelled). Unknown tickets are ignored: idempotent. A
        request that produced tokens hands in its TTFT and mean ITL: the window the service-level autoscaling
        policy reads (dcpserve/deployments/admission/latency_window.py), under the pool of the replica that served
        it."""
        for waiter in self._waiting():
            if waiter.ticket == ticket:
                waiter.future.cancel()
        grant = self._grants.get(ticket)
        if grant is not None:
            self.latency.add(self._clock(), grant.pool, ttft_s, itl_s)
        granted_on = self._drop_grant(ticket, finished=True)
        for replica in self.replicas.values():
            if replica is granted_on or ticket in replica.held:
                replica.mark_released(ticket)
        self._fulfill()

    def _grant(self, ticket: str, choice: PoolChoice, level: ServiceLevel) -> str:
        replica, need, hit_blocks, ask = choice.replica, choice.need, choice.hit_blocks, choice.ask
        now = self._clock()
        replica.add_grant(ticket, need, now, choice.prefill_blocks)
        tokens = need * replica.tokens_per_block
        self.shares.grant(level.tenant, tokens, now)
        self.session_shares.grant(session_of(level), tokens, now)
        self.homes.record(session_of(level), replica.replica_id, now)
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

    def _keeps_reserve(self, waiter: Waiter, choice: PoolChoice, usable: set[str]) -> bool:
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

    def _fulfill(self) -> None:
        """Grants waiters in the queue's order (dcpserve/deployments/admission/fair_share.py admission_order); a waiter
        that finds no room closes the pools it could use to the waiters after it (one pool: the head blocks everyone, so
        a large request is never starved by smaller ones behind it). A waiter the TTFT bound holds is parked
        (bound_holds.py): the walk leaves it out, taking it back when its hold ends or a replica it watches could start
        it within the bound. Then, under saturation (a request that is not sheddable still waits), the sheddable
        waiters that could use its pools are refused, newest first."""
        now = self._clock()
        if self.holds.bound_s > 0 or self.prefix_hold:
            replica_set = tuple((r.replica_id, r.grantable) for r in self.replicas.values())
            if len(self.holds):
                # The replicas changed: what each held waiter watches no longer says when it may go.
                self._waiters.extend(self.holds.wake_all() if replica_set != self._replica_set
                                     else self.holds.wake(now, self._drained(), self._free_of))
            self._replica_set = replica_set
        if any(w.future.done() for w in self._waiters):
            self._waiters = deque(w for w in self._waiters if not w.future.done())
        closed: set[str] = set()
        pools = {replica.pool for replica in self.replicas.values()}
        order: Iterable[Waiter]
        if self.order == "fifo":
            order = sorted(self._waiters, key=lambda w: (not w.front, w.seq))
        else:
            order = iter_admission_order(self._waiters, self.shares, now, self.session_shares)
        gone: set[int] = set()  # granted or parked in this walk
        for waiter in order:
            usable = pools_of(waiter.need, self.replicas.values())
            open_pools = usable - closed
            choice = choose(self.replicas.values(), waiter.need, waiter.ask, self.prefix_routing, open_pools,
                            home=self.homes.home(session_of(waiter.level), now), ttft_bound_s=self.holds.bound_s,
                            may_wait_s=self.holds.may_wait(waiter, now), now=now,
                            prefix_hold=self._prefix_hold(waiter, now), holding=usable) if open_pools else None
            if choice is None:
                closed |= usable
                if closed >= pools:
                    break
                continue
            if choice.hold_for is not None:  # held for the replica caching its prompt: the waiters after it may go
                if waiter.prefix_held_at is None:
                    waiter.prefix_held_at = now
                    self._decided("prefix_deferred")
                waiter.defer_until = now + choice.wait_s
                self.holds.park(waiter, (), room=choice.hold_for, held_at=waiter.prefix_held_at)
                gone.add(id(waiter))
                continue
            if choice.wait_s > 0:  # held back by the TTFT bound, not by KV: the waiters after it may go
                if self.holds.hold(waiter, choice.wait_s, now):
                    self._decided("backlog_deferred")
                self.holds.park(waiter, self._own_prefill(waiter, usable, now))
                gone.add(id(waiter))
                continue
            if self.fair_share_reserve and self.order != "fifo" and self._keeps_reserve(waiter, choice, usable):
                continue  # over its share, and the room left is another tenant's next request: it waits
            gone.add(id(waiter))
            waiter.future.set_result(self._grant(waiter.ticket, choice, waiter.level))
        if gone:
            self._waiters = deque(w for w in self._waiters if id(w) not in gone)
        self._shed_under_saturation()
        if len(self.holds):
            self.holds.schedule(now, self._drained())

    def _prefix_hold(self, waiter: Waiter, now: float) -> tuple[float, float] | None:
        """pick_replica's prefix_hold for the waiter: how long it has been held for a prefix, and how much longer it
        may wait at all (let go DEFER_MARGIN_S before its deadline or queue timeout); None: prefix holds are off."""
        if not self.prefix_hold:
            return None
        end = min(waiter.timeout_at, math.inf if waiter.deadline_at is None else waiter.deadline_at) - DEFER_MARGIN_S
        held_at = waiter.prefix_held_at
        return (0.0 if held_at is None else now - held_at, max(end - now, 0.0))

    def _free_of(self, replica_id: str) -> int | None:
        """A grantable replica's free blocks (what a prefix hold waits for); None for any other."""
        replica = self.replicas.get(replica_id)
        return replica.free if replica is not None and replica.grantable else None

    def _drained(self) -> dict[str, float | None]:
        """Each grantable replica's replica_choice.drained_at: what the held waiters watch."""
        return {r.replica_id: drained_at(r) for r in self.replicas.values() if r.grantable}

    def _own_prefill(self, waiter: Waiter, usable: set[str], now: float) -> list[tuple[str, float]]:
        """The held waiter's own prefill on each replica of its pools it could be granted to now and that would not
        start it within the bound now (the replicas its hold watches). One within it now was passed over for
        another reason (its pool closed by a waiter ahead): watching it would wake the waiter at once, again and
        again; it is looked at when the hold ends."""
        own: list[tuple[str, float]] = []
        for pool in usable:
            pool_need = need_on(waiter.need, waiter.ask, pool)
            if pool_need is not None:
                members = [r for r in self.replicas.values() if r.pool == pool]
                own += [(r.replica_id, start.own_s)
                        for r, start in option_starts(members, pool_need.blocks, pool_need.ask, now)
                        if start.start_s > self.holds.bound_s + BOUND_TOLERANCE_S]
        return own

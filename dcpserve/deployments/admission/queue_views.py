"""What the admission queue (dcpserve/deployments/admission/queue.py) tells about itself: how many wait, by pool and by
service level, each tenant's share, in-flight count and waits, and `stats()`, the typed answer of the ingress' /health
and the benchmarks (messages.AdmissionStats). Requests the TTFT bound holds (bound_holds.py) count as waiting.

`QueueViews` is a base of AdmissionQueue: it only reads the queue's state.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from dcpserve.deployments.admission.fair_share import TenantShares
from dcpserve.deployments.admission.latency_window import nearest_rank
from dcpserve.deployments.admission.ledger import Grant
from dcpserve.deployments.admission.pools import pools_of, smallest_blocks
from dcpserve.deployments.admission.session_affinity import SessionHomes
from dcpserve.deployments.admission.shedding import Shedding
from dcpserve.deployments.messages import AdmissionStats, Need, QueueReplicaView, ServiceLevel, TenantStats


class QueueViews(Shedding):
    """The queue's counts and stats, read from its waiters, grants and replicas."""

    # Set by the queue's constructor.
    shares: TenantShares
    homes: SessionHomes
    decisions: dict[str, int]
    pool_grants: dict[str, int]
    num_granted: int
    num_timeouts: int
    num_refusals: int
    num_unreachable: int
    num_lost: int
    num_leaked: int
    num_deadline: int
    num_prefix_query_blocks: int
    num_prefix_hit_blocks: int
    _grants: dict[str, Grant]
    _waits: dict[str, deque[float]]  # tenant -> how long its last granted requests waited
    _clock: Callable[[], float]

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
                + sum(1 for w in self._waiting() if w.level.tenant == tenant))

    @property
    def num_queued(self) -> int:
        return len(self._waiters) + len(self.holds)

    def num_queued_for(self, pool: str) -> int:
        """Waiting requests that pool could hold: what its replicas pass on to its autoscaling policy."""
        replicas = self.replicas.values()
        if all(replica.pool == pool for replica in replicas):
            # One pool: every waiter is its own (acquire refused those no replica could ever hold), counted without
            # each waiter's need against every replica at each report.
            return sum(1 for _ in self._waiting())
        return sum(1 for w in self._waiting() if pool in pools_of(w.need, replicas))

    def queued_by_level(self) -> dict[tuple[str, int], int]:
        """Waiting requests by (tenant, priority)."""
        counts: dict[tuple[str, int], int] = {}
        for waiter in self._waiting():
            key = (waiter.level.tenant, waiter.level.priority)
            counts[key] = counts.get(key, 0) + 1
        return counts

    @property
    def queued_blocks(self) -> int:
        return sum(smallest_blocks(w.need) for w in (*self._waiters, *self.holds.parked()))

    def _waiting_needs(self) -> list[Need]:
        return [w.need for w in self._waiting()]

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

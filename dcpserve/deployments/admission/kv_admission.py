"""KvAdmission: the app's admission queue (dcpserve/deployments/admission/queue.py AdmissionQueue) as a one-replica
Serve deployment. The ingress replicas acquire and release grants through it, the engine replicas report their KV to it
and learn the queue's length (and, for service-level autoscaling, their pool's latencies and KV load) back.
"""

from __future__ import annotations

import asyncio

from ray import serve

from dcpserve.deployments.admission.queue import AdmissionQueue
from dcpserve.deployments.admission.tenant_limits import Limits, TenantLimits
from dcpserve.deployments.messages import (
    Acquire,
    AcquireReply,
    AdmissionStats,
    KvReport,
    KvReportReply,
)
from dcpserve.deployments.metrics import AdmissionMetrics


@serve.deployment(max_ongoing_requests=100_000, num_replicas=1, ray_actor_options={"num_cpus": 0})
class KvAdmission:
    """The app's admission queue as a one-replica deployment: the ingress acquires and releases, engine replicas
    report their KV. Every call takes and answers the typed messages of dcpserve/deployments/messages.py; a refusal
    travels as a value (Refusal, with its HTTP status), not an exception.

    Every method is async: Ray Serve runs a deployment's sync methods in a thread pool
    (RAY_SERVE_RUN_SYNC_IN_THREADPOOL, on by default), which raced them against acquire on the replica's event loop
    over the queue's state and set its waiters' futures from other threads ("deque mutated during iteration" under
    load). Async methods all run on the one loop, one at a time between awaits, as AdmissionQueue assumes."""

    def __init__(self, max_queued: int, *, replica_ttl_s: float = 10.0, prefix_routing: bool = True,
                 leak_grace_s: float = 30.0, sheddable_priority: int | None = None,
                 fair_share_half_life_s: float = 60.0, fair_share_quantum_s: float = 1.0,
                 fair_share_reserve: bool = True, limits: dict[str, Limits] | None = None,
                 order: str = "service_levels", retry_after_s: int = 1, ttft_bound_s: float = 0.0,
                 session_ttl_s: float = 600.0, prefix_hold: bool = True) -> None:
        self.retry_after_s = retry_after_s  # the Retry-After of a refusal a retry may pass (the app's retry_after_s)
        self.metrics = AdmissionMetrics({tenant: (limit.max_concurrent_requests, limit.tokens_per_minute)
                                         for tenant, limit in (limits or {}).items()})
        self.queue = AdmissionQueue(max_queued=max_queued, replica_ttl_s=replica_ttl_s, leak_grace_s=leak_grace_s,
                                    on_event=self.metrics.on_event, prefix_routing=prefix_routing,
                                    on_routed=self.metrics.on_routed, on_pool=self.metrics.on_pool,
                                    on_limit=self.metrics.on_limit,
                                    sheddable_priority=sheddable_priority,
                                    fair_share_half_life_s=fair_share_half_life_s,
                                    fair_share_quantum_s=fair_share_quantum_s,
                                    fair_share_reserve=fair_share_reserve, limits=TenantLimits(limits or {}),
                                    order=order, ttft_bound_s=ttft_bound_s, session_ttl_s=session_ttl_s,
                                    prefix_hold=prefix_hold,
                                    on_decision=self.metrics.on_decision)
        self._expiry = asyncio.get_event_loop().create_task(self._expire_loop())

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.queue.expire()
            self.metrics.update(self.queue.num_queued, self.queue.queued_blocks, self.queue.queued_by_level())
            self.metrics.sessions.set(len(self.queue.homes))

    async def acquire(self, request: Acquire) -> AcquireReply:
        """Granted (the replica, the blocks counted there, the prefix blocks found there, its pool) or Refusal (the
        reason with its HTTP status and Retry-After)."""
        try:
            return await self.queue.acquire_reply(request, self.retry_after_s)
        finally:
            self.metrics.update(self.queue.num_queued, self.queue.queued_blocks, self.queue.queued_by_level())

    async def release(self, ticket: str, ttft_s: float | None = None, itl_s: float | None = None) -> None:
        self.queue.release(ticket, ttft_s, itl_s)

    async def refused(self, ticket: str, replica_id: str, free_blocks: int) -> None:
        self.queue.refused(ticket, replica_id, free_blocks)

    async def unreachable(self, ticket: str, replica_id: str) -> None:
        self.queue.unreachable(ticket, replica_id)

    async def replica_lost(self, replica_id: str) -> None:
        self.queue.replica_lost(replica_id)

    async def report(self, report: KvReport) -> KvReportReply:
        """Returns the queue length, which replicas pass on to the autoscaler, and where the queue's copy of the
        replica's prefix cache stands (the replica's next report starts from there). With slo_window_s > 0 also
        the pool's served latencies at slo_percentile over that window and its KV load, for the service-level
        autoscaling policy."""
        self.queue.report(report)
        epoch, version = self.queue.prefix_position(report.replica_id)
        slo = (self.queue.slo_report(report.pool, report.slo_percentile, report.slo_window_s)
               if report.slo_window_s > 0 else None)
        return KvReportReply(self.queue.num_queued_for(report.pool), self.queue.queued_blocks, epoch, version, slo)

    async def remove_replica(self, replica_id: str) -> None:
        self.queue.remove_replica(replica_id)

    async def stats(self) -> AdmissionStats:
        return self.queue.stats()

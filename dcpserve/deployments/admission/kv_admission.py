"""KvAdmission: the app's admission queue (dcpserve/deployments/admission/queue.py AdmissionQueue) as a one-replica
Serve deployment. The ingress replicas acquire and release grants through it, the engine replicas report their KV to it
and learn the queue's length (and, for service-level autoscaling, their pool's latencies and KV load) back.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ray import serve

from dcpserve.deployments.admission.fair_share import ServiceLevel
from dcpserve.deployments.admission.pools import DEFAULT_POOL, Need
from dcpserve.deployments.admission.prefix_routing import PrefixAsk
from dcpserve.deployments.admission.queue import AdmissionError, AdmissionQueue, LimitExceeded
from dcpserve.deployments.admission.tenant_limits import Limits, TenantLimits
from dcpserve.deployments.metrics import AdmissionMetrics
from dcpserve.engine.core.prefix_cache import PrefixReport


@serve.deployment(max_ongoing_requests=100_000, num_replicas=1, ray_actor_options={"num_cpus": 0})
class KvAdmission:
    """The app's admission queue as a one-replica deployment: the ingress acquires and releases, engine replicas
    report their KV. Errors travel as values (a dict with `error`), not exceptions, so the ingress can map them.

    Every method is async: Ray Serve runs a deployment's sync methods in a thread pool
    (RAY_SERVE_RUN_SYNC_IN_THREADPOOL, on by default), which raced them against acquire on the replica's event loop
    over the queue's state and set its waiters' futures from other threads ("deque mutated during iteration" under
    load). Async methods all run on the one loop, one at a time between awaits, as AdmissionQueue assumes."""

    def __init__(self, max_queued: int, replica_ttl_s: float = 10.0, prefix_routing: bool = True,
                 leak_grace_s: float = 30.0, sheddable_priority: int | None = None,
                 fair_share_half_life_s: float = 60.0, fair_share_quantum_s: float = 1.0,
                 fair_share_reserve: bool = True, limits: dict[str, Limits] | None = None,
                 order: str = "service_levels") -> None:
        self.metrics = AdmissionMetrics({tenant: (limit.max_concurrent_requests, limit.tokens_per_minute)
                                         for tenant, limit in (limits or {}).items()})
        self.queue = AdmissionQueue(max_queued=max_queued, replica_ttl_s=replica_ttl_s, leak_grace_s=leak_grace_s,
                                    on_event=self.metrics.on_event, prefix_routing=prefix_routing,
                                    on_routed=self.metrics.on_routed, on_pool=self.metrics.on_pool,
                                    sheddable_priority=sheddable_priority,
                                    fair_share_half_life_s=fair_share_half_life_s,
                                    fair_share_quantum_s=fair_share_quantum_s,
                                    fair_share_reserve=fair_share_reserve, limits=TenantLimits(limits or {}),
                                    order=order)
        self._expiry = asyncio.get_event_loop().create_task(self._expire_loop())

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.queue.expire()
            self.metrics.update(self.queue.num_queued, self.queue.queued_blocks, self.queue.queued_by_level())

    async def acquire(self, ticket: str, need: Need, timeout_s: float, front: bool = False,
                      ask: PrefixAsk | None = None, level: ServiceLevel | None = None) -> dict[str, Any]:
        """{"replica_id", "need" (the blocks counted there), "hit_blocks"} or {"error", "message"}."""
        try:
            replica_id = await self.queue.acquire(ticket, need, timeout_s, front, ask, level)
            grant = self.queue.grant_of(ticket)
            return {"replica_id": replica_id, "need": grant.need if grant else need,
                    "hit_blocks": grant.hit_blocks if grant else 0, "pool": grant.pool if grant else DEFAULT_POOL}
        except LimitExceeded as err:
            self.metrics.on_limit(level or ServiceLevel(), err.limit)
            return {"error": err.kind, "message": err.message, "retry_after_s": err.retry_after_s}
        except AdmissionError as err:
            return {"error": err.kind, "message": err.message}
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

    async def report(self, replica_id: str, capacity: int, tokens_per_block: int, held: dict[str, int],
               healthy: bool = True, routable: bool = True, probes: int = 0, headroom: int = 0,
               prefix: PrefixReport | None = None, pool: str = DEFAULT_POOL, step_s: float = 0.0, gpus: int = 1,
               max_seqs: int = 0, prefill_tokens: int = 0, step_tokens: int = 0,
               slo_window_s: float = 0.0, slo_percentile: float = 0.9) -> dict[str, Any]:
        """Returns the queue length, which replicas pass on to the autoscaler, and where the queue's copy of the
        replica's prefix cache stands (the replica's next report starts from there). With slo_window_s > 0 also
        the pool's served latencies at slo_percentile over that window and its KV load (pool_load), for the
        service-level autoscaling policy."""
        self.queue.report(replica_id, capacity, tokens_per_block, held, healthy, routable, probes, headroom, prefix,
                          pool, step_s, gpus, max_seqs, prefill_tokens, step_tokens)
        epoch, version = self.queue.prefix_position(replica_id)
        reply: dict[str, Any] = {"num_queued": self.queue.num_queued_for(pool),
                                 "queued_blocks": self.queue.queued_blocks,
                                 "prefix_epoch": epoch, "prefix_version": version}
        if slo_window_s > 0:
            latency = self.queue.latency.percentile(self.queue.now(), pool, slo_percentile, slo_window_s)
            load, pool_capacity, pool_replicas = self.queue.pool_load(pool)
            reply.update(ttft_s=latency.ttft_s, itl_s=latency.itl_s, latency_samples=latency.samples,
                         kv_load_blocks=load, kv_capacity_blocks=pool_capacity, pool_replicas=pool_replicas)
        return reply

    async def remove_replica(self, replica_id: str) -> None:
        self.queue.remove_replica(replica_id)

    async def stats(self) -> dict[str, Any]:
        return self.queue.stats()

"""One Serve replica = one engine (native or vLLM, behind dcpserve.engine.protocol.EngineClient) = one TP x DCP worker
group, in the replica's own placement group.

The replica is the authority on its KV, and its engine's ledger (EngineClient.kv_ledger) is the one place that
counts it: a request is accepted only when its admission blocks under the app's policy (prompt + max_tokens under
"full", the prompt under "usage", where the headroom keeps growth room for the sequences already there) fit what
the ledger has free. generate() therefore answers Accepted, Refused or Rejected; an accepted request's deltas go to
its ingress on that ingress' delta stream (deltas(), dcpserve.deployments.dispatch.streams: one item per engine step for
all of its requests here), and abort() stops one the ingress is done with. It reports KV to the routers
(record_routing_stats), to the admission queue (every kv_report_period_s: what it holds per ticket, its headroom)
and to the autoscaler (record_autoscaling_stats).

Serve's controller calls record_routing_stats and check_health only on RUNNING replicas, and routers learn of a
replica when it becomes RUNNING. So the replica tells the admission queue it is routable only while those probes
keep coming: not while its constructor has returned but Serve has not yet published it to the routers, and no
longer once Serve has stopped probing it because it is draining. The queue grants nothing to an unroutable replica.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from dcpserve.cluster.node_types import NODE_TYPE_LABEL
from dcpserve.deployments.autoscaling import replica_stats
from dcpserve.deployments.config import AppArgs
from dcpserve.deployments.messages import (
    DEFAULT_POOL,
    Accepted,
    Admission,
    DeltaBatch,
    EngineRequest,
    KvReport,
    KvReportReply,
    Refused,
    Rejected,
    ReplicaQuery,
    ReplicaStats,
    SloReport,
    Subscribed,
)
from dcpserve.deployments.metrics import GAUGE_PERIOD_S, ReplicaMetrics
from dcpserve.deployments.replica.outbox import Outbox
from dcpserve.deployments.replica.prefill_rate import PrefillRate
from dcpserve.engine.protocol import EngineClient, EngineStats

logger = logging.getLogger("ray.serve")

# How long a stopping replica waits for the admission queue to forget it. When the whole app is deleted the queue is
# stopped beside it, and a handle call to a deployment that is going away waits for a replica forever: unbounded, it
# held every stopping replica (and its GPUs) for its whole graceful_shutdown_timeout_s (drain_timeout_s, 120 s).
# Without the call the queue still forgets the replica, once its reports stop (replica_ttl_s).
REMOVE_FROM_QUEUE_TIMEOUT_S = 5.0

# How many aborted tickets a replica remembers, so that a generate() the ingress gave up on before it arrived (its
# abort overtook it) is refused instead of running with nobody reading it.
ABORTED_REMEMBERED = 10_000


def replica_bundles(ranks: int) -> list[dict[str, float]]:
    """The replica's own CPU bundle, then one GPU bundle per rank (tp * pcp of them; DCP reuses the ranks: no extra
    GPUs). With one rank the engine runs in the replica process, so its bundle holds the GPU."""
    if ranks == 1:
        return [{"CPU": 1.0, "GPU": 1.0}]
    return [{"CPU": 1.0}] + [{"GPU": 1.0}] * ranks


def _node_tags() -> dict[str, str]:
    """node_id and node_type of the node this replica runs on: the type is the node's NODE_TYPE_LABEL (`make
    cluster`'s worker nodes carry it; so do KubeRay's), "head" on the head node, else empty."""
    context = ray.get_runtime_context()
    node_id = context.get_node_id()
    node_type = str(context.get_node_labels().get(NODE_TYPE_LABEL) or "")
    if not node_type and any(node.get("NodeID") == node_id and "node:__internal_head__" in node.get("Resources", {})
                             for node in ray.nodes()):
        node_type = "head"
    return {"node_id": node_id, "node_type": node_type}


def _node_has_cuda() -> bool:
    """Whether this node has real GPUs (Ray labels them with an accelerator type; logical --num-gpus does not)."""
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return any(key.startswith("accelerator_type:") for key in node.get("Resources", {}))
    return False


class EngineReplica:
    """Serve deployment class (wrapped by build_app): runs one engine and reports its KV."""

    async def __init__(self, args: AppArgs, admission: Any = None, pool: str = DEFAULT_POOL) -> None:  # type: ignore[misc]  # Serve awaits an async constructor
        from dcpserve.engine.backends import start_engine

        device = args.device
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() or _node_has_cuda() else "cpu"
        self.args = args.model_copy(update={"device": device})
        self.pool = next(p for p in self.args.pool_list() if p.name == pool)  # its layout pool (admission/pools.py)
        self.metrics: ReplicaMetrics | None = None
        self.step_s = 0.0  # recent mean engine step (an exponential average), the ITL its batch gets
        self.prefill_rate = PrefillRate()  # what its steps with prompt tokens cost per token: the queue's prefill price
        pool_args = self.args.pool_engine_args(self.pool)
        self.max_num_seqs = pool_args.max_num_seqs  # reported with step_s: its batch
        self.step_tokens = pool_args.step_token_budget()  # and the prefill a step takes
        # Starting the engine blocks (rank actors or vLLM's workers, weights, KV sizing): keep it off the event loop.
        self.engine: EngineClient = await asyncio.to_thread(start_engine, self.args.pool_engine_args(self.pool),
                                                            self._on_step)
        stats = self.engine.stats()
        self.metrics = ReplicaMetrics(
            pool=self.pool.name, tp=stats.tp, dcp=stats.dcp, num_kv_heads=stats.num_kv_heads,
            target_sequences_per_replica=self.pool.autoscaling.target_sequences_per_replica,
            admission=stats.admission, **_node_tags(),
        )
        ledger = self.engine.kv_ledger()
        self.tokens_per_block = ledger.tokens_per_block
        self.capacity_blocks = ledger.capacity_blocks
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.admission = admission
        self.admission_queued = 0
        scaling = self.pool.autoscaling  # with a latency target its policy reads the pool's latencies and KV load
        # With latency targets each report asks for the pool's latencies over this window (0: none asked).
        self._slo_window_s = scaling.slo_window_s if scaling.slo_targets else 0.0
        self._slo_percentile = scaling.slo_percentile
        self.slo: SloReport | None = None  # the queue's last answer to them
        self._outboxes: dict[str, Outbox] = {}  # subscribed ingress replica -> its delta stream's outbox
        self._aborted: OrderedDict[tuple[str, int], None] = OrderedDict()  # (ticket, attempt) given up, newest last
        self._attempts: dict[str, int] = {}  # accepted tickets still forwarding -> their attempt
        # Stream items sent to the ingress and the generated tokens they carried, since the replica started.
        self.num_stream_items = 0
        self.num_stream_tokens = 0
        # Where the admission queue's copy of this replica's prefix cache stands (its last reply says).
        self._prefix_position: tuple[str | None, int] = (None, 0)
        # Controller probes (routing stats, health checks) seen, and when the last one came (time.monotonic()).
        self.probes = 0
        self._last_probe_at: float | None = None
        # Routing stats come every routing_stats_period_s while Serve routes here; a few missed periods mean draining.
        self._probe_grace_s = 3 * self.args.routing_stats_period_s + 2.0
        self._report_task: asyncio.Task[None] | None = None
        self._report_lock = asyncio.Lock()
        self._metrics_task: asyncio.Task[None] | None = None
        self._ensure_reporting()
        logger.info(
            "engine replica %s: %s backend, tp=%d dcp=%d, KV %d blocks of %d tokens (%d tokens)",
            self.replica_id, stats.backend, stats.tp, stats.dcp, self.capacity_blocks, self.tokens_per_block,
            self.capacity_blocks * self.tokens_per_block,
        )

    # ---- requests -------------------------------------------------------------------------------------------

    async def deltas(self, query: ReplicaQuery, subscriber: str) -> AsyncIterator[Subscribed | DeltaBatch]:
        """The delta stream of one ingress replica (dcpserve.deployments.dispatch.streams): Subscribed, then forever one
        DeltaBatch per engine step (at most one per stream_interval_s, a request's first and last delta at once)
        carrying the deltas of every request that ingress has here. When the ingress closes it, or goes away, its
        requests still running here are aborted; so are they when the ingress stops renewing it (it died: Ray does not
        end a streaming call whose caller is gone)."""
        self._check_addressed(query, "deltas")
        metrics = self.metrics
        assert metrics is not None  # set in the constructor, before any call
        outbox = Outbox(subscriber)
        replaced = self._outboxes.get(subscriber)
        if replaced is not None:  # the ingress lost its earlier stream and opened a new one
            replaced.close()
        self._outboxes[subscriber] = outbox
        try:
            yield Subscribed(self.replica_id)
            async for batch in outbox.batches(self.args.stream_interval_s):
                tokens = batch.num_tokens
                self.num_stream_items += 1
                self.num_stream_tokens += tokens
                metrics.stream_items.inc()
                if tokens:
                    metrics.stream_tokens.inc(tokens)
                yield batch
        finally:
            if self._outboxes.get(subscriber) is outbox:
                del self._outboxes[subscriber]
            outbox.close()

    async def renew(self, query: ReplicaQuery, subscriber: str) -> bool:
        """The ingress renews the lease of its delta stream (dcpserve.deployments.messages.LEASE_S). False: no
        stream of that ingress is open here (it ended: the ingress ends its side too)."""
        self._check_addressed(query, "renew")
        outbox = self._outboxes.get(subscriber)
        if outbox is None or outbox.closed:
            return False
        outbox.renew()
        return True

    async def generate(self, request: EngineRequest) -> Admission:
        """Accepted (its deltas follow on the delta stream of request.reply_to), Refused (no room now) or Rejected
        (it can never run here)."""
        from dcpserve.engine.protocol import KvFull, RequestError

        outbox = self._outboxes.get(request.reply_to)
        if outbox is None:  # the ingress' stream ended before this call came: it opens a new one and asks again
            raise RuntimeError(f"no delta stream from ingress {request.reply_to!r} is open on replica "
                               f"{self.replica_id}")
        if self.engine.has_request(request.ticket) or (request.ticket, request.attempt) in self._aborted:
            # An earlier dispatch of this ticket is still here, or the ingress gave up on it already.
            return Refused(self.replica_id, self.engine.kv_ledger().free_blocks)
        outbox.expect(request.ticket, self._forwarded)  # the engine may deliver its first deltas before it answers
        try:
            await self.engine.submit_to(outbox, sampling_params=request.sampling_params,
                                        prompt_token_ids=request.prompt_token_ids, request_id=request.ticket,
                                        check_kv=True, prompt_hashes=request.prompt_hashes)
        except KvFull as full:
            outbox.forget(request.ticket)
            # Normal with prefix caching when the queue's copy of the cache is a report behind: the replica's count
            # decides. It reports before it answers, so the queue re-grants the request from the replica's state of
            # now: with the stale copy it would grant it here again, and the request would go round in a tight loop
            # (ingress, queue, replica) until the next periodic report.
            logger.debug("ticket %s: the queue counted %d blocks, the replica needs %d of %d free", request.ticket,
                         request.kv_blocks, full.need, full.free_blocks)
            if self.admission is not None:
                try:
                    await self._report()
                except Exception as err:  # noqa: BLE001 - the refusal still corrects the queue's free blocks
                    logger.warning("KV report to the admission queue after a refusal failed: %r", err)
            return Refused(self.replica_id, full.free_blocks)
        except RequestError as err:  # never fits this engine, bad token ids or constraint: the client's error
            outbox.forget(request.ticket)
            return Rejected(self.replica_id, str(err))
        except BaseException:
            outbox.forget(request.ticket)
            raise
        metrics = self.metrics
        assert metrics is not None  # set in the constructor, before any call
        metrics.accepted.inc(tags={"admission": self.args.admission})
        if outbox.closed:  # the stream ended while the engine took the request (its close aborted it): nobody reads
            raise RuntimeError(f"the delta stream from ingress {request.reply_to!r} ended")
        if self.engine.has_request(request.ticket):  # else it finished already (its on_end ran)
            self._attempts[request.ticket] = request.attempt
        return Accepted(self.replica_id)

    def _forwarded(self, ticket: str, finished: bool) -> None:
        """A request's deltas stopped coming to its outbox."""
        self._attempts.pop(ticket, None)
        if not finished:  # aborted by the ingress, its stream gone, or failed: abort frees the KV
            self.engine.abort(ticket)

    async def abort(self, query: ReplicaQuery, ticket: str, attempt: int = 0) -> bool:
        """The ingress is done with one attempt of a request before it finished (client gone, timeout): stop it and
        free its KV. A generate() of that attempt that comes after this is refused. False when it was not running
        here."""
        self._check_addressed(query, "abort")
        self._aborted[(ticket, attempt)] = None
        while len(self._aborted) > ABORTED_REMEMBERED:
            self._aborted.popitem(last=False)
        if self._attempts.get(ticket, attempt) != attempt:
            return False  # a later attempt of the ticket runs here now: not the one the ingress gave up on
        return any(outbox.cancel(ticket) for outbox in self._outboxes.values())

    def _check_addressed(self, query: ReplicaQuery | None, method: str) -> None:
        if query is not None and query.target_replica != self.replica_id:
            raise ValueError(f"{method}() addressed to replica {query.target_replica} reached {self.replica_id}")

    async def stats(self, query: ReplicaQuery | None = None) -> ReplicaStats:
        """This replica's engine stats, KV ledger and id; `query` only addresses the call (the router's)."""
        self._check_addressed(query, "stats")
        return ReplicaStats(self.replica_id, self.engine.stats(), self.engine.kv_ledger(), self.num_stream_items,
                            self.num_stream_tokens)

    # ---- reports --------------------------------------------------------------------------------------------

    @property
    def routable(self) -> bool:
        """Whether Serve's controller has probed this replica recently: it is RUNNING and the routers know it."""
        return self._last_probe_at is not None and time.monotonic() - self._last_probe_at < self._probe_grace_s

    def _probed(self) -> None:
        self.probes += 1
        self._last_probe_at = time.monotonic()

    def record_routing_stats(self) -> dict[str, Any]:
        """Routers read these (stale by up to routing_stats_period_s): KV in tokens and blocks, sequences."""
        self._probed()
        engine = self.engine.stats()
        ledger = self.engine.kv_ledger()
        return {  # a dict: Serve's hook asks for one
            "kv_admission": ledger.admission,
            "kv_capacity_blocks": ledger.capacity_blocks,
            "kv_free_blocks": ledger.free_blocks,  # what dispatch/router.py ranks by
            "kv_held_blocks": ledger.committed_blocks,
            "kv_used_blocks": ledger.used_blocks,
            "kv_headroom_blocks": ledger.headroom_blocks,
            "kv_tokens_per_block": ledger.tokens_per_block,
            "kv_capacity_tokens": ledger.capacity_blocks * ledger.tokens_per_block,
            "kv_free_tokens": ledger.free_blocks * ledger.tokens_per_block,
            "kv_reserved_tokens": engine.kv_reserved_tokens,
            "num_held": len(ledger.per_request),
            "num_running": engine.num_running,
            "num_waiting": engine.num_waiting + engine.num_pending,
            "healthy": engine.healthy,
        }

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Concurrent sequences here, KV usage, and the admission queue's length (the same on every replica); with a
        latency target, the pool's latencies and KV load from the queue's last reply
        (dcpserve/deployments/autoscaling.py)."""
        engine = self.engine.stats()
        return replica_stats(self.engine.kv_ledger(), engine.num_running, engine.num_waiting, self.admission_queued,
                             self.slo)

    async def check_health(self) -> None:
        """Serve's health check: the engine loop is alive and every TP rank answers."""
        await self.engine.check_health()
        self._probed()
        self._ensure_reporting()

    def _ensure_reporting(self) -> None:
        if self._metrics_task is None or self._metrics_task.done():
            self._metrics_task = asyncio.get_running_loop().create_task(self._metrics_loop())
        if self.admission is not None and (self._report_task is None or self._report_task.done()):
            self._report_task = asyncio.get_running_loop().create_task(self._report_loop())

    async def _report_loop(self) -> None:
        while True:
            try:
                await self._report()
            except Exception as err:  # noqa: BLE001 - the queue restarts; keep reporting
                logger.warning("KV report to the admission queue failed: %r", err)
            await asyncio.sleep(self.args.kv_report_period_s)

    async def _report(self) -> None:
        """One KV report to the admission queue: the ledger, health, and the prefix cache's changes since the queue's
        copy. One at a time: each starts from the prefix position the last one's reply gave."""
        async with self._report_lock:
            ledger = self.engine.kv_ledger()
            tier = self.engine.stats().host_tier  # its measured reload cost: the queue credits host-tier hits by it
            prefix = await self.engine.prefix_report(*self._prefix_position)
            reply: KvReportReply = await self.admission.report.remote(KvReport(
                replica_id=self.replica_id, capacity=ledger.capacity_blocks, tokens_per_block=ledger.tokens_per_block,
                held=ledger.per_request, healthy=self.engine.dead_error is None, routable=self.routable,
                probes=self.probes, headroom=ledger.headroom_blocks, prefix=prefix, pool=self.pool.name,
                step_s=self.step_s, gpus=self.pool.ranks, max_seqs=self.max_num_seqs,
                prefill_tokens=ledger.prefill_tokens, step_tokens=self.step_tokens,
                reload_s_per_block=tier.reload_seconds_per_block if tier is not None else 0.0,
                prefill_s_per_token=self.prefill_rate.seconds_per_token,
                slo_window_s=self._slo_window_s, slo_percentile=self._slo_percentile))
            self.admission_queued = reply.num_queued
            self.slo = reply.slo
            self._prefix_position = (reply.prefix_epoch, reply.prefix_version)

    def _on_step(self, stats: EngineStats) -> None:
        self.step_s = stats.last_step_seconds if not self.step_s else 0.9 * self.step_s + 0.1 * stats.last_step_seconds
        self.prefill_rate.observe(stats.last_step_seconds, stats.last_step_prompt_tokens, stats.last_step_tokens)
        if self.metrics is None:
            return
        try:
            self.metrics.on_step(stats)
        except Exception as err:  # noqa: BLE001 - metrics must never stop the engine loop
            logger.warning("recording step metrics failed: %r", err)

    async def _metrics_loop(self) -> None:
        """Gauges from the engine's stats every GAUGE_PERIOD_S (idle replicas too, so a quiet replica reads 0)."""
        while True:
            try:
                if self.metrics is not None:
                    self.metrics.update(self.engine.stats(), self.engine.kv_ledger())
            except Exception as err:  # noqa: BLE001 - keep reporting
                logger.warning("recording replica metrics failed: %r", err)
            await asyncio.sleep(GAUGE_PERIOD_S)

    async def __del__(self) -> None:
        # Serve calls this after a failed constructor too: only what was set up is torn down.
        for task in (getattr(self, "_report_task", None), getattr(self, "_metrics_task", None)):
            if task is not None:
                task.cancel()
        if getattr(self, "admission", None) is not None and hasattr(self, "replica_id"):
            try:
                await asyncio.wait_for(self.admission.remove_replica.remote(self.replica_id),
                                       REMOVE_FROM_QUEUE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - the queue is gone or going away (the app is deleted): nothing to tell
                pass
        engine = getattr(self, "engine", None)
        if engine is not None:
            await engine.shutdown()

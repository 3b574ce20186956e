"""One Serve replica = one AsyncEngine = one TP x DCP worker group, in the replica's own placement group.

The replica is the authority on its KV: it accepts a request only when the blocks it already holds for accepted
requests plus this one's need (prompt + max_tokens, in logical blocks) fit its capacity, so no accepted request
ever waits inside the engine for KV. generate() therefore first yields an `accepted` or `refused` message, then
the token deltas. It reports KV to the routers (record_routing_stats), to the admission queue (every
kv_report_period_s: what it holds per ticket) and to the autoscaler (record_autoscaling_stats).

Serve's controller calls record_routing_stats and check_health only on RUNNING replicas, and routers learn of a
replica when it becomes RUNNING. So the replica tells the admission queue it is routable only while those probes
keep coming: not while its constructor has returned but Serve has not yet published it to the routers, and no
longer once Serve has stopped probing it because it is draining. The queue grants nothing to an unroutable replica.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import ray
from ray import serve

from deployments.config import AppArgs
from deployments.metrics import GAUGE_PERIOD_S, ReplicaMetrics
from engine.block_manager import blocks_needed
from engine.sampling_params import SamplingParams

logger = logging.getLogger("ray.serve")


@dataclass
class EngineRequest:
    """What the ingress sends a replica: tokens, sampling, the KV need, and the replica the queue granted."""

    ticket: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    kv_blocks: int
    target_replica: str | None = None  # the router sends it only there (None: the router picks by KV)


def replica_bundles(tp: int) -> list[dict[str, float]]:
    """The replica's own CPU bundle, then one GPU bundle per TP rank (DCP reuses the TP ranks: no extra GPUs).
    With tp = 1 the engine runs in the replica process, so its bundle holds the GPU."""
    if tp == 1:
        return [{"CPU": 1, "GPU": 1}]
    return [{"CPU": 1}] + [{"GPU": 1}] * tp


def _node_has_cuda() -> bool:
    """Whether this node has real GPUs (Ray labels them with an accelerator type; logical --num-gpus does not)."""
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return any(key.startswith("accelerator_type:") for key in node.get("Resources", {}))
    return False


class EngineReplica:
    """Serve deployment class (wrapped by build_app): runs one engine and reports its KV."""

    async def __init__(self, args: AppArgs, admission: Any | None = None) -> None:
        from engine.async_engine import AsyncEngine

        device = args.device
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() or _node_has_cuda() else "cpu"
        self.args = args.model_copy(update={"device": device})
        self.config = self.args.engine_config()
        self.metrics = ReplicaMetrics(
            tp=self.config.parallel.tp, dcp=self.config.parallel.dcp,
            num_kv_heads=self.config.model_config.num_key_value_heads,
            target_sequences_per_replica=self.args.autoscaling.target_sequences_per_replica,
        )
        # Starting the worker group blocks on Ray (actors, weights, KV allocation): keep it off the event loop.
        self.engine = await asyncio.to_thread(AsyncEngine, self.config, self._on_step)
        self.tokens_per_block = self.config.cache.block_size * self.config.parallel.dcp
        self.capacity_blocks = self.engine.engine.block_manager.num_blocks
        self.held: dict[str, int] = {}  # ticket -> blocks, for every accepted request until it ends
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.admission = admission
        self.admission_queued = 0
        # Controller probes (routing stats, health checks) seen, and when the last one came (time.monotonic()).
        self.probes = 0
        self._last_probe_at: float | None = None
        # Routing stats come every routing_stats_period_s while Serve routes here; a few missed periods mean draining.
        self._probe_grace_s = 3 * self.args.routing_stats_period_s + 2.0
        self._report_task: asyncio.Task[None] | None = None
        self._metrics_task: asyncio.Task[None] | None = None
        self._ensure_reporting()
        logger.info(
            "engine replica %s: tp=%d dcp=%d, KV %d blocks of %d tokens (%d tokens)",
            self.replica_id, self.config.parallel.tp, self.config.parallel.dcp, self.capacity_blocks,
            self.tokens_per_block, self.capacity_blocks * self.tokens_per_block,
        )

    # ---- requests -------------------------------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        return self.capacity_blocks - sum(self.held.values())

    async def generate(self, request: EngineRequest):  # noqa: ANN201 - async generator of dicts
        """Yields {"accepted": True} or {"refused": True, "free_blocks": n}, then one dict per RequestDelta."""
        need = blocks_needed(len(request.prompt_token_ids) + request.sampling_params.max_tokens, self.tokens_per_block)
        if need != request.kv_blocks:
            logger.warning("ticket %s: ingress counted %d blocks, replica counts %d", request.ticket,
                           request.kv_blocks, need)
        if request.ticket in self.held or need > self.free_blocks:
            yield {"refused": True, "free_blocks": self.free_blocks, "replica_id": self.replica_id}
            return
        self.held[request.ticket] = need
        try:
            stream = self.engine.generate(
                sampling_params=request.sampling_params,
                prompt_token_ids=request.prompt_token_ids,
                request_id=request.ticket,
            )
            yield {"accepted": True, "replica_id": self.replica_id}
            async for delta in stream:
                yield asdict(delta)
        finally:
            # Cancellation (client gone) lands here too; AsyncEngine.generate's own finally aborts the request.
            self.held.pop(request.ticket, None)

    async def stats(self) -> dict[str, Any]:
        stats = self.engine.stats()
        stats.update(self._kv_report())
        stats["replica_id"] = self.replica_id
        return stats

    # ---- reports --------------------------------------------------------------------------------------------

    def _kv_report(self) -> dict[str, Any]:
        held = sum(self.held.values())
        return {
            "kv_capacity_blocks": self.capacity_blocks,
            "kv_free_blocks": self.capacity_blocks - held,
            "kv_held_blocks": held,
            "kv_tokens_per_block": self.tokens_per_block,
            "kv_capacity_tokens": self.capacity_blocks * self.tokens_per_block,
            "kv_free_tokens": (self.capacity_blocks - held) * self.tokens_per_block,
            "num_held": len(self.held),
        }

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
        report = self._kv_report()
        report.update({
            "kv_reserved_tokens": engine["kv_reserved_tokens"],
            "num_running": engine["num_running"],
            "num_waiting": engine["num_waiting"] + engine["num_pending"],
            "healthy": engine["healthy"],
        })
        return report

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Concurrent sequences here, KV usage, and the admission queue's length (the same on every replica)."""
        engine = self.engine.stats()
        return {
            "sequences": float(max(len(self.held), engine["num_running"] + engine["num_waiting"])),
            "kv_usage": sum(self.held.values()) / self.capacity_blocks,
            "admission_queued": float(self.admission_queued),
        }

    async def check_health(self) -> None:
        """Serve's health check: the engine loop is alive and every TP rank answers."""
        await asyncio.to_thread(self.engine.check_health)
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
                reply = await self.admission.report.remote(
                    self.replica_id, self.capacity_blocks, self.tokens_per_block, dict(self.held),
                    self.engine.dead_error is None, self.routable, self.probes,
                )
                self.admission_queued = int(reply.get("num_queued", 0))
            except Exception as err:  # noqa: BLE001 - the queue restarts; keep reporting
                logger.warning("KV report to the admission queue failed: %r", err)
            await asyncio.sleep(self.args.kv_report_period_s)

    def _on_step(self, stats: dict[str, Any]) -> None:
        try:
            self.metrics.on_step(stats)
        except Exception as err:  # noqa: BLE001 - metrics must never stop the engine loop
            logger.warning("recording step metrics failed: %r", err)

    async def _metrics_loop(self) -> None:
        """Gauges from the engine's stats every GAUGE_PERIOD_S (idle replicas too, so a quiet replica reads 0)."""
        while True:
            try:
                self.metrics.update(self.engine.stats(), sum(self.held.values()) * self.tokens_per_block)
            except Exception as err:  # noqa: BLE001 - keep reporting
                logger.warning("recording replica metrics failed: %r", err)
            await asyncio.sleep(GAUGE_PERIOD_S)

    async def __del__(self) -> None:
        for task in (self._report_task, self._metrics_task):
            if task is not None:
                task.cancel()
        if self.admission is not None:
            try:
                await self.admission.remove_replica.remote(self.replica_id)
            except Exception:  # noqa: BLE001 - the app is going away
                pass
        await self.engine.shutdown()

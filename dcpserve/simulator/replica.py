"""One engine replica on simulated time: the engine's real Scheduler, BlockManager and prefix cache; a step-time model
instead of the model forward.

What the served replica does, in the same order with the same code:
- accept (dcpserve.deployments.replica.engine_replica.EngineReplica.generate -> the engine core's add with check_kv):
  the request's need on this replica's ledger (`Scheduler.committed_blocks`, the engine's admission_need),
  `KvLedger.require` (KvFull: the queue's grant was stale, the caller re-queues the request at the head), then
  `Scheduler.add_request` (RequestRejected: it can never run here);
- the step loop (dcpserve.engine.core.engine.LLMEngine.step): `Scheduler.schedule()`, then the step's duration from the
  step-time model (simulated time passes), then `Scheduler.update()` with the sampled tokens. A request's tokens are
  1 until its trace length, where it samples the EOS id (or reaches max_tokens);
- with a host KV tier (ReplicaShape.host_tier), the block manager is dcpserve.simulator.host_tier's
  TieredBlockManager and a step lasts the longer of its compute and the copies its schedule started;
- the KV report to the admission queue every kv_report_period_s (EngineReplica._report_loop): the ledger's
  per-request blocks, headroom and the prefix cache's changes (`BlockManager.reporter`), the reply's prefix position
  kept for the next report.
What it leaves out: the network hops between the ingress, the queue and the replica (zero simulated time), the
replica's delta stream batching (tokens reach the client at the end of the step that made them).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from dcpserve.deployments.admission.queue import AdmissionQueue
from dcpserve.deployments.messages import DEFAULT_POOL, KvReport
from dcpserve.deployments.replica.prefill_rate import PrefillRate
from dcpserve.engine.config import SchedulerConfig
from dcpserve.engine.core.block_manager import BlockManager
from dcpserve.engine.core.request import Request
from dcpserve.engine.core.scheduler import Scheduler, TokenUpdate
from dcpserve.engine.protocol import KvLedger
from dcpserve.simulator.decode_lane import LaneScheduler
from dcpserve.simulator.host_tier import HostTierShape, TieredBlockManager
from dcpserve.simulator.step_time import StepTimeModel, StepWork

# Token ids of simulated outputs: every token is FILLER_TOKEN but the last of a request whose trace length ends
# before its max_tokens, which is EOS_TOKEN (prompts are all 0: dcpserve.simulator.tokens).
FILLER_TOKEN = 1
EOS_TOKEN = 2


@dataclass(frozen=True)
class ReplicaShape:
    """What every replica of a simulated deployment is: its layout, its KV pool and its scheduler's limits."""

    tp: int
    dcp: int
    num_blocks: int  # logical blocks of block_size * dcp tokens
    block_size: int
    scheduler: SchedulerConfig
    enable_prefix_caching: bool = True
    host_tier: HostTierShape | None = None  # None: no host KV tier

    def __post_init__(self) -> None:
        if self.host_tier is not None and not self.enable_prefix_caching:
            raise ValueError("a host KV tier holds cached prefix blocks: it needs prefix caching on")

    @property
    def tokens_per_block(self) -> int:
        return self.block_size * self.dcp

    @property
    def num_gpus(self) -> int:
        return self.tp


class TokenSink(Protocol):
    """Where a replica's tokens go (the simulation's recorder)."""

    def tokens(self, updates: list[TokenUpdate], now: float) -> None:
        """A step's sampled tokens, applied one by one by the scheduler, at the step's end."""

    def lane_tokens(self, count: int, gap_s: float) -> None:
        """A step's tokens of the decode lane: `count` requests that each sampled one, gap_s after their last."""

    def lane_left(self, request_id: str, count: int, last_token_at: float) -> None:
        """A request left the decode lane having sampled `count` tokens there, the last at last_token_at."""


class SimReplica:
    """One replica: the real scheduler and block manager, stepping on simulated time. With decode_lane (the
    default) the scheduler is dcpserve.simulator.decode_lane's LaneScheduler: the same steps and state, with the
    decodes nothing can change advanced in bulk."""

    def __init__(self, replica_id: str, shape: ReplicaShape, step_model: StepTimeModel, queue: AdmissionQueue,
                 report_period_s: float, sink: TokenSink, pool: str = DEFAULT_POOL, decode_lane: bool = True) -> None:
        self.replica_id = replica_id
        self.pool = pool
        self.step_s = 0.0  # recent mean step (EngineReplica's exponential average), reported to the queue
        self.prefill_rate = PrefillRate()  # its steps' price of a prompt token, reported to the queue (EngineReplica's)
        self.shape = shape
        self.step_model = step_model
        self.queue = queue
        self.report_period_s = report_period_s
        self._sink = sink
        self.tiered: TieredBlockManager | None = None  # the block manager, when it has a host tier
        if shape.host_tier is None:
            self.block_manager = BlockManager(shape.num_blocks, shape.block_size, shape.dcp,
                                              enable_prefix_caching=shape.enable_prefix_caching)
        else:
            self.block_manager = self.tiered = TieredBlockManager(shape.num_blocks, shape.block_size, shape.dcp,
                                                                  shape.host_tier)
        self.output_lengths: dict[str, int] = {}  # request id -> the trace's output length
        self.lane: LaneScheduler | None = None
        self.scheduler: Scheduler
        if decode_lane:
            self.scheduler = self.lane = LaneScheduler(shape.scheduler, self.block_manager, frozenset({EOS_TOKEN}),
                                                       self.output_lengths, FILLER_TOKEN)
        else:
            self.scheduler = Scheduler(shape.scheduler, self.block_manager, frozenset({EOS_TOKEN}))
        self._last_step_end = 0.0  # when the last step ended: the lane's tokens' previous token
        self._ledger: KvLedger | None = None  # kv_ledger's, until the scheduler's state changes
        self._work = asyncio.Event()
        self._prefix_position: tuple[str | None, int] = (None, 0)
        self.probes = 1  # Serve's controller has probed it: grantable from its first report
        self.draining = False
        self.stopped = False
        self.num_steps = 0
        self.busy_seconds = 0.0
        self.num_step_tokens = 0
        self.load_seconds = 0.0  # host -> device copy time of the tier's reloads (each rank's, all at once)
        self.offload_seconds = 0.0
        self.exposed_copy_seconds = 0.0  # what the copies added to their steps past the compute
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._step_loop()), loop.create_task(self._report_loop())]

    def stop(self) -> None:
        """Stops stepping and reporting; the queue forgets it."""
        self.stopped = True
        for task in self._tasks:
            task.cancel()
        self.queue.remove_replica(self.replica_id)

    # ---- requests -------------------------------------------------------------------------------------------

    def accept(self, request: Request, output_length: int) -> int:
        """Takes a granted request if its need fits this replica's ledger now; returns the blocks it counts. Raises
        KvFull (no room now: the caller gives the grant back) or RequestRejected (it can never run here)."""
        scheduler = self.scheduler
        need = scheduler.committed_blocks(request)
        ledger = self.kv_ledger()
        ledger.require(need)
        scheduler.add_request(request)
        self._ledger = scheduler.ledger_with(ledger, request, need)
        self.output_lengths[request.request_id] = output_length
        self._work.set()
        return need

    def kv_ledger(self) -> KvLedger:
        """The scheduler's ledger, built once between two changes of its state (a schedule, an update, an abort; an
        accept extends it, Scheduler.ledger_with): accepts and reports between two steps read the same one, as the
        served core's adds in one batch do, instead of walking every request each."""
        if self._ledger is None:
            self._ledger = self.scheduler.kv_ledger()
        return self._ledger

    def abort(self, request_id: str) -> None:
        self.output_lengths.pop(request_id, None)
        if self.scheduler.abort_request(request_id):
            self._ledger = None
            self._work.set()
        self._lane_left()

    def _lane_left(self) -> None:
        """The requests that left the decode lane: their tokens there, to the sink (the last one at the end of the
        last step: a request leaves the lane before a step, or during one that it is then not part of)."""
        if self.lane is not None and self.lane.lane_left:
            for request, count in self.lane.drain_left():
                self._sink.lane_left(request.request_id, count, self._last_step_end)

    @property
    def num_sequences(self) -> int:
        return len(self.scheduler.requests)

    # ---- loops ----------------------------------------------------------------------------------------------

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        scheduler = self.scheduler
        output_lengths = self.output_lengths
        tiered, lane, sink = self.tiered, self.lane, self._sink
        while True:
            if not scheduler.has_unfinished:
                self._work.clear()
                await self._work.wait()
            output = scheduler.schedule()
            self._ledger = None
            lane_rows = lane_context = 0
            if lane is not None:
                self._lane_left()
                lane_rows, lane_context = lane.lane_rows, lane.lane_context_tokens
            if output.is_empty and not lane_rows:
                # Waiting requests that no KV or seat can take now: only an add, abort or finish changes that.
                self._work.clear()
                await self._work.wait()
                continue
            if output.is_empty:  # the lane's decodes only
                work = StepWork.decodes(lane_rows, lane_context)
            else:
                work = StepWork.from_rows((entry.start_position, len(entry.token_ids)) for entry in output.scheduled)
                if lane_rows:
                    work = work.with_decodes(lane_rows, lane_context)
            seconds = self.step_model.step_seconds(work)
            if tiered is not None:
                loaded, offloaded = tiered.take_copies()
                if loaded or offloaded:
                    shape_tier = tiered.tier_shape
                    self.load_seconds += shape_tier.load_seconds(loaded)
                    self.offload_seconds += shape_tier.offload_seconds(offloaded)
                    copies = shape_tier.copy_seconds(loaded, offloaded)
                    if copies > seconds:
                        self.exposed_copy_seconds += copies - seconds
                        seconds = copies
            await asyncio.sleep(seconds)
            self.num_steps += 1
            self.busy_seconds += seconds
            self.step_s = seconds if not self.step_s else 0.9 * self.step_s + 0.1 * seconds
            self.prefill_rate.observe(seconds, output.num_prompt_tokens, work.num_tokens)
            self.num_step_tokens += work.num_tokens
            sampled = {
                entry.request_id: EOS_TOKEN if entry.num_output_tokens + 1 >= output_lengths[entry.request_id]
                else FILLER_TOKEN
                for entry in output.scheduled if entry.sample and entry.request_id in output_lengths
            }
            updates = scheduler.update(output, sampled)
            self._ledger = None
            for update in updates:
                if update.finished:
                    output_lengths.pop(update.request.request_id, None)
            now = loop.time()
            if lane is not None and lane.lane_tokens:
                sink.lane_tokens(lane.lane_tokens, now - self._last_step_end)
            self._last_step_end = now
            if updates:
                sink.tokens(updates, now)

    async def _report_loop(self) -> None:
        while True:
            self.report()
            await asyncio.sleep(self.report_period_s)

    def report(self) -> None:
        """The replica's KV report to the admission queue (EngineReplica._report_loop's, without the network)."""
        ledger = self.kv_ledger()
        reporter = self.block_manager.reporter
        prefix = None if reporter is None else reporter.report(*self._prefix_position)
        self.queue.report(KvReport(
            replica_id=self.replica_id, capacity=ledger.capacity_blocks, tokens_per_block=ledger.tokens_per_block,
            held=ledger.per_request, healthy=True, routable=not self.draining, probes=self.probes,
            headroom=ledger.headroom_blocks, prefix=prefix, pool=self.pool, step_s=self.step_s, gpus=self.shape.tp,
            max_seqs=self.shape.scheduler.max_num_seqs, prefill_tokens=ledger.prefill_tokens,
            step_tokens=self.shape.scheduler.max_num_batched_tokens,
            prefill_s_per_token=self.prefill_rate.seconds_per_token))
        self._prefix_position = self.queue.prefix_position(self.replica_id)

"""A simulation run: clients replay a trace against the app's real admission queue and simulated replicas.

The request's way through it, in simulated time (dcpserve.simulator.clock), is the served one's:
1. The client sends it at its trace time (open loop), or when one of `concurrency` clients is free (closed loop);
   a later turn of a session goes `delay_ms` after the previous turn's answer.
2. The ingress' part (dcpserve.simulator.ingress): the request's admission blocks with the one function every part
   of the app counts them with (dcpserve.engine.core.block_manager.admission_blocks) and its prompt's block names for
   prefix routing, then the app's own admission loop (dcpserve.deployments.dispatch.admit.admit, which the ingress'
   Sessions.open runs too), here through `SimAdmission` (the real AdmissionQueue, in process) and a dispatch to the
   granted SimReplica: a replica that refuses the grant (its ledger is fresher than the queue's copy) reports, the
   grant goes back with `refused()` and the request waits at the head again; the queue's refusals (queue_full,
   queue_timeout, never_fits, ...) end it with their code.
3. The replica's part: dcpserve.simulator.replica.SimReplica (the engine's scheduler and block manager).
4. Its tokens reach the client at the end of each step that made one; the grant is released when it finishes.

Not simulated: network latency between the app's parts (zero), the delta stream's batching, Serve's router (the
queue's grant is where the request goes, as in the app).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from dcpserve.deployments.admission.queue import AdmissionQueue
from dcpserve.deployments.autoscaling import GpuLedger, replica_stats
from dcpserve.deployments.config import AppArgs, AutoscalingArgs
from dcpserve.deployments.dispatch.admit import AdmitSettings, Dispatched, Taken, admit
from dcpserve.deployments.messages import DEFAULT_POOL, Accepted, ApiError, Granted, Refused, Rejected
from dcpserve.engine.core.request import Request, RequestRejected
from dcpserve.engine.core.scheduler import TokenUpdate
from dcpserve.engine.protocol import KvFull
from dcpserve.engine.sampling_params import SamplingParams
from dcpserve.simulator.autoscale import SimAutoscaler
from dcpserve.simulator.clock import run_simulated
from dcpserve.simulator.ingress import SimAdmission, request_need, served_latencies, session_level, sessions_of
from dcpserve.simulator.metrics import Recorder, RequestRecord
from dcpserve.simulator.replica import ReplicaShape, SimReplica
from dcpserve.simulator.step_time import StepTimeModel
from dcpserve.simulator.tokens import PromptTokens
from dcpserve.simulator.totals import ReplicaTotals, host_tier_summary
from dcpserve.simulator.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest


def _app_default(name: str) -> Any:
    return AppArgs.model_fields[name].default


@dataclass(frozen=True)
class ServeSettings:
    """The app's admission settings a simulation runs with: AppArgs' names and defaults
    (dcpserve/deployments/config.py)."""

    max_queued_requests: int = _app_default("max_queued_requests")
    queue_timeout_s: float = _app_default("queue_timeout_s")
    request_timeout_s: float = _app_default("request_timeout_s")
    kv_report_period_s: float = _app_default("kv_report_period_s")
    prefix_routing: bool = _app_default("prefix_routing")
    grant_leak_grace_s: float = _app_default("grant_leak_grace_s")
    retry_after_s: int = _app_default("retry_after_s")
    admission_ttft_bound_s: float = _app_default("admission_ttft_bound_s")
    admission_prefix_hold: bool = _app_default("admission_prefix_hold")
    session_ttl_s: float = _app_default("session_ttl_s")


@dataclass(frozen=True)
class SimPool:
    """One layout pool of a pooled app (dcpserve/deployments/admission/pools.py): its replicas' shape, how many, and
    their step model (None: the simulation's)."""

    name: str
    shape: ReplicaShape
    num_replicas: int  # from the start; with autoscaling, the most this pool may have
    step_model: StepTimeModel | None = None
    autoscaling: AutoscalingArgs | None = None  # None: num_replicas all along


@dataclass(frozen=True)
class SimulationConfig:
    """One simulated deployment and how its clients send the trace."""

    shape: ReplicaShape
    num_replicas: int  # replicas from the start; the most the GPUs hold, with autoscaling
    serve: ServeSettings = field(default_factory=ServeSettings)
    autoscaling: AutoscalingArgs | None = None  # None: num_replicas all along
    replica_start_s: float = 60.0  # from Serve's decision to a replica taking requests (placement, weights load)
    concurrency: int | None = None  # closed loop: this many clients, each sends its next unit when free
    trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS
    sample_period_s: float = 1.0
    # From a request's arrival to its admission: HTTP, the ingress, the hop to the queue (the hops the simulation
    # leaves out). 0: none; bench/simulate_validate.py measures the served app's on this machine.
    request_latency_s: float = 0.0
    progress: TextIO | None = None  # where progress lines go (stderr in the CLI), every progress_wall_s of wall time
    progress_wall_s: float = 5.0
    progress_label: str = ""  # names the run in its progress lines (runs in parallel write to one stream)
    # Layout pools: several shapes behind the one queue, each with its own autoscaling (shape, num_replicas and
    # autoscaling above are then unused); empty: one pool of `shape`, the app without pools.
    pools: tuple[SimPool, ...] = ()
    gpu_budget: int | None = None  # GPUs the pools' autoscaling shares (deployments/autoscaling.py's GpuLedger)
    # The replicas' decode lane (dcpserve/simulator/decode_lane.py): the same run, most decodes advanced in bulk.
    # False: the real scheduler row by row (slower; the tests compare the two).
    decode_lane: bool = True

    def __post_init__(self) -> None:
        if self.pools and self.autoscaling is not None:
            raise ValueError("with layout pools, autoscaling is each pool's (SimPool.autoscaling)")
        names = [pool.name for pool in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names must differ, got {names}")
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.replica_start_s < 0:
            raise ValueError(f"replica_start_s must be >= 0, got {self.replica_start_s}")
        if not self.request_latency_s >= 0:
            raise ValueError(f"request_latency_s must be >= 0, got {self.request_latency_s}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1 (or None for the trace's timestamps), got {self.concurrency}")


@dataclass
class _PoolScaling:
    """One pool's autoscaling: the decision's code, its current target, the replicas starting."""

    autoscaler: SimAutoscaler
    target: int = 0
    starting: list[asyncio.Task[None]] = field(default_factory=list)


class Simulation:
    """The app on simulated time: the admission queue, `num_replicas` SimReplicas, and the trace's clients."""

    def __init__(self, config: SimulationConfig, step_model: StepTimeModel) -> None:
        self.config = config
        self.step_model = step_model
        self.pools = {pool.name: pool for pool in config.pools} or {
            DEFAULT_POOL: SimPool(DEFAULT_POOL, config.shape, config.num_replicas)}
        self.recorder = Recorder()
        self.replicas: dict[str, SimReplica] = {}
        self.replicas_over_time: list[tuple[float, int]] = []
        self._finishing: dict[str, asyncio.Future[None]] = {}
        self._records: dict[str, RequestRecord] = {}
        self.queue: AdmissionQueue | None = None
        # The queue's decisions by outcome, heard as the app's AdmissionMetrics hears them
        # (dcpserve/deployments/metrics.py: dcpserve_admission_requests_total{outcome} and the grants that came back,
        # refused_by_replica).
        self.admission_events: Counter[str] = Counter()
        self.pool_grants: Counter[tuple[str, str]] = Counter()  # (pool, reason) of every grant
        self.queue_waits: list[float] = []  # each wait that ended (dcpserve_admission_queue_wait_seconds)
        self.peak_granted = 0  # the most grants the queue held at a sample (the app's /health num_grants)
        self._next_replica = 0
        self._next_ticket = 0
        self._wall_start = 0.0
        self._last_progress = 0.0
        self.num_units = 0
        self.units_done = 0
        self._units_started = 0
        if not config.pools and config.autoscaling is not None:
            self.pools[DEFAULT_POOL] = SimPool(DEFAULT_POOL, config.shape, config.num_replicas,
                                               autoscaling=config.autoscaling)
        self._shapes = {name: pool.shape for name, pool in self.pools.items()}  # the ingress' view of the pools
        ledger = GpuLedger()  # the pools' shared budget, as in Serve's controller
        self.scaling = {name: _PoolScaling(SimAutoscaler(pool.autoscaling, pool.num_replicas, name=name,
                                                         gpu_budget=config.gpu_budget, tp=pool.shape.tp,
                                                         ledger=ledger))
                        for name, pool in self.pools.items() if pool.autoscaling is not None}

    # ---- the run ----------------------------------------------------------------------------------------------

    def run(self, trace: Sequence[TraceRequest]) -> dict[str, Any]:
        """Replays the trace to the end; returns the summary (dcpserve.simulator.metrics.Recorder.summary)."""
        if not trace:
            raise ValueError("the trace has no requests")
        return run_simulated(self._main(trace))

    async def _main(self, trace: Sequence[TraceRequest]) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        settings = self.config.serve
        self.queue = AdmissionQueue(max_queued=settings.max_queued_requests, leak_grace_s=settings.grant_leak_grace_s,
                                     clock=loop.time, prefix_routing=settings.prefix_routing,
                                     on_event=self._on_admission_event, on_pool=self._on_pool,
                                     ttft_bound_s=settings.admission_ttft_bound_s,
                                     session_ttl_s=settings.session_ttl_s,
                                     prefix_hold=settings.admission_prefix_hold)
        for name, pool in self.pools.items():
            scaling = self.scaling.get(name)
            initial = scaling.autoscaler.initial_replicas if scaling is not None else pool.num_replicas
            for _ in range(initial):
                self.add_replica(name)
            if scaling is not None:
                scaling.target = initial
        self._wall_start = self._last_progress = time.perf_counter()
        sampler = loop.create_task(self._sample_loop())
        scalers = [loop.create_task(self._autoscale_loop(name)) for name in self.scaling]
        units = sessions_of(trace)
        self.num_units = len(units)
        clients = self.config.concurrency
        if clients is not None and clients > len(units) and self.config.progress is not None:
            # A closed loop runs below its concurrency from the start: the load the caller meant is not reached.
            print(f"{self._label()}note: {len(units):,} sessions for {clients:,} clients: the closed loop runs "
                  f"{clients - len(units):,} short of its concurrency (the trace's sessions run out first); more "
                  f"requests per client fill it",
                  file=self.config.progress, flush=True)
        if self.config.concurrency is None:
            await asyncio.gather(*(self._open_loop_unit(unit) for unit in units))
        else:
            source = iter(units)
            await asyncio.gather(*(self._closed_loop_client(source) for _ in range(self.config.concurrency)))
        now = loop.time()
        sampler.cancel()
        for task in scalers:
            task.cancel()
        for scaling in self.scaling.values():
            for task in scaling.starting:
                task.cancel()
        self._sample(now)
        self.recorder.close(now)
        replicas = list(self.replicas.values())
        totals = ReplicaTotals.of(replicas)
        for replica in replicas:
            replica.stop()
        self._progress(now, final=True)
        summary = self.recorder.summary(now, totals.num_preemptions, totals.queried_tokens, totals.hit_tokens,
                                        self.replicas_over_time)
        summary["prefix_hit_rate_by_tier"] = totals.hit_rate_by_tier()
        summary["host_tier"] = host_tier_summary(replicas)
        summary["admission"] = dict(sorted(self.admission_events.items()))
        summary["pool_grants"] = {f"{pool}/{reason}": n for (pool, reason), n in sorted(self.pool_grants.items())}
        summary["peak_granted_sequences"] = self.peak_granted
        waits = self.queue_waits
        summary["queue_wait_mean_s"] = sum(waits) / len(waits) if waits else 0.0
        steps = summary["steps"] = totals.num_steps
        summary["step_mean_s"] = totals.busy_seconds / steps if steps else 0.0
        return summary

    def _on_admission_event(self, outcome: str, waited_s: float | None, level: object = None) -> None:
        self.admission_events[outcome] += 1
        if waited_s is not None:
            self.queue_waits.append(waited_s)

    def _on_pool(self, pool: str, reason: str) -> None:
        self.pool_grants[pool, reason] += 1

    def add_replica(self, pool: str = DEFAULT_POOL) -> SimReplica:
        """Starts one replica of the pool (it reports to the queue at once, so it is grantable now)."""
        assert self.queue is not None  # the run has started
        replica_id = f"replica-{self._next_replica}"
        self._next_replica += 1
        spec = self.pools[pool]
        replica = SimReplica(replica_id, spec.shape, spec.step_model or self.step_model, self.queue,
                             self.config.serve.kv_report_period_s, self, pool=pool,
                             decode_lane=self.config.decode_lane)
        self.replicas[replica_id] = replica
        replica.start()
        self._replicas_changed()
        return replica

    def _replicas_changed(self) -> None:
        now = asyncio.get_running_loop().time()
        self.replicas_over_time.append((now, len(self.replicas)))
        self.recorder.gpus_changed(now, sum(r.shape.num_gpus for r in self.replicas.values()))

    # ---- autoscaling ------------------------------------------------------------------------------------------

    async def _autoscale_loop(self, pool: str) -> None:
        """Serve's controller for one pool's deployment (dcpserve.simulator.autoscale): stats from every replica of it
        taking requests each metrics period, then the decision; replicas start replica_start_s after it, and scale-down
        drains the newest ones."""
        loop = asyncio.get_running_loop()
        scaling = self.scaling[pool]
        autoscaler = scaling.autoscaler
        queue = self.queue
        assert queue is not None  # started by _main
        while True:
            await asyncio.sleep(autoscaler.args.metrics_interval_s)
            now = loop.time()
            running = [r for r in self.replicas.values() if r.pool == pool and not r.draining]
            queued = queue.num_queued_for(pool)
            slo = (queue.slo_report(pool, autoscaler.args.slo_percentile, autoscaler.args.slo_window_s)
                   if autoscaler.args.slo_targets else None)
            for replica in running:
                scheduler = replica.scheduler
                autoscaler.record(now, replica.replica_id, replica_stats(
                    scheduler.kv_ledger(), len(scheduler.running), len(scheduler.waiting), queued, slo))
            target = autoscaler.decide(now, [r.replica_id for r in running], scaling.target)
            scaling.starting = [task for task in scaling.starting if not task.done()]
            current = len(running) + len(scaling.starting)
            scaling.target = target
            if target > current:
                scaling.starting += [loop.create_task(self._start_replica(pool)) for _ in range(target - current)]
            while target < current and scaling.starting:  # Serve stops replicas still starting first
                scaling.starting.pop().cancel()
                current -= 1
            for replica in reversed(running[len(running) - (current - target):] if target < current else []):
                loop.create_task(self._drain(replica))

    async def _start_replica(self, pool: str) -> None:
        await asyncio.sleep(self.config.replica_start_s)
        self.add_replica(pool)

    async def _drain(self, replica: SimReplica) -> None:
        """Serve stops routing to it (the queue grants it nothing more: it reports not routable), it finishes what
        it holds, then it stops and gives its GPUs back."""
        replica.draining = True
        replica.report()
        self.scaling[replica.pool].autoscaler.forget(replica.replica_id)
        while replica.num_sequences:
            await asyncio.sleep(self.config.serve.kv_report_period_s)
        replica.stop()
        del self.replicas[replica.replica_id]
        self._replicas_changed()

    # ---- clients ----------------------------------------------------------------------------------------------

    async def _open_loop_unit(self, unit: list[TraceRequest]) -> None:
        loop = asyncio.get_running_loop()
        first = unit[0].timestamp_ms or 0.0
        await asyncio.sleep(max(0.0, first / 1000.0 - loop.time()))
        self._units_started += 1
        if self._units_started == self.num_units:
            self.recorder.load_ends(loop.time())
        await self._send_turns(unit)

    async def _closed_loop_client(self, units: Iterator[list[TraceRequest]]) -> None:
        for unit in units:
            await self._send_turns(unit)
        self.recorder.load_ends(asyncio.get_running_loop().time())

    async def _send_turns(self, unit: list[TraceRequest]) -> None:
        for index, request in enumerate(unit):
            if index and request.delay_ms:
                await asyncio.sleep(request.delay_ms / 1000.0)
            await self._send(request, index)
        self.units_done += 1

    async def _send(self, trace_request: TraceRequest, turn: int = 0) -> None:
        """One request's way through the ingress (module doc, step 2), until its last token or its refusal; `turn`:
        its index in its session (0: the first turn)."""
        loop = asyncio.get_running_loop()
        queue = self.queue
        assert queue is not None  # set before any client runs
        settings = self.config.serve
        ticket = f"t{self._next_ticket}"
        self._next_ticket += 1
        arrived = loop.time()
        record = self.recorder.arrived(ticket, arrived, trace_request.input_length, trace_request.session_id, turn)
        if self.config.request_latency_s:
            await asyncio.sleep(self.config.request_latency_s)
        max_tokens = trace_request.max_tokens or trace_request.output_length
        need = request_need(self._shapes, trace_request, max_tokens, self.config.trace_block_tokens)

        async def dispatch(grant: Granted, attempt: int) -> Dispatched[SimReplica]:
            """EngineReplica.generate on the granted SimReplica: it takes the request, or reports, then refuses."""
            replica = self.replicas[grant.replica_id]
            request = Request(ticket, PromptTokens(trace_request.input_length),  # type: ignore[arg-type]  # dcpserve.simulator.tokens: a list in all the scheduler asks
                              SamplingParams(max_tokens=max_tokens, detokenize=False), arrival_time=arrived)
            request.block_hashes = list(need.block_names[replica.pool])
            try:
                replica.accept(request, trace_request.output_length)
            except KvFull as full:
                replica.report()
                return Refused(grant.replica_id, full.free_blocks)
            except RequestRejected as err:
                return Rejected(grant.replica_id, str(err))
            return Taken(Accepted(grant.replica_id), replica)

        try:
            admitted = await admit(ticket, need.need, ask=need.ask, level=session_level(trace_request.session_id),
                                   arrived=arrived,
                                   admission=SimAdmission(queue, settings.retry_after_s), dispatch=dispatch,
                                   settings=AdmitSettings(settings.queue_timeout_s, settings.retry_after_s))
        except ApiError as err:
            queue.release(ticket)  # the ingress' finally: a grant it held last goes back
            self.recorder.refuse(record, err.code or "rejected", loop.time())
            return
        replica_id, replica = admitted.grant.replica_id, admitted.stream
        self.recorder.accepted(record, loop.time())
        record.replica_id = replica_id
        done = self._finishing[ticket] = loop.create_future()
        self._records[ticket] = record
        try:
            await asyncio.wait_for(done, settings.request_timeout_s - (loop.time() - arrived))
            self.recorder.finished(record, loop.time(), held_kv=True)
        except TimeoutError:  # request_timeout_s: the ingress answers 504 and the replica frees its KV
            replica.abort(ticket)
            self.recorder.timed_out(record, loop.time())
        finally:
            self._finishing.pop(ticket, None)
            self._records.pop(ticket, None)
            queue.release(ticket, *served_latencies(record))

    # ---- tokens (the replicas' TokenSink) ---------------------------------------------------------------------

    def tokens(self, updates: list[TokenUpdate], now: float) -> None:
        records, token = self._records, self.recorder.token
        for update in updates:
            request_id = update.request.request_id
            record = records.get(request_id)
            if record is None:
                continue
            token(record, now)
            if update.finished:
                done = self._finishing.get(request_id)
                if done is not None and not done.done():
                    done.set_result(None)

    def lane_tokens(self, count: int, gap_s: float) -> None:
        self.recorder.lane_tokens(count, gap_s)

    def lane_left(self, request_id: str, count: int, last_token_at: float) -> None:
        record = self._records.get(request_id)
        if record is not None:
            self.recorder.lane_left(record, count, last_token_at)

    # ---- samples and progress ---------------------------------------------------------------------------------

    async def _sample_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._sample(loop.time())
            self._progress(loop.time())
            await asyncio.sleep(self.config.sample_period_s)

    def _sample(self, now: float) -> None:
        replicas = list(self.replicas.values())
        used = sum(r.block_manager.usage().used / r.block_manager.num_blocks for r in replicas)
        queued = self.queue.num_queued if self.queue is not None else 0
        if self.queue is not None:
            granted = sum(len(r.grants) for r in self.queue.replicas.values())
            self.peak_granted = max(self.peak_granted, granted)
        self.recorder.samples.append((now, len(replicas), used / len(replicas) if replicas else 0.0,
                                      self.recorder.sequences, queued))

    def _label(self) -> str:
        return f"{self.config.progress_label}: " if self.config.progress_label else ""

    def _progress(self, now: float, final: bool = False) -> None:
        out = self.config.progress
        if out is None:
            return
        wall = time.perf_counter()
        if not final and wall - self._last_progress < self.config.progress_wall_s:
            return
        self._last_progress = wall
        print(f"{self._label()}simulated {now:9.1f} s  sessions {self.units_done}/{self.num_units}  requests "
              f"{len(self.recorder.records)} sent  sequences {self.recorder.sequences}  replicas "
              f"{len(self.replicas)}  wall {wall - self._wall_start:.1f} s", file=out, flush=True)


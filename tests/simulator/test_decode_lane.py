"""The decode lane (dcpserve/simulator/decode_lane.py) against the real scheduler row by row: at every step the same
work, block tables, ledger and prefix cache; over whole simulations the same records, to the last float."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from dcpserve.engine.config import SchedulerConfig
from dcpserve.engine.core.block_manager import BlockManager
from dcpserve.engine.core.request import Request, RequestStatus
from dcpserve.engine.core.scheduler import Scheduler
from dcpserve.engine.protocol import KvLedger
from dcpserve.engine.sampling_params import SamplingParams
from dcpserve.simulator.decode_lane import LaneScheduler
from dcpserve.simulator.host_tier import HostTierShape, TieredBlockManager
from dcpserve.simulator.replica import EOS_TOKEN, FILLER_TOKEN, ReplicaShape, SimReplica
from dcpserve.simulator.run import ServeSettings, Simulation, SimulationConfig
from dcpserve.simulator.step_fit import LinearStepModel
from dcpserve.simulator.step_time import StepWork
from dcpserve.simulator.synth import PRESETS, generate
from dcpserve.simulator.tokens import PromptTokens
from dcpserve.simulator.trace import TraceRequest, expected_hash_ids

STEP_MODEL = LinearStepModel(c0=2e-3, c_tok=20e-6, c_seq=0.0, c_ctx=1e-9, c_pair=0.0)
TIER = HostTierShape(num_blocks=800, bytes_per_block_per_rank=100_000, load_bytes_per_s=5e9, offload_bytes_per_s=5e9)


class _Pair:
    """The real scheduler and the lane's on identical block managers, fed the same requests and tokens."""

    def __init__(self, num_blocks: int, config: SchedulerConfig, tier: bool) -> None:
        def manager() -> BlockManager:
            if tier:
                return TieredBlockManager(num_blocks, 16, 2, dataclasses.replace(TIER, num_blocks=num_blocks))
            return BlockManager(num_blocks, 16, 2, enable_prefix_caching=True)

        self.lengths: list[dict[str, int]] = [{}, {}]
        self.real = Scheduler(config, manager(), frozenset({EOS_TOKEN}))
        self.lane = LaneScheduler(config, manager(), frozenset({EOS_TOKEN}), self.lengths[1], FILLER_TOKEN)

    def add(self, name: str, prompt: int, outputs: int, max_tokens: int = 1000) -> None:
        for scheduler, lengths in zip((self.real, self.lane), self.lengths, strict=True):
            request = Request(name, PromptTokens(prompt), SamplingParams(max_tokens=max_tokens))  # type: ignore[arg-type]  # a list in all the scheduler asks
            request.block_hashes = [hash((name, index)) & (1 << 64) - 1 for index in range(prompt // 32)]
            scheduler.add_request(request)
            lengths[name] = outputs

    def step(self) -> tuple[int, int]:
        """One step of each; asserts they agree; returns (rows, of them the lane's)."""
        works, updates = [], []
        for scheduler, lengths in zip((self.real, self.lane), self.lengths, strict=True):
            output = scheduler.schedule()
            work = StepWork.from_rows((e.start_position, len(e.token_ids)) for e in output.scheduled)
            if scheduler is self.lane:
                if self.lane.lane_rows:
                    work = work.with_decodes(self.lane.lane_rows, self.lane.lane_context_tokens)
            works.append(work)
            sampled = {e.request_id: EOS_TOKEN if e.num_output_tokens + 1 >= lengths[e.request_id] else FILLER_TOKEN
                       for e in output.scheduled if e.sample}
            done = scheduler.update(output, sampled)
            updates.append(sorted((u.request.request_id, u.token_id, u.finished) for u in done if u.finished))
        assert works[0] == works[1]
        assert updates[0] == updates[1]
        self.check()
        return works[1].num_seqs, self.lane.lane_tokens

    def check(self) -> None:
        real, lane = self.real, self.lane
        assert real.kv_ledger() == lane.kv_ledger()
        assert [r.request_id for r in real.running] == [r.request_id for r in lane.running]
        for request in real.running:
            twin = lane.requests[request.request_id]
            assert request.block_ids == twin.block_ids
            assert request.num_cached_blocks == twin.num_cached_blocks
        real_manager, lane_manager = real.block_manager, lane.block_manager
        assert real_manager._cached == lane_manager._cached
        assert list(real_manager._evictable) == list(lane_manager._evictable)
        assert real_manager.reporter is not None and lane_manager.reporter is not None
        assert real_manager.reporter.state == lane_manager.reporter.state
        if isinstance(real_manager, TieredBlockManager) and isinstance(lane_manager, TieredBlockManager):
            assert real_manager.take_copies() == lane_manager.take_copies()
            assert list(real_manager.tier._lru) == list(lane_manager.tier._lru)


@pytest.mark.parametrize("tier", [False, True])
def test_every_step_reads_the_same_state_with_the_lane(tier: bool) -> None:
    """Requests of different lengths arrive while others decode, the pool fills (preemptions, evictions into the
    tier), some are aborted mid-decode: after every step both schedulers hold the same block tables, ledger, cached
    blocks and reports, and the lane carried most of the tokens."""
    config = SchedulerConfig(max_model_len=8192, max_num_seqs=16, max_num_batched_tokens=256, admission="usage")
    pair = _Pair(90, config, tier)
    rows = lane_rows = 0
    for index in range(40):
        pair.add(f"r{index}", prompt=100 + 37 * index % 300, outputs=60 + 53 * index % 400)
        for _ in range(1 + index % 7):
            step_rows, step_lane = pair.step()
            rows, lane_rows = rows + step_rows, lane_rows + step_lane
        if index % 9 == 4:  # an abort of a running request (mid-lane, most likely)
            victim = pair.real.running[len(pair.real.running) // 2].request_id
            assert pair.real.abort_request(victim) == pair.lane.abort_request(victim)
            pair.check()
    while pair.real.has_unfinished:
        step_rows, step_lane = pair.step()
        rows, lane_rows = rows + step_rows, lane_rows + step_lane
    assert not pair.lane.has_unfinished and pair.lane.lane_size == 0
    assert pair.real.num_preemptions == pair.lane.num_preemptions > 0
    assert lane_rows > 0.8 * rows, (lane_rows, rows)
    # Every request's outputs, once finished, are the same list as the real scheduler's.
    assert pair.lane.block_manager.usage() == pair.real.block_manager.usage()


def test_a_token_budget_below_the_running_requests_steps_them_one_by_one() -> None:
    """With more running decodes than the step's token budget some wait each step: the lane steps aside (every
    request leaves it) and the steps stay the real scheduler's."""
    config = SchedulerConfig(max_model_len=8192, max_num_seqs=32, max_num_batched_tokens=12, admission="usage")
    pair = _Pair(400, config, tier=False)
    for index in range(20):
        pair.add(f"r{index}", prompt=8, outputs=30 + index)
    while pair.real.has_unfinished:
        pair.step()
    assert not pair.lane.has_unfinished


def _records(simulation: Simulation) -> dict[str, tuple[Any, ...]]:
    return {ticket: dataclasses.astuple(record) for ticket, record in simulation.recorder.records.items()}


def _single_turns(count: int, gap_ms: float, output_tokens: int) -> list[TraceRequest]:
    requests = []
    for index in range(count):
        length = 1500 + (index * 7919) % 1500
        ids = tuple(range(index * 1000, index * 1000 + expected_hash_ids(length)))
        requests.append(TraceRequest(index * gap_ms, length, output_tokens + (index * 31) % output_tokens, ids))
    return requests


@dataclasses.dataclass(frozen=True)
class Case:
    num_blocks: int
    block_size: int
    host_tier: bool
    trace: Callable[[], list[TraceRequest]]
    concurrency: int | None = None  # closed loop; None: the trace's timestamps
    request_timeout_s: float = 1e9


CASES = {
    # Agentic sessions, closed loop, with the host tier: long decodes, prefixes reloaded.
    "agentic+tier": Case(1200, 64, True, lambda: generate(PRESETS["agentic"], 240, seed=1), concurrency=48),
    # An open-loop burst past the KV: preemptions, recomputes, evictions into the tier.
    "burst+tier": Case(400, 16, True, lambda: _single_turns(300, 20.0, 600)),
    # Request timeouts: aborts of decoding requests.
    "timeouts": Case(400, 16, False, lambda: _single_turns(300, 20.0, 600), request_timeout_s=15.0),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_simulation_gives_the_same_records_with_and_without_the_lane(name: str) -> None:
    case = CASES[name]
    scheduler = SchedulerConfig(max_model_len=262144, max_num_seqs=64, max_num_batched_tokens=2048, admission="usage")
    shape = ReplicaShape(tp=2, dcp=2, num_blocks=case.num_blocks, block_size=case.block_size, scheduler=scheduler,
                         host_tier=TIER if case.host_tier else None)
    serve = ServeSettings(max_queued_requests=100_000, queue_timeout_s=1e9, request_timeout_s=case.request_timeout_s)
    runs = []
    for use_lane in (False, True):
        config = SimulationConfig(shape, num_replicas=2, serve=serve, decode_lane=use_lane,
                                  concurrency=case.concurrency)
        simulation = Simulation(config, STEP_MODEL)
        runs.append((simulation, simulation.run(case.trace())))
    (real, real_summary), (lane, lane_summary) = runs
    assert _records(real) == _records(lane)
    assert real_summary == lane_summary
    assert real.recorder.itl_counts == lane.recorder.itl_counts
    assert all(r.lane is not None and r.lane.lane_size == 0 for r in lane.replicas.values())
    if name == "timeouts":
        assert real_summary["refused"].get("request_timeout", 0) > 0
    if name == "burst+tier":
        assert real_summary["preemptions"] > 0
    # Nothing is left running or held after the drain.
    for replica in lane.replicas.values():
        assert replica.block_manager.usage().used == 0
        assert all(r.status is not RequestStatus.RUNNING for r in replica.scheduler.requests.values())


LEDGER_CASES = {  # CASES' agentic and timeouts, smaller: every ledger read is checked against a fresh one
    "agentic+tier": Case(1200, 64, True, lambda: generate(PRESETS["agentic"], 24, seed=1), concurrency=8),
    "timeouts": Case(400, 16, False, lambda: _single_turns(120, 20.0, 600), request_timeout_s=6.0),
}


@pytest.mark.parametrize("use_lane", [False, True])
@pytest.mark.parametrize("name", sorted(LEDGER_CASES))
def test_the_ledger_a_replica_keeps_between_steps_is_the_one_it_would_build(
        name: str, use_lane: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """SimReplica.kv_ledger builds the ledger once between two changes of the scheduler's state and extends it at
    each accept: every time an accept or a report reads it, it equals the scheduler's own, built then."""
    case = LEDGER_CASES[name]
    scheduler = SchedulerConfig(max_model_len=262144, max_num_seqs=64, max_num_batched_tokens=2048, admission="usage")
    shape = ReplicaShape(tp=2, dcp=2, num_blocks=case.num_blocks, block_size=case.block_size, scheduler=scheduler,
                         host_tier=TIER if case.host_tier else None)
    # Reports more often than steps (the shortest is 2 ms): every step's ledger is read, also after the last one.
    serve = ServeSettings(max_queued_requests=100_000, queue_timeout_s=1e9, request_timeout_s=case.request_timeout_s,
                          kv_report_period_s=1.5e-3)
    kept = 0
    kv_ledger = SimReplica.kv_ledger

    def checked(replica: SimReplica) -> KvLedger:
        nonlocal kept
        kept += replica._ledger is not None
        ledger = kv_ledger(replica)
        assert ledger == replica.scheduler.kv_ledger()
        return ledger

    monkeypatch.setattr(SimReplica, "kv_ledger", checked)
    config = SimulationConfig(shape, num_replicas=2, serve=serve, concurrency=case.concurrency, decode_lane=use_lane)
    simulation = Simulation(config, STEP_MODEL)
    summary = simulation.run(case.trace())
    assert kept > 0  # reads between two steps found the ledger kept
    if name == "timeouts":
        assert summary["refused"].get("request_timeout", 0) > 0
    for replica in simulation.replicas.values():  # idle after its last step: what a report would read now
        assert not replica.kv_ledger().per_request

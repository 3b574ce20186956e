"""The KV ledger's remembered cached runs of waiting requests (BlockManager.cached_run): after any sequence of
admissions, steps, evictions, host-tier moves, preemptions and aborts, the ledger built from them equals the one
every request's fresh lookup gives; and the ledger a burst of adds is checked against (Scheduler.ledger_with, one add
at a time) equals the one built after them."""

from __future__ import annotations

import random

import pytest

from dcpserve.engine.config import SchedulerConfig
from dcpserve.engine.core.block_manager import BlockManager
from dcpserve.engine.core.host_tier import HostTier
from dcpserve.engine.core.request import Request, RequestStatus
from dcpserve.engine.core.scheduler import Scheduler
from dcpserve.engine.protocol import KvLedger
from dcpserve.engine.sampling_params import SamplingParams
from dcpserve.simulator.host_tier import HostTierShape, TieredBlockManager

EOS = 0


def fresh_ledger(scheduler: Scheduler) -> KvLedger:
    """The ledger from each request's own lookups (committed_blocks and _prefill_left walk the cache every call)."""
    requests = list(scheduler.requests.values())
    per_request = {r.request_id: scheduler.committed_blocks(r) for r in requests}
    return KvLedger(
        admission=scheduler.config.admission, capacity_blocks=scheduler.block_manager.num_blocks,
        tokens_per_block=scheduler.block_manager.tokens_per_block, used_blocks=scheduler.block_manager.usage().used,
        committed_blocks=sum(per_request.values()),
        headroom_blocks=scheduler.headroom_blocks(num_sequences=len(per_request)), per_request=per_request,
        prefill_tokens=sum(scheduler._prefill_left(r) for r in requests))


def block_manager(tier: str) -> BlockManager:
    """No tier, the engine's host tier, or the simulator's (dcpserve/simulator/host_tier.py: its own pool, counted
    in the ledger through hosted_run)."""
    if tier == "simulator":
        return TieredBlockManager(48, 4, 2, HostTierShape(24, 1, 1.0, 1.0))
    return BlockManager(48, 4, 2, enable_prefix_caching=True, host_tier=HostTier(24) if tier == "engine" else None)


@pytest.mark.parametrize("tier", ["none", "engine", "simulator"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_ledger_from_remembered_runs_equals_fresh_lookups(seed: int, tier: str) -> None:
    rng = random.Random(seed)
    config = SchedulerConfig(max_model_len=4096, max_num_seqs=6, max_num_batched_tokens=96, admission="usage")
    manager = block_manager(tier)
    scheduler = Scheduler(config, manager, frozenset({EOS}))
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(8, 60))] for _ in range(5)]
    remembered = hosted = 0
    for index in range(160):
        ledger = scheduler.kv_ledger()
        for burst in range(rng.choice([0, 0, 1, 1, 3])):  # new requests: a shared prefix (often), a tail of its own
            prompt = list(rng.choice(prefixes)) if rng.random() < 0.8 else []
            prompt += [rng.randrange(1, 50) for _ in range(rng.randrange(1, 30))]
            request = Request(f"r{index}.{burst}", prompt, SamplingParams(max_tokens=rng.randrange(1, 160)))
            need = scheduler.committed_blocks(request)
            scheduler.add_request(request)
            ledger = scheduler.ledger_with(ledger, request, need)  # the engine core's check of a burst of adds
            assert ledger == scheduler.kv_ledger()
        if scheduler.requests and rng.random() < 0.08:  # an abort, running or waiting
            scheduler.abort_request(rng.choice(sorted(scheduler.requests)))
        for _ in range(rng.randrange(1, 4)):
            output = scheduler.schedule()
            sampled = {e.request_id: EOS if rng.random() < 0.01 else rng.randrange(1, 50)
                       for e in output.scheduled if e.sample}
            scheduler.update(output, sampled)
            assert scheduler.kv_ledger() == fresh_ledger(scheduler)
            remembered += len(manager._runs)
            hosted += sum(manager.hosted_run(r, len(manager.find_cached(r))) > 0
                          for r in scheduler.requests.values() if r.status is RequestStatus.WAITING)
    while scheduler.has_unfinished:
        output = scheduler.schedule()
        scheduler.update(output, {e.request_id: rng.randrange(1, 50) for e in output.scheduled if e.sample})
        assert scheduler.kv_ledger() == fresh_ledger(scheduler)
    assert scheduler.num_preemptions > 0
    assert remembered > 0  # waiting requests' runs were remembered between steps
    assert (hosted > 0) == (tier != "none")  # waiting requests' runs went on into a host tier
    assert not manager._runs and not manager._readers  # nothing kept for requests that are gone
    assert all(r.status is not RequestStatus.WAITING for r in scheduler.requests.values())

"""Exactness of the host KV tier: tokens of requests served from the tier equal those of the same requests recomputed
(tier off, prefix caching off: a cold cache) and transformers' greedy tokens, at tp=1, tp=2 dcp=2 and tp=2 dcp=2
pcp=2, including a request preempted to the tier.

The device pool is tiny (POOL_BLOCKS logical blocks), so a later request's prefix must come back from the host
(the phases: tests/engine/host_tier_harness.py). The mechanism is asserted (swap-in counters, host hits, the tokens
computed), not only the tokens.

Multi-rank layouts run without Ray: the ranks are processes of the session's SpawnPool, each a ModelRunner in a gloo
group; rank 0 runs the LLMEngine (scheduler, block manager, host tier index) over an executor that broadcasts each
step to the peers (torch.distributed's world group), as the Ray worker group's step channel does.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dcpserve.cluster.tiny_model import write_tiny_model
from dcpserve.engine.core.engine import LLMEngine
from dcpserve.engine.core.host_tier import tier_layout
from dcpserve.engine.core.outputs import ModelRunnerOutput
from dcpserve.engine.core.step import SchedulerOutput
from dcpserve.engine.protocol import HostTierStats
from dcpserve.engine.worker.executor import InProcessExecutor
from dcpserve.engine.worker.model_runner import ModelRunner
from dcpserve.engine.worker.parallel import destroy_parallel_state, init_parallel_state
from tests.engine.host_tier_harness import (
    BLOCK_SIZE,
    POOL_BLOCKS,
    check,
    engine_args,
    hf_tokens,
    run_phases,
    run_together,
    tier_config,
)
from tests.spawn_pool import SpawnPool

LAYOUTS = {"tp2_dcp2": (2, 2, 1), "tp2_dcp2_pcp2": (2, 2, 2)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tier_tiny"), seed=0)


def _engine(model: Path, tier: bool, host_slots: int | None = None) -> LLMEngine:
    config = tier_config(engine_args(str(model), 1, 1, 1, tier).create_engine_config())
    if tier and host_slots is not None:
        config = replace(config, cache=replace(config.cache,
                                               host_tier_bytes=host_slots * tier_layout(config).bytes_per_block))
    engine = LLMEngine(config)
    assert engine.block_manager.num_blocks == POOL_BLOCKS
    return engine


def test_host_tier_serves_the_recomputed_tokens_at_tp1(tiny: Path) -> None:
    results = {}
    for tier in (True, False):
        engine = _engine(tiny, tier)
        try:
            results[tier] = run_phases(engine, BLOCK_SIZE)
        finally:
            engine.shutdown()
    check(results[True], results[False], hf_tokens(tiny, BLOCK_SIZE), BLOCK_SIZE)


@pytest.mark.parametrize("host_slots", [3, 64])
def test_a_random_shared_prefix_workload_on_a_tiny_pool_gives_the_cold_engines_tokens(tiny: Path,
                                                                                      host_slots: int) -> None:
    """Requests over three shared prefixes, batched so that admissions, evictions into the tier and reloads from it
    interleave within steps (several admitted per step, a block evicted and hit again in one step), with a tier that
    drops blocks (3 slots) and one that keeps them all: every request's tokens equal the cold engine's, and the tier
    served some of them."""
    gen = torch.Generator().manual_seed(3)

    def fresh(n: int) -> list[int]:
        return torch.randint(5, 500, (n,), generator=gen).tolist()

    bases = [fresh(4 * BLOCK_SIZE) for _ in range(3)]
    requests = {}
    for index in range(14):
        base = bases[int(torch.randint(0, 3, (1,), generator=gen))]
        keep = int(torch.randint(BLOCK_SIZE, len(base) + 1, (1,), generator=gen))
        tail = fresh(int(torch.randint(1, BLOCK_SIZE + 2, (1,), generator=gen)))
        requests[f"r{index}"] = (base[:keep] + tail, int(torch.randint(1, 6, (1,), generator=gen)))
    tokens: dict[bool, dict[str, list[int]]] = {}
    stats: dict[bool, HostTierStats | None] = {}
    for tier in (True, False):
        engine = _engine(tiny, tier, host_slots)
        try:
            tokens[tier] = {}
            for first in range(0, len(requests), 3):  # waves of three: the pool holds about two at once
                wave = dict(list(requests.items())[first:first + 3])
                tokens[tier].update(run_together(engine, wave))
            stats[tier] = engine.stats().host_tier
        finally:
            engine.shutdown()
    assert tokens[True] == tokens[False]
    on = stats[True]
    assert on is not None and on.hit_tokens_host > 0 and on.blocks_in > 0 and stats[False] is None
    assert on.capacity_blocks == host_slots and (on.host_drops > 0) == (host_slots == 3)


# ---- multi-rank, ranks as processes ----------------------------------------------------------------------------


class BroadcastExecutor(InProcessExecutor):
    """Rank 0's executor: each step goes to the peers over the world group, then runs on this rank's runner (the
    in-process executor's, whose copy-time and exchange properties it keeps)."""

    def __init__(self, runner: ModelRunner) -> None:  # the runner is built by the caller, with its parallel state
        self.runner = runner
        self.num_blocks = runner.num_blocks

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        dist.broadcast_object_list([output], src=0)
        return super().execute(output)

    def shutdown(self) -> None:
        return None  # the caller tears the ranks down


def _tier_rank(rank: int, model: str, tp: int, dcp: int, pcp: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    configs = {tier: tier_config(engine_args(model, tp, dcp, pcp, tier).create_engine_config())
               for tier in (True, False)}
    config = configs[True]
    parallel = init_parallel_state(tp, rank, dcp, config.model_config.num_key_value_heads, f"tcp://127.0.0.1:{port}",
                                   "gloo", 60.0, pcp_size=pcp, transport="gloo")
    try:
        runner = ModelRunner(config, parallel, torch.device("cpu"))
        runner.allocate_kv_cache(POOL_BLOCKS)
        runner.allocate_host_tier(config.cache.host_tier_blocks)
        if rank != 0:
            while True:
                box: list[Any] = [None]
                dist.broadcast_object_list(box, src=0)
                if box[0] is None:
                    break
                runner.execute(box[0])
            return
        results = {}
        try:
            for tier in (True, False):  # the same ranks and KV pages: the cold run after the tier's
                engine = LLMEngine(configs[tier], executor=BroadcastExecutor(runner))
                results[tier] = run_phases(engine, BLOCK_SIZE * dcp)
                engine.shutdown()
        finally:
            dist.broadcast_object_list([None], src=0)
        torch.save(results, Path(out_dir) / "results.pt")
    finally:
        dist.barrier()
        destroy_parallel_state(parallel)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_host_tier_serves_the_recomputed_tokens_multirank(layout: str, tiny: Path, tmp_path: Path,
                                                          spawn_pool: SpawnPool) -> None:
    from bench.harness.model_harness import free_port

    tp, dcp, pcp = LAYOUTS[layout]
    spawn_pool.spawn(_tier_rank, (str(tiny), tp, dcp, pcp, free_port(), str(tmp_path)), tp * pcp)
    results = torch.load(tmp_path / "results.pt", weights_only=False)
    check(results[True], results[False], hf_tokens(tiny, BLOCK_SIZE * dcp), BLOCK_SIZE * dcp)

"""Prefix caching on the Ray worker group (a local cluster with logical GPUs): a logical block is block_size * dcp
tokens, one page on every rank of the DCP group, so a hit hands every rank the pages it wrote for that run, and the
request's own tokens start on a page boundary of every rank. A cached run must give exactly the uncached run's
greedy tokens and logprobs at tp=2 x dcp=2 and tp=4 x dcp=4 (the scenario of tests/engine/prefix_harness.py: a
prefix ending inside a block and on a boundary, a prompt that is all cached prefix, a 1-token prefill, chunked
prefill after the hit, penalties over the cached prefix), and a request preempted under usage admission must come
back after its own cached blocks to the same tokens."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from dcpserve.cluster.tiny_model import write_tiny_model
from dcpserve.engine.frontend.llm import LLM
from tests.engine.llm_parts import engine_of
from tests.engine.prefix_harness import (
    check_preempted_request_hits_its_own_blocks,
    exactness_scenario,
    run_cached_and_compare,
    run_reference,
)

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.timeout(300)]

BLOCK_SIZE = 4  # tokens per page on one rank: logical blocks of 4 * dcp tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def skip_without_gpus(ray_module: ModuleType, tp: int) -> None:
    if ray_module.cluster_resources().get("GPU", 0) < tp:
        pytest.skip(f"needs {tp} (logical) GPUs")


@pytest.mark.parametrize("tp,dcp", [(2, 2), (4, 4)])
def test_cached_run_equals_uncached_run(tp: int, dcp: int, tiny: Path, ray_cluster) -> None:
    skip_without_gpus(ray_cluster, tp)
    tpb = BLOCK_SIZE * dcp
    steps = exactness_scenario(tpb)
    args = dict(tensor_parallel_size=tp, decode_context_parallel_size=dcp, block_size=BLOCK_SIZE)
    with LLM(tiny, enable_prefix_caching=False, **args) as llm:  # each prompt in one chunk
        reference = run_reference(llm, steps)
    with LLM(tiny, max_num_batched_tokens=tpb + 3, **args) as llm:  # chunks that straddle logical blocks
        assert engine_of(llm).block_manager.tokens_per_block == tpb
        hit = run_cached_and_compare(llm, reference, f"tp={tp} dcp={dcp}")
    assert hit > 0


def test_preempted_request_hits_its_own_blocks_when_readmitted_at_tp2_dcp2(tiny: Path, ray_cluster) -> None:
    skip_without_gpus(ray_cluster, 2)
    check_preempted_request_hits_its_own_blocks(tiny, BLOCK_SIZE, tp=2, dcp=2)


@pytest.mark.parametrize("tp,dcp,pcp", [(1, 2, 2), (2, 4, 2)])
def test_prefill_context_parallel_cached_run_equals_one_rank(tp: int, dcp: int, pcp: int, tiny: Path,
                                                              ray_cluster) -> None:
    """PCP through the whole engine (scheduler, persistent batch, worker group of tp * pcp ranks): the prefix
    scenario's cached run with its chunks split across PCP groups gives the tokens and logprobs of one rank with
    no cache, whose pages hold the same block_size * dcp tokens."""
    skip_without_gpus(ray_cluster, tp * pcp)
    tpb = BLOCK_SIZE * dcp
    steps = exactness_scenario(tpb)
    with LLM(tiny, enable_prefix_caching=False, block_size=tpb) as llm:
        reference = run_reference(llm, steps)
    with LLM(tiny, tensor_parallel_size=tp, decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp,
             block_size=BLOCK_SIZE, max_num_batched_tokens=tpb + 3) as llm:
        assert engine_of(llm).block_manager.tokens_per_block == tpb
        hit = run_cached_and_compare(llm, reference, f"tp={tp} dcp={dcp} pcp={pcp}")
    assert hit > 0


def test_preempted_request_hits_its_own_blocks_when_readmitted_at_pcp2_dcp2(tiny: Path, ray_cluster) -> None:
    skip_without_gpus(ray_cluster, 2)
    check_preempted_request_hits_its_own_blocks(tiny, BLOCK_SIZE, tp=1, dcp=2, pcp=2)


def test_pcp_multiplies_kv_capacity_by_tp_times_pcp_over_kv_heads(tiny: Path, ray_cluster) -> None:
    """tp=2 x pcp=2 with dcp=4 shards the tiny model's one KV head over all 4 ranks: the same pages per rank hold
    tp * pcp / kv_heads = 4 times the tokens of tp=2, pcp=1, dcp=1 (both of whose ranks hold every token); every
    rank reports its share."""
    skip_without_gpus(ray_cluster, 4)
    args = dict(block_size=BLOCK_SIZE, kv_cache_memory_bytes=64 * BLOCK_SIZE * 512, enable_prefix_caching=False)
    with LLM(tiny, tensor_parallel_size=2, **args) as llm:
        plain = llm.kv_capacity_tokens
    with LLM(tiny, tensor_parallel_size=2, decode_context_parallel_size=4, prefill_context_parallel_size=2,
             **args) as llm:
        assert llm.kv_capacity_tokens == 4 * plain
        stats = engine_of(llm).stats()
        assert [r.dcp_rank for r in stats.per_rank] == [0, 1, 2, 3]  # TP ranks 0, 1 of PCP group 0, then group 1

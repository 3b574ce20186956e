"""The host KV tier on the Ray worker group (a local cluster with logical GPUs) at tp=2 dcp=2: each rank allocates its
host pool beside its KV cache, every step's copies reach every rank over its step channel, and the ranks' copy
seconds come back with their replies. The phases and checks of tests/engine/host_tier_harness.py: the tier's tokens
equal the cold engine's and transformers', with the swap-ins, host hits and fewer computed tokens they imply."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from dcpserve.cluster.tiny_model import write_tiny_model
from dcpserve.engine.core.host_tier import tier_layout
from dcpserve.engine.frontend.llm import LLM
from tests.engine.host_tier_harness import (
    BLOCK_SIZE,
    HOST_SLOTS,
    POOL_BLOCKS,
    check,
    engine_args,
    hf_tokens,
    run_phases,
)
from tests.engine.llm_parts import engine_of, worker_group_of

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tier_ray"), seed=0)


def test_host_tier_on_the_worker_group_serves_the_recomputed_tokens(tiny: Path, ray_cluster: ModuleType) -> None:
    if ray_cluster.cluster_resources().get("GPU", 0) < 2:
        pytest.skip("needs 2 (logical) GPUs")
    tp, dcp = 2, 2
    page = tier_layout(engine_args(str(tiny), tp, dcp, 1, True).create_engine_config()).bytes_per_block
    results = {}
    for tier in (True, False):
        args = engine_args(str(tiny), tp, dcp, 1, tier)
        kwargs = {name: getattr(args, name) for name in (
            "tensor_parallel_size", "decode_context_parallel_size", "block_size", "max_num_seqs", "device",
            "enable_prefix_caching", "admission")}
        with LLM(tiny, kv_cache_memory_bytes=POOL_BLOCKS * page, kv_host_tier=HOST_SLOTS * page if tier else None,
                 **kwargs) as llm:
            engine = engine_of(llm)
            assert engine.block_manager.num_blocks == POOL_BLOCKS and worker_group_of(llm).num_blocks == POOL_BLOCKS
            results[tier] = run_phases(engine, BLOCK_SIZE * dcp)
    check(results[True], results[False], hf_tokens(tiny, BLOCK_SIZE * dcp), BLOCK_SIZE * dcp)
    assert results[True]["host_tier"].capacity_blocks == HOST_SLOTS
    assert results[True]["host_tier"].seconds_in > 0 and results[True]["host_tier"].seconds_out > 0

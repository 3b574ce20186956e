"""The multi-rank engine on a real local Ray cluster (logical GPUs): TP x DCP worker groups produce the same
greedy tokens as Hugging Face transformers, and DCP multiplies KV capacity and concurrent long sequences."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from dcpserve.cluster.tiny_model import write_tiny_model
from dcpserve.engine.frontend.llm import LLM
from dcpserve.engine.sampling_params import SamplingParams
from tests.engine.llm_checks import dcp_capacity_and_concurrency, hf_greedy
from tests.engine.llm_parts import engine_of

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def hf_expected(tiny: Path) -> dict[tuple[int, ...], list[int]]:
    return hf_greedy(tiny, PROMPTS, 24)


PROMPTS = [[7], list(range(10, 42)), list(range(100, 171)), [300, 301, 302]]  # 1 token, 2 blocks, 71, short


def skip_without_gpus(ray_module: ModuleType, tp: int) -> None:
    if ray_module.cluster_resources().get("GPU", 0) < tp:
        pytest.skip(f"needs {tp} (logical) GPUs")


@pytest.mark.parametrize("tp,dcp", [(2, 1), (2, 2), (4, 2), (4, 4)])
def test_worker_group_greedy_equals_transformers(tp: int, dcp: int, tiny: Path, hf_expected, ray_cluster) -> None:
    skip_without_gpus(ray_cluster, tp)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(tiny, tensor_parallel_size=tp, decode_context_parallel_size=dcp, max_num_batched_tokens=40) as llm:
        outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
        stats = engine_of(llm).stats()
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_expected[tuple(prompt)], f"tp={tp} dcp={dcp} prompt of {len(prompt)}"
    assert stats.tp == tp and stats.dcp == dcp and len(stats.per_rank) == tp
    assert stats.kv_blocks_used == 0  # everything finished and freed


def test_preempted_requests_recompute_to_the_same_greedy_tokens_at_tp2_dcp2(tiny: Path, hf_expected,
                                                                           ray_cluster) -> None:
    """usage admission over a pool that cannot hold every sequence at its end: requests are preempted and
    recomputed, and every one still gives transformers' greedy tokens."""
    skip_without_gpus(ray_cluster, 2)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # block_size 4 at dcp 2: 8-token logical blocks; 32 KiB per rank = 64 tokens per rank = 16 blocks (128 tokens)
    # against 25 + 56 + 95 + 27 tokens at the end.
    with LLM(tiny, tensor_parallel_size=2, decode_context_parallel_size=2, block_size=4,
             kv_cache_memory_bytes=32 << 10, admission="usage", kv_headroom=0.0) as llm:
        outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
        stats = engine_of(llm).stats()
    assert stats.kv_blocks_total == 16 and stats.num_preemptions > 0, stats
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_expected[tuple(prompt)], f"prompt of {len(prompt)}"
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_reserved == 0


def test_dcp_multiplies_capacity_and_concurrency(tiny: Path, ray_cluster) -> None:
    """Same per-rank KV memory, 1 KV head, tp=4: dcp=4 holds exactly 4x the tokens of dcp=1 and runs 4x as many
    long sequences at once."""
    skip_without_gpus(ray_cluster, 4)
    budget = 256 << 10  # per rank: 2 layers * 1 KV head * 32 dims * 2 (K, V) * 4 bytes = 512 B/token -> 512 tokens
    capacity, concurrency = dcp_capacity_and_concurrency(tiny, budget)
    assert capacity[1] == 512 and capacity[4] == 4 * capacity[1]
    assert concurrency[1] == 4 and concurrency[4] == 16

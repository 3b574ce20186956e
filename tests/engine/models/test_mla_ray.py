"""The tiny DeepSeek-V2 (MLA + MoE) through the whole engine on a real local Ray cluster (logical GPUs): a TP=4 x
DCP=4 worker group produces transformers' greedy tokens, and DCP multiplies the latent cache's capacity and the
concurrent long sequences exactly 4-fold at the same per-rank memory."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch

from dcpserve.cluster.tiny_model import write_tiny_mla_model
from dcpserve.engine.config import ModelConfig
from dcpserve.engine.frontend.llm import LLM
from dcpserve.engine.sampling_params import SamplingParams
from tests.engine.llm_checks import dcp_capacity_and_concurrency
from tests.engine.llm_parts import engine_of

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.timeout(300)]

PROMPTS = [[7], list(range(10, 42)), list(range(100, 171)), [300, 301, 302]]  # 1 token, 2 blocks, 71, short
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def tiny_mla(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_mla_model(tmp_path_factory.mktemp("tiny_mla"), seed=0)


def hf_greedy_ignoring_eos(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens, exactly max_tokens of them, an EOS taken like any token (as ignore_eos does)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               eos_token_id=None)[0, len(p):].tolist() for p in prompts]


def skip_without_gpus(ray_module: ModuleType, tp: int) -> None:
    if ray_module.cluster_resources().get("GPU", 0) < tp:
        pytest.skip(f"needs {tp} (logical) GPUs")


def test_tp4_dcp4_greedy_equals_transformers(tiny_mla: Path, ray_cluster) -> None:
    skip_without_gpus(ray_cluster, 4)
    expected = hf_greedy_ignoring_eos(tiny_mla, PROMPTS, MAX_TOKENS)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(tiny_mla, tensor_parallel_size=4, decode_context_parallel_size=4, max_num_batched_tokens=40) as llm:
        outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
        stats = engine_of(llm).stats()
    for prompt, output, tokens in zip(PROMPTS, outputs, expected, strict=True):
        assert output.outputs[0].token_ids == tokens, f"prompt of {len(prompt)}"
    assert stats.tp == 4 and stats.dcp == 4 and stats.kv_blocks_used == 0


def test_dcp_multiplies_latent_cache_capacity_and_concurrency(tiny_mla: Path, ray_cluster) -> None:
    """Same per-rank KV memory at tp=4: every rank caches the whole latent, so dcp=1 holds each token 4 times and
    dcp=4 holds exactly 4x the tokens, and runs 4x the long sequences at once."""
    skip_without_gpus(ray_cluster, 4)
    per_token = ModelConfig.from_pretrained(tiny_mla).kv_bytes_per_token_per_rank(4, torch.float32)
    assert per_token == 3 * (40 + 12) * 4  # 3 layers of one latent head, no V cache, the same at any tp
    budget = 512 * per_token  # per rank: 512 tokens at dcp=1
    capacity, concurrency = dcp_capacity_and_concurrency(tiny_mla, budget)
    assert capacity[1] == 512 and capacity[4] == 4 * capacity[1]
    assert concurrency[1] == 4 and concurrency[4] == 16

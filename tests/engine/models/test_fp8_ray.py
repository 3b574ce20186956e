"""The tiny DeepSeek-V3 FP8 checkpoint through the whole engine on a real local Ray cluster (logical GPUs): a TP=4 x
DCP=4 worker group, each rank loading its FP8 shard from the safetensors file, produces the greedy tokens of the
dequantized twin run on one rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.harness.model_harness import Job, Scenario, run_job
from dcpserve.engine.config import ModelConfig
from dcpserve.engine.frontend.llm import LLM
from dcpserve.engine.sampling_params import SamplingParams
from dcpserve.engine.worker.parallel import ParallelState
from tests.engine.models.test_fp8 import fp8_pair  # noqa: F401 - the module's checkpoints, here too
from tests.engine.models.test_mla_ray import skip_without_gpus
from tests.engine.models.test_model_vs_hf import BLOCK_SIZE

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.timeout(300)]

PROMPTS = [[7], list(range(10, 42)), list(range(100, 171))]  # 1 token, 2 blocks, 71
MAX_TOKENS = 12


def test_tp4_dcp4_engine_generates_the_twins_greedy_tokens(fp8_pair: tuple[Path, Path],  # noqa: F811
                                                           ray_cluster, tmp_path: Path) -> None:
    skip_without_gpus(ray_cluster, 4)
    fp8, twin = fp8_pair
    job = Job("twin", str(twin), (Scenario(tuple(tuple(p) for p in PROMPTS), 16, MAX_TOKENS),))
    expected = run_job(job, ModelConfig.from_pretrained(twin), ParallelState.single(1), 1, tmp_path,
                       BLOCK_SIZE)["tokens"]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(fp8, tensor_parallel_size=4, decode_context_parallel_size=4, max_num_batched_tokens=40) as llm:
        outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    for prompt, output, tokens in zip(PROMPTS, outputs, expected, strict=True):
        assert output.outputs[0].token_ids == tokens, f"prompt of {len(prompt)}"

"""Llama-family FP8 block-quantized checkpoints (the format of Qwen3's FP8 releases) through the same linear layers:
the tiny Llama quantized to float8_e4m3fn + block scales produces its dequantized twin's greedy tokens and logits, and
at tp = 2 each rank's q / k / v (k and v replicated: one KV head), o and MLP shards dequantize to the twin's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.harness.model_harness import Job, Scenario, run_job
from dcpserve.cluster.tiny_fp8 import write_tiny_fp8_llama_model
from dcpserve.engine.config import ModelConfig
from dcpserve.engine.layers.linear_method import dequantize_weight
from dcpserve.engine.quantization import Fp8BlockQuantization
from dcpserve.engine.worker.loader import load_model
from dcpserve.engine.worker.parallel import ParallelState
from tests.engine.models.test_fp8 import assert_same_generation
from tests.engine.models.test_model_vs_hf import BLOCK_SIZE, prompt


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fp8_llama")
    return write_tiny_fp8_llama_model(root / "fp8", root / "twin", seed=1)


def test_single_rank_fp8_llama_equals_its_dequantized_twin(llama_pair: tuple[Path, Path], tmp_path: Path) -> None:
    assert ModelConfig.from_pretrained(llama_pair[0]).quantization == Fp8BlockQuantization(16, 16)
    scenario = Scenario((prompt(1), prompt(BLOCK_SIZE), prompt(2 * BLOCK_SIZE + 3)), BLOCK_SIZE + 1, 12)
    results = []
    for name, path in zip(("fp8", "twin"), llama_pair, strict=True):
        job = Job(name, str(path), (scenario,))
        results.append(run_job(job, ModelConfig.from_pretrained(path), ParallelState.single(1), 1, tmp_path,
                               BLOCK_SIZE))
    assert_same_generation(results[0], results[1], "llama tp=1")


def test_each_rank_holds_consistent_weight_and_scale_shards(llama_pair: tuple[Path, Path]) -> None:
    fp8, twin = llama_pair
    config, twin_config = ModelConfig.from_pretrained(fp8), ModelConfig.from_pretrained(twin)
    for rank in range(2):
        parallel = ParallelState(tp_size=2, tp_rank=rank, dcp_size=1, dcp_rank=0, num_kv_heads=1)
        params = dict(load_model(fp8, config, parallel, torch.float32, torch.device("cpu")).named_parameters())
        theirs = dict(load_model(twin, twin_config, parallel, torch.float32, torch.device("cpu")).named_parameters())
        quantized = [name for name, param in params.items() if param.dtype == torch.float8_e4m3fn]
        assert len(quantized) == 4 * config.num_hidden_layers  # qkv, o, gate_up, down
        for name in quantized:
            dense = dequantize_weight(params[name], params[name + "_scale_inv"], config.quantization, torch.float32)
            assert torch.equal(dense, theirs[name]), f"rank {rank}: {name}"

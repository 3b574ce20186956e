"""Each real config the native engine serves (tests/engine/real_configs/, tests/engine/test_real_configs.py), shrunk
with every structural flag kept (tests/engine/models/shrink.py), against transformers on the same random weights:
greedy tokens equal and logits within LOGITS_ATOL on the harness' prompts (token 0 among them), which run past the
shrunk original context where a rope scaling applies. A config with FP8 weights is run in its real format with
its blocks shrunk as its sizes are (weight_block_size [16, 16]: the shrunk sizes are multiples of 16 as the real
ones are of 128, so gate and up of a merged projection each start on a block; the latents' widths end in partial
blocks): the engine loads the FP8 checkpoint, transformers the same weights dequantized (fp8 value x block scale).
The tensor-parallel layouts run the GQA models where TP duplicates their KV heads (tp 4, dcp 2); the FP8 layouts are
tests/engine/models/test_fp8.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.harness.model_harness import Job, free_port, run_job, run_rank
from dcpserve.cluster.tiny_fp8 import quantize_state
from dcpserve.engine.config import ModelConfig, ParallelConfig
from dcpserve.engine.worker.parallel import ParallelState
from tests.engine.models.hf_compare import BLOCK_SIZE, check_against_hf, scenarios
from tests.engine.models.shrink import write_shrunk_checkpoint
from tests.engine.models.test_model_vs_hf import one_torch_thread  # noqa: F401 - its autouse fixture, here too
from tests.engine.test_real_configs import QWEN3_CARD_YARN, SERVED, real_config
from tests.spawn_pool import SpawnPool

# The served configs, and Qwen3 as its model card sets it up for 128k (YaRN, factor 4).
VARIANTS: dict[str, dict[str, Any]] = {name: {} for name in SERVED}
VARIANTS["qwen3-8b+yarn"] = {"rope_scaling": QWEN3_CARD_YARN}
SHRUNK_FP8_BLOCK = (16, 16)


def quantize_checkpoint(directory: Path, fp8_directory: Path, block: tuple[int, int]) -> None:
    """`directory` rewritten with its decoder weights after an FP8 round trip (what transformers reads), and
    `fp8_directory` the same model in DeepSeek's FP8 format (what the engine reads)."""
    import json

    fp8_directory.mkdir()
    state = load_file(directory / "model.safetensors")
    quantized, dequantized = quantize_state(state, block)
    assert len(quantized) > len(state), "no weight was quantized"
    save_file(dequantized, directory / "model.safetensors", metadata={"format": "pt"})
    save_file(quantized, fp8_directory / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((directory / "config.json").read_text())
    quantization = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": list(block)}
    (fp8_directory / "config.json").write_text(json.dumps({**raw, "quantization_config": quantization}))


@pytest.fixture(scope="module")
def shrunk(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """name -> (what the engine loads, what transformers loads): the same directory unless the model is FP8."""
    root = tmp_path_factory.mktemp("shrunk")
    paths = {}
    for index, (name, change) in enumerate(sorted(VARIANTS.items())):
        raw = {**real_config(name.split("+")[0]), **change}
        reference = write_shrunk_checkpoint(raw, root / name, seed=index)
        engine = reference
        if raw.get("quantization_config"):
            assert raw["quantization_config"]["weight_block_size"] == [128, 128]
            engine = root / f"{name}-fp8"
            quantize_checkpoint(reference, engine, SHRUNK_FP8_BLOCK)
        paths[name] = (engine, reference)
    return paths


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_shrunk_real_config_matches_transformers(name: str, shrunk: dict[str, tuple[Path, Path]],
                                                 tmp_path: Path) -> None:
    engine, reference = shrunk[name]
    config = ModelConfig.from_pretrained(engine)
    assert (config.quantization is not None) == (engine != reference)
    job = Job(name, str(engine), scenarios(1))
    results = run_job(job, config, ParallelState.single(config.num_key_value_heads), 1, tmp_path, BLOCK_SIZE)
    check_against_hf(Job(name, str(reference), job.scenarios), results)


@pytest.mark.timeout(240)
def test_shrunk_gqa_configs_at_tp4_dcp2_match_transformers(shrunk: dict[str, tuple[Path, Path]], tmp_path: Path,
                                                           spawn_pool: SpawnPool) -> None:
    """TP 4 over the shrunk models' 2 KV heads keeps 2 copies of each, as TP 8 does over Qwen3-MoE's 4: DCP 2
    shards them. Every rank's tokens and logits are rank 0's, bit for bit."""
    tp, dcp = 4, 2
    names = [name for name, (engine, reference) in sorted(shrunk.items())
             if engine == reference and ModelConfig.from_pretrained(engine).mla is None]
    for name in names:
        ParallelConfig(tp, dcp).validate(ModelConfig.from_pretrained(shrunk[name][0]))
    jobs = [Job(name, str(shrunk[name][0]), scenarios(dcp)) for name in names]
    spawn_pool.spawn(run_rank, (tp, dcp, 1, free_port(), jobs, str(tmp_path), BLOCK_SIZE), tp)
    for job in jobs:
        per_rank = [torch.load(tmp_path / job.result_file(r)) for r in range(tp)]
        check_against_hf(job, per_rank[0])
        for rank, other in enumerate(per_rank[1:], start=1):
            assert other["tokens"] == per_rank[0]["tokens"], f"{job.name}: rank {rank} sampled other tokens"

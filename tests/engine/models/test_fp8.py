"""DeepSeek-V3 FP8 block-quantized checkpoints in the native engine, against their dequantized twin (the same weights
after the fp8 round trip, float32, no quantization_config; dcpserve/cluster/tiny_fp8.py): greedy tokens equal and
logits within the FP8 GEMM test's fp32 bound at (tp, dcp) = (1, 1), (2, 2), (4, 4); every FP8 weight held at 1 byte
per parameter plus its float32 block scales, and each rank's shard of weight and scales consistent at tp = 4; damaged
files refused by file and tensor."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.harness.model_harness import Job, Scenario, free_port, run_job, run_rank
from dcpserve.cluster.tiny_fp8 import TINY_V3_SPEC, write_tiny_fp8_model
from dcpserve.engine.config import ModelConfig, ParallelConfig
from dcpserve.engine.layers.fp8_experts import Fp8TensorParallelExperts
from dcpserve.engine.layers.linear_method import dequantize_weight
from dcpserve.engine.models import DeepseekV2ForCausalLM
from dcpserve.engine.quantization import Fp8BlockQuantization
from dcpserve.engine.worker.loader import load_model
from dcpserve.engine.worker.parallel import ParallelState
from tests.engine.models.test_model_vs_hf import BLOCK_SIZE, prompt
from tests.kernels.test_fp8_gemm import TOLERANCE
from tests.spawn_pool import SpawnPool

MAX_NEW_TOKENS = 12
LOGITS_RTOL = TOLERANCE[torch.float32]  # of the largest |logit|, as the GEMM test bounds its outputs


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fp8")
    return write_tiny_fp8_model(root / "fp8", root / "twin", seed=0)


def scenarios(dcp: int) -> tuple[Scenario, ...]:
    """Prompts of 1 token, one logical block and several, prefilled in chunks that cut blocks, then decoded."""
    block = BLOCK_SIZE * dcp
    prompts = (prompt(1), prompt(block), prompt(2 * block + 3))
    return (Scenario(prompts, prefill_chunk=block + 1, max_new_tokens=MAX_NEW_TOKENS),)


def assert_same_generation(fp8: dict[str, list], twin: dict[str, list], where: str) -> None:
    assert fp8["tokens"] == twin["tokens"], f"{where}: the FP8 checkpoint's greedy tokens differ from its twin's"
    for ours, theirs in zip(fp8["logits"], twin["logits"], strict=True):
        error = float((ours - theirs).abs().max() / theirs.abs().max())
        assert error <= LOGITS_RTOL, f"{where}: logits differ by {error:.2e} of the largest"


def test_config_reads_fp8_block_quantization(fp8_pair: tuple[Path, Path]) -> None:
    from dcpserve.cluster.published_models import DEEPSEEK_V3

    fp8, twin = fp8_pair
    config = ModelConfig.from_pretrained(fp8)
    assert config.architecture == "DeepseekV3ForCausalLM" and config.quantization == Fp8BlockQuantization(16, 16)
    assert config.moe is not None and config.moe.topk_method == "noaux_tc"
    assert ModelConfig.from_pretrained(twin).quantization is None
    assert ModelConfig.from_dict(DEEPSEEK_V3).quantization == Fp8BlockQuantization(128, 128)


def test_single_rank_fp8_equals_its_dequantized_twin(fp8_pair: tuple[Path, Path], tmp_path: Path) -> None:
    results = []
    for name, path in zip(("fp8", "twin"), fp8_pair, strict=True):
        job = Job(name, str(path), scenarios(1))
        results.append(run_job(job, ModelConfig.from_pretrained(path), ParallelState.single(1), 1, tmp_path,
                               BLOCK_SIZE))
    assert_same_generation(results[0], results[1], "tp=1")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp,dcp", [(2, 2), (4, 4)])
def test_multi_rank_fp8_equals_its_dequantized_twin(tp: int, dcp: int, fp8_pair: tuple[Path, Path], tmp_path: Path,
                                                   spawn_pool: SpawnPool) -> None:
    ParallelConfig(tp, dcp).validate(ModelConfig.from_pretrained(fp8_pair[0]))
    jobs = [Job(name, str(path), scenarios(dcp)) for name, path in zip(("fp8", "twin"), fp8_pair, strict=True)]
    spawn_pool.spawn(run_rank, (tp, dcp, 1, free_port(), jobs, str(tmp_path), BLOCK_SIZE), tp)
    fp8, twin = ([torch.load(tmp_path / job.result_file(rank)) for rank in range(tp)] for job in jobs)
    assert_same_generation(fp8[0], twin[0], f"tp={tp} dcp={dcp}")
    assert all(rank["tokens"] == fp8[0]["tokens"] for rank in fp8[1:])


def test_parameter_bytes_by_dtype_match_the_checkpoint(fp8_pair: tuple[Path, Path]) -> None:
    """tp=1: every FP8 checkpoint weight is an fp8 parameter of its numel (1 byte each) and every scale a float32
    one, but kv_b_proj, dequantized at load for the absorbed attention (its numel in float32, its scales gone)."""
    fp8, _ = fp8_pair
    model = load_model(fp8, ModelConfig.from_pretrained(fp8), ParallelState.single(1), torch.float32,
                       torch.device("cpu"))
    held: dict[torch.dtype, int] = {}
    for param in model.parameters():
        held[param.dtype] = held.get(param.dtype, 0) + param.numel() * param.element_size()
    tensors = load_file(str(fp8 / "model.safetensors"))
    kv_b = {name: t for name, t in tensors.items() if ".kv_b_proj." in name}
    fp8_bytes = sum(t.numel() for name, t in tensors.items() if t.dtype == torch.float8_e4m3fn and name not in kv_b)
    float_numel = sum(t.numel() for name, t in tensors.items() if t.dtype == torch.float32 and name not in kv_b)
    kv_b_numel = sum(t.numel() for t in kv_b.values() if t.dtype == torch.float8_e4m3fn)
    assert held == {torch.float8_e4m3fn: fp8_bytes, torch.float32: 4 * (float_numel + kv_b_numel)}
    experts = [m for m in model.modules() if isinstance(m, Fp8TensorParallelExperts)]
    assert len(experts) == 2 and all(m.w13.dtype == m.w2.dtype == torch.float8_e4m3fn for m in experts)


def test_each_rank_holds_consistent_weight_and_scale_shards(fp8_pair: tuple[Path, Path]) -> None:
    """tp=4, every rank: each FP8 weight dequantized with its rank's scales equals the twin's shard at that rank."""
    fp8, twin = fp8_pair
    config, twin_config = ModelConfig.from_pretrained(fp8), ModelConfig.from_pretrained(twin)
    for rank in range(4):
        parallel = ParallelState(tp_size=4, tp_rank=rank, dcp_size=1, dcp_rank=0, num_kv_heads=1)
        ours = load_model(fp8, config, parallel, torch.float32, torch.device("cpu"))
        theirs = dict(load_model(twin, twin_config, parallel, torch.float32, torch.device("cpu")).named_parameters())
        params = dict(ours.named_parameters())
        checked = 0
        for name, param in params.items():
            if param.dtype != torch.float8_e4m3fn:
                continue
            scale = params[name + "_scale_inv"]
            dense = dequantize_weight(param, scale, config.quantization, torch.float32)
            assert torch.equal(dense, theirs[name]), f"rank {rank}: {name}"
            checked += 1
        # q_a, q_b, kv_a, o and the MLP's two (the dense layer); the same, less the MLP, plus the shared experts' two
        # and the routed w13 / w2 (the two MoE layers). kv_b_proj is dense (below).
        assert checked == 6 + 2 * 8
        for name, param in params.items():  # kv_b_proj: dequantized at load, the twin's shard
            if ".kv_b_proj." in name:
                assert torch.equal(param, theirs[name])


def test_a_tp_split_off_the_fp8_blocks_is_refused(fp8_pair: tuple[Path, Path]) -> None:
    config = ModelConfig.from_pretrained(fp8_pair[0])
    coarse = dataclasses.replace(config, quantization=Fp8BlockQuantization(32, 32))
    parallel = ParallelState(tp_size=4, tp_rank=1, dcp_size=1, dcp_rank=0, num_kv_heads=1)
    with pytest.raises(ValueError, match=r"ColumnParallelLinear\(output_size=192\) at tp=4: this rank's 48 rows "
                                         r"\(output features\) from 48 of 192.*blocks of 32"):
        DeepseekV2ForCausalLM(coarse, parallel, torch.float32, torch.device("cpu"))


def damaged_copy(fp8: Path, directory: Path, edit: str) -> Path:
    shutil.copytree(fp8, directory)
    path = directory / "model.safetensors"
    if edit == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) - 1000])
        return path
    tensors = load_file(str(path))
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    if edit == "nan":
        raw = tensors[name].view(torch.uint8).clone()
        raw[3, 7] = 0x7F
        tensors[name] = raw.view(torch.float8_e4m3fn)
    elif edit == "scale":
        tensors[name + "_scale_inv"][0, 1] = float("inf")
    else:
        tensors[name] = tensors[name].to(torch.float32)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("edit,message", [
    ("truncate", r"checkpoint file {path} cannot be read: the file is truncated: .* tensor '.*'"),
    ("nan", r"checkpoint file {path}: tensor 'model.layers.1.mlp.experts.5.up_proj.weight' holds 1 NaN"),
    ("scale", r"checkpoint file {path}: FP8 block scales 'model.layers.1.mlp.experts.5.up_proj.weight_scale_inv' "
              r"must be finite and positive, found \[inf\]"),
    ("float", r"'model.layers.1.mlp.experts.5.up_proj.weight' is torch.float32 but the model holds it as "
              r"torch.float8_e4m3fn"),
])
def test_a_damaged_fp8_file_names_file_and_tensor(edit: str, message: str, fp8_pair: tuple[Path, Path],
                                                  tmp_path: Path) -> None:
    path = damaged_copy(fp8_pair[0], tmp_path / edit, edit)
    config = ModelConfig.from_pretrained(path.parent)
    with pytest.raises(ValueError, match=message.format(path=str(path).replace(".", r"\."))):
        load_model(path.parent, config, ParallelState.single(1), torch.float32, torch.device("cpu"))


def test_spec_shards_on_16_blocks_up_to_tp_4() -> None:
    """The writer's shrunk V3: per-rank sizes at tp = 4 are whole 16-blocks (else the tp=4 test could not run)."""
    spec = TINY_V3_SPEC
    per_rank = [spec.num_attention_heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim) // 4,
                spec.num_attention_heads * (spec.qk_nope_head_dim + spec.v_head_dim) // 4,
                spec.num_attention_heads * spec.v_head_dim // 4, spec.intermediate_size // 4,
                spec.moe_intermediate_size // 4]
    assert all(size % 16 == 0 for size in per_rank), per_rank

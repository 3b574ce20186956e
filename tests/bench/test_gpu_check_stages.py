"""The CPU-runnable parts of bench/gpu_check.py's in-process stages: the DCP-emulated kernel check (the Triton kernels
under the interpreter in fp32, and the torch references) at small sizes, with teeth; the GPU spec table; the prefill
FLOP count; the model stage at the tiny model's widths."""

from __future__ import annotations

import pytest
import torch

from bench.gpu_dcp import DcpCase, Heads, check_case, shard_tokens
from bench.gpu_model import tiny_widths
from bench.gpu_perf import (
    GPU_SPECS,
    LLAMA3_8B_ATTENTION,
    decode_markdown,
    decode_rates,
    gpu_spec,
    prefill_flops,
    prefill_seconds,
    versions,
)
from bench.gpu_stages import dcp_kernels_stage, model_stage
from bench.kernels import Shape
from dcpserve.kernels.layout import dcp_local_seq_lens

SMALL = Heads(num_q_heads=4, num_kv_heads=2, head_dim=16)
CPU = torch.device("cpu")
CASES = [DcpCase("decode", 100, 1, batch=2), DcpCase("decode", 100, 3, batch=2, interleave=2),
         DcpCase("decode", 67, 4, batch=1), DcpCase("prefill", 70, 2, batch=2, new_tokens=5)]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.label)
def test_sharded_attention_merged_by_combine_equals_the_unsharded_reference(case: DcpCase, impl: str) -> None:
    result = check_case(case, SMALL, torch.float32, CPU, impl)  # type: ignore[arg-type]  # "torch" / "triton"
    assert result.passed and result.out_rel_err < 1e-5 and result.lse_err < 1e-5, result


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_a_shard_missing_one_token_is_caught(kind: str) -> None:
    case = DcpCase(kind, 64, 2, batch=2, new_tokens=4 if kind == "prefill" else 1)  # type: ignore[arg-type]
    result = check_case(case, SMALL, torch.float32, CPU, "torch", drop=lambda positions: positions[1:])
    assert not result.passed and result.out_rel_err > 1e-3


def test_the_shards_are_the_engines_layout() -> None:
    """Each rank's tokens are as many as the engine's local length, and together every token exactly once."""
    for dcp, interleave in ((2, 1), (4, 2), (8, 16)):
        shards = [shard_tokens(1000, dcp, rank, interleave, CPU) for rank in range(dcp)]
        assert torch.equal(torch.cat(shards).sort().values, torch.arange(1000))
        for rank, shard in enumerate(shards):
            assert shard.numel() == int(dcp_local_seq_lens(torch.tensor([1000]), dcp, rank, interleave)[0])


def test_the_stage_reports_each_case_and_fails_on_a_wrong_one() -> None:
    report = dcp_kernels_stage(CPU, CASES[:2], SMALL, torch.float32)
    assert report.passed and report.key.startswith("2/2 cases within tolerance")
    assert sum(line.startswith("| decode 100") for line in report.lines) == 2


def test_gpu_specs_by_device_name() -> None:
    assert gpu_spec("NVIDIA H100 80GB HBM3").memory_bps == 3.35e12  # type: ignore[union-attr]
    assert gpu_spec("NVIDIA H100 PCIe").memory_bps == 2.0e12  # type: ignore[union-attr]
    assert gpu_spec("NVIDIA H100 NVL").memory_bps == 3.9e12  # type: ignore[union-attr]
    assert gpu_spec("NVIDIA H200").memory_bps == 4.8e12  # type: ignore[union-attr]
    assert gpu_spec("NVIDIA A100-SXM4-80GB") is None


def test_prefill_flops_count_every_attended_pair() -> None:
    context, new = 7, 5
    pairs = sum(context + j + 1 for j in range(new))  # query j sees the context and new tokens 0..j
    heads, width = LLAMA3_8B_ATTENTION.num_q_heads, LLAMA3_8B_ATTENTION.head_dim
    assert prefill_flops(context, new, LLAMA3_8B_ATTENTION) == 4 * heads * width * pairs


def test_the_model_stage_at_tiny_widths() -> None:
    """The same code as on the GPU (write, two engines step by step, KV sizing); on CPU both engines are eager."""
    report = model_stage(CPU, tiny_widths(), batches=(1, 2), rounds=1)
    assert report.passed, report
    assert "tokens graphs = eager at 2/2 batches" in report.key
    table = [line for line in report.lines if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(table) == 2 and all("| yes |" in line for line in table)
    assert "random weights, float32, tp=1" in report.lines[0]  # 'auto' on CPU (on CUDA: the checkpoint's bf16)
    assert "pages of 16" in report.lines[1] and "512 bytes per token" in report.lines[1]  # 2 layers x (K, V) x 32 x 4


def test_decode_rates_and_prefill_timing_run_their_gpu_code_path_at_small_sizes() -> None:
    """bench/kernels.py's GPU path of measure_row (the Triton kernel checked against the reference, then timed) and
    the prefill call, here under the interpreter in fp32: the shares are computed from the given bandwidths."""
    small = Shape("small", "2 KV heads, 4 query heads, head_dim 16", 2, 4, 16)
    spec = GPU_SPECS["H100"]
    rates = decode_rates(CPU, 1e9, spec, rows=((64, 2),), shape=small, dtype=torch.float32, repeats=2)
    (rate,) = rates
    assert rate.correct and rate.max_err is not None and rate.max_err < 1e-4
    assert rate.kv_bps == pytest.approx(small.kv_bytes_read(2, 64, torch.float32) / rate.seconds)
    assert rate.spec_share == pytest.approx(rate.kv_bps / 3.35e12)
    assert rate.copy_share == pytest.approx(rate.kv_bps / 1e9)
    table = decode_markdown(rates, spec)
    assert "% of spec 3.35 TB/s" in table[0] and table[2].startswith("| 64 | 2 |")
    assert prefill_seconds(32, 8, small, CPU, repeats=2, dtype=torch.float32) > 0


def test_versions_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    info = versions()
    assert info["torch"] == torch.__version__ and "no CUDA" in info["device"]

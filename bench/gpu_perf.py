"""GPU check stages: what the device is (versions, memory, measured copy bandwidth) and how fast the attention
kernels run on it: decode attention in KV GB/s, as a share of the GPU's spec memory bandwidth and of the measured
copy bandwidth; prefill attention in TFLOP/s and as a share of the spec bf16 dense peak.

The timing, the copy bandwidth, the decode rows (each checked against the torch reference before it is timed) are
bench/kernels.py's; only the model shape (Llama-3-8B's attention at tp = 1) and the prefill timing are new here.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from dataclasses import dataclass

import torch

from bench.kernels import COPY_BYTES, FLUSH_BYTES, Shape, copy_bandwidth, measure_row, median_seconds
from dcpserve.kernels._triton import HAS_TRITON, triton


@dataclass(frozen=True)
class GpuSpec:
    """A GPU's published HBM bandwidth (bytes/s) and dense bf16 tensor-core peak (FLOP/s, without sparsity)."""

    name: str
    memory_bps: float
    bf16_flops: float


# Sources: NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100, "H100 SXM / H100 NVL" table: 3.35 TB/s and
# 989 TFLOPS bf16 dense for SXM, 3.9 TB/s and 835 for NVL); the H100 PCIe product brief (PB-11133: 2.0 TB/s, 756
# TFLOPS bf16 dense); NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200: 4.8 TB/s, 989 TFLOPS bf16 dense).
# The datasheets quote bf16 "with sparsity"; the dense figure is half. Matched in order: the first key that is a
# substring of torch.cuda.get_device_name().
GPU_SPECS: dict[str, GpuSpec] = {
    "H200": GpuSpec("H200 (SXM / NVL)", 4.8e12, 989e12),
    "H100 PCIe": GpuSpec("H100 PCIe", 2.0e12, 756e12),
    "H100 NVL": GpuSpec("H100 NVL", 3.9e12, 835e12),
    "H100": GpuSpec("H100 SXM", 3.35e12, 989e12),
}

LLAMA3_8B_ATTENTION = Shape("llama3-8b", "Llama-3-8B at tp=1: 8 KV heads, 32 query heads, head_dim 128, K and V caches",
                            8, 32, 128)
DECODE_ROWS = ((32768, 1), (32768, 8), (32768, 32), (131072, 1), (131072, 8))  # (context, batch)
PREFILL_ROWS = ((0, 8192), (28672, 4096))  # (cached context, new tokens), one sequence
REPEATS = 20


def gpu_spec(device_name: str) -> GpuSpec | None:
    """The spec of the GPU named `device_name` (torch's name, e.g. 'NVIDIA H100 80GB HBM3'), None if not listed."""
    return next((spec for key, spec in GPU_SPECS.items() if key in device_name), None)


def driver_version() -> str:
    """The NVIDIA driver's version by nvidia-smi ('n/a' without it)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "n/a"
    done = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                          text=True, timeout=20, check=False)
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else "n/a"


def versions() -> dict[str, str]:
    """torch, triton, CUDA, driver, the device's name and memory (the CPU's name without CUDA)."""
    info = {"torch": torch.__version__, "triton": triton.__version__ if HAS_TRITON else "not installed",
            "CUDA": str(torch.version.cuda), "python": platform.python_version()}
    if not torch.cuda.is_available():
        return {**info, "device": f"CPU {platform.machine()} (no CUDA)"}
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    spec = gpu_spec(props.name)
    return {**info, "driver": driver_version(), "device": props.name,
            "compute capability": f"{props.major}.{props.minor}", "SMs": str(props.multi_processor_count),
            "memory": f"{total / 2**30:.1f} GiB ({free / 2**30:.1f} free)",
            "spec": f"{spec.name}: {spec.memory_bps / 1e12:.2f} TB/s, {spec.bf16_flops / 1e12:.0f} TFLOP/s bf16"
            if spec is not None else "not in GPU_SPECS"}


def measured_copy_bps(device: torch.device) -> float:
    """bench/kernels.py's copy bandwidth: a COPY_BYTES device-to-device copy, read + write, median of 10."""
    return copy_bandwidth(device, COPY_BYTES, 10)


@dataclass(frozen=True)
class DecodeRate:
    """One decode row: KV bytes read per second and its shares of the spec and the measured copy bandwidth."""

    context: int
    batch: int
    seconds: float
    kv_bps: float
    spec_share: float | None
    copy_share: float
    max_err: float | None
    correct: bool


def decode_rates(device: torch.device, copy_bps: float, spec: GpuSpec | None,
                 rows: tuple[tuple[int, int], ...] = DECODE_ROWS, shape: Shape = LLAMA3_8B_ATTENTION,
                 dtype: torch.dtype = torch.bfloat16, repeats: int = REPEATS) -> list[DecodeRate]:
    """bench/kernels.py's measure_row (its GPU path: checked against the reference, then timed with L2 flushed before
    each call) over `rows` of (context, batch)."""
    flush = torch.empty(FLUSH_BYTES if device.type == "cuda" else 1, dtype=torch.uint8, device=device)
    rates = []
    for context, batch in rows:
        row = measure_row(shape, context, batch, dtype, repeats, flush, copy_bps)
        bps = row.kv_bytes / row.seconds
        rates.append(DecodeRate(context, batch, row.seconds, bps, bps / spec.memory_bps if spec else None,
                                bps / copy_bps, row.max_err, row.correct))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rates


def prefill_flops(context: int, new_tokens: int, shape: Shape) -> float:
    """Attention FLOPs of one chunk: QK^T and PV, 2 * 2 * head_dim per (query, key) pair per query head; the chunk
    attends all `context` cached tokens and itself causally."""
    pairs = new_tokens * context + new_tokens * (new_tokens + 1) // 2
    return 4.0 * shape.num_q_heads * shape.head_dim * pairs


def prefill_seconds(context: int, new_tokens: int, shape: Shape, device: torch.device, repeats: int = REPEATS,
                    dtype: torch.dtype = torch.bfloat16) -> float:
    """Median time of paged_prefill_attention for one sequence's chunk of new_tokens after `context` cached ones."""
    from dcpserve.kernels.prefill_attention import paged_prefill_attention

    block = 16
    pages = max(1, -(-context // block))
    cache_shape = (pages, block, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    v_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    table = torch.randperm(pages, device=device).view(1, pages).to(torch.int32)
    q = torch.randn(new_tokens, shape.num_q_heads, shape.head_dim, dtype=dtype, device=device)
    key = torch.randn(new_tokens, shape.num_kv_heads, shape.head_dim, dtype=dtype, device=device)
    value = torch.randn_like(key)
    starts = torch.tensor([0, new_tokens], dtype=torch.int32, device=device)
    lens = torch.tensor([context], dtype=torch.int32, device=device)

    def call() -> object:
        return paged_prefill_attention(q, key, value, k_cache, v_cache, table, starts, lens, shape.head_dim**-0.5,
                                       new_tokens, validate=False)

    return median_seconds(call, repeats, device)


def decode_markdown(rates: list[DecodeRate], spec: GpuSpec | None) -> list[str]:
    spec_col = f"% of spec {spec.memory_bps / 1e12:.2f} TB/s" if spec else "% of spec"
    lines = [f"| context | batch | time (us) | KV GB/s | {spec_col} | % of copy BW | max abs err |",
             "|---:|---:|---:|---:|---:|---:|---|"]
    for r in rates:
        share = f"{100 * r.spec_share:.1f}%" if r.spec_share is not None else "n/a"
        err = "n/a" if r.max_err is None else f"{r.max_err:.1e}" + ("" if r.correct else " WRONG")
        lines.append(f"| {r.context} | {r.batch} | {r.seconds * 1e6:.1f} | {r.kv_bps / 1e9:.0f} | {share} | "
                     f"{100 * r.copy_share:.1f}% | {err} |")
    return lines

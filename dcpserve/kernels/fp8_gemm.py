"""Block-FP8 GEMM: y = x @ dequant(W)^T (+ bias) with W float8_e4m3fn [N, K] and one float32 inverse scale per
[block_n, block_k] block of W (DeepSeek-V3's `weight_scale_inv` [ceil(N / block_n), ceil(K / block_k)]; the last
blocks of a dimension may be partial). The dequantized weight is fp8 value * the scale of its block.

Activations stay in the model's dtype (activation_scheme "dynamic" without activation quantization): the kernel
loads a [BLOCK_K, BLOCK_N] tile of fp8 weights, widens it to the activations' dtype (exact: every e4m3 value is a
fp16, bf16 and fp32 value), multiplies it on the tensor cores with fp32 accumulation and scales each tile's partial
product by its column's block scale (one block_k block spans whole tiles, so the scale is constant along a tile's
reduction). `fp8_block_gemm_ref` is the same contract in plain torch: dequantize, then F.linear in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dcpserve.kernels._attention_common import MIN_TILE, NUM_STAGES, NUM_WARPS, dot_precision
from dcpserve.kernels._triton import jit, require_triton_device, tl, triton

FP8_DTYPE = torch.float8_e4m3fn
ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_block_size(block_size: tuple[int, int] | list[int]) -> tuple[int, int]:
    if (len(block_size) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                                        for n in block_size)):
        raise ValueError(f"block_size must be two positive integers [block_n, block_k], got {block_size!r}")
    return int(block_size[0]), int(block_size[1])


def _check_weight(weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int],
                  stacked: bool = False) -> None:
    """weight [N, K] (stacked: [..., N, K], e.g. a MoE layer's experts) and its scales [..., ceil(N / bn),
    ceil(K / bk)]."""
    if weight.dim() != 2 and not (stacked and weight.dim() > 2):
        raise ValueError(f"weight must be [out_features, in_features], got shape {tuple(weight.shape)}")
    if weight.dtype != FP8_DTYPE:
        raise TypeError(f"weight must be {FP8_DTYPE}, got {weight.dtype}; quantize it block-wise first")
    if scale_inv.dtype != torch.float32:
        raise TypeError(f"scale_inv must be float32, got {scale_inv.dtype}")
    *lead, n, k = weight.shape
    expected = (*lead, -(-n // block_size[0]), -(-k // block_size[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv of a {list(weight.shape)} weight in blocks of {list(block_size)} must be {list(expected)}, "
            f"got {list(scale_inv.shape)}"
        )


def _check_args(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int],
    bias: torch.Tensor | None,
) -> None:
    _check_weight(weight, scale_inv, block_size)
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"x must be one of {ACTIVATION_DTYPES}, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x [..., in_features] must end in in_features={weight.shape[1]}, got {tuple(x.shape)}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(
            f"bias must be [{weight.shape[0]}] of x's dtype {x.dtype}, got {tuple(bias.shape)} {bias.dtype}"
        )


def fp8_over_256_as_float16(weight: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn values widened to float16 by moving bits, exactly value / 256 (e4m3's exponent bias is 7,
    fp16's 15: the same exponent and mantissa bits, 8 binades lower; e4m3 subnormals land on fp16 subnormals). Several
    times faster on CPU than torch's fp8 cast. The NaN encodings (0x7f, 0xff) come out finite: the loader refuses
    them (dcpserve/engine/worker/loader.py)."""
    byte = weight.view(torch.uint8).to(torch.int16)
    return (((byte & 0x7F) << 7) | ((byte & 0x80) << 8)).view(torch.float16)


def dequantize_fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int] | list[int], dtype: torch.dtype
) -> torch.Tensor:
    """The dense weight [N, K] (or stacked [..., N, K]) in `dtype`: each fp8 value times the float32 scale of its
    block, the product in fp32 (bit for bit weight.float() * scale), rounded to dtype once."""
    block = _check_block_size(block_size)
    _check_weight(weight, scale_inv, block, stacked=True)
    *lead, n, k = weight.shape
    rows, cols = scale_inv.shape[-2:]
    widened = fp8_over_256_as_float16(weight).to(torch.float32)
    if n % block[0] or k % block[1]:  # whole blocks, so each scale broadcasts over a view of its block
        widened = F.pad(widened, (0, cols * block[1] - k, 0, rows * block[0] - n))
    blocks = widened.view(*lead, rows, block[0], cols, block[1])
    dense = (blocks * (scale_inv * 256.0)[..., :, None, :, None]).view(*lead, rows * block[0], cols * block[1])
    return dense[..., :n, :k].to(dtype).contiguous()


def fp8_block_gemm_ref(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int] | list[int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference of fp8_block_gemm: dequantize in fp32 (torch's own fp8 cast, scales expanded element-wise),
    F.linear in fp32, the result in x's dtype."""
    block = _check_block_size(block_size)
    _check_args(x, weight, scale_inv, block, bias)
    n, k = weight.shape
    scales = scale_inv.repeat_interleave(block[0], dim=0)[:n].repeat_interleave(block[1], dim=1)[:, :k]
    dense = weight.to(torch.float32) * scales
    out = F.linear(x.to(torch.float32), dense, bias.to(torch.float32) if bias is not None else None)
    return out.to(x.dtype)


@jit
def _fp8_block_gemm_kernel(  # type: ignore[no-untyped-def]  # a Triton kernel: its arguments are typed by Triton at launch
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    stride_om,
    stride_on,
    QUANT_BLOCK_N: tl.constexpr,
    QUANT_BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile; BLOCK_K divides QUANT_BLOCK_K, so one k-step reads one scale column."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # int64 rows and columns: M * K, M * N and N * K elements can pass 2^31 (launch_configs.OFFSET_AUDIT).
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]: W^T's tile
    scale_ptrs = scale_ptr + (offs_n // QUANT_BLOCK_N) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k + k0 < K
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        scale = tl.load(scale_ptrs + (k0 // QUANT_BLOCK_K) * stride_sk, mask=mask_n, other=0.0)
        acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION) * scale[None, :]
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _tile_k(block_k: int) -> int:
    """The largest power of two <= 128 dividing block_k (>= 16: tl.dot's least tile)."""
    tile = 128
    while tile > MIN_TILE and block_k % tile:
        tile //= 2
    if block_k % tile:
        raise ValueError(
            f"fp8_block_gemm needs block_k to be a multiple of {MIN_TILE} (tl.dot's least tile), got {block_k}; "
            f"use fp8_block_gemm_ref (or dequantize_fp8_block + F.linear) for this block size"
        )
    return tile


@dataclass(frozen=True)
class Fp8GemmTiles:
    """What fp8_block_gemm's launcher picks: the output tile [block_m, block_n], the reduction step block_k, and
    Triton's num_warps / num_stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = NUM_WARPS
    num_stages: int = NUM_STAGES


def fp8_gemm_tiles(m: int, quant_block_k: int) -> Fp8GemmTiles:
    """The tiles for m rows of activations and weight blocks quant_block_k wide (_tile_k)."""
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    return Fp8GemmTiles(block_m, 64, _tile_k(quant_block_k))


def fp8_block_gemm(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int] | list[int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] (fp32 / fp16 / bf16) @ dequant(weight [N, K] e4m3, scale_inv float32 per block)^T (+ bias [N])
    -> [..., N] in x's dtype, accumulated in fp32. block_size = [block_n, block_k] (block_k a multiple of 16)."""
    block = _check_block_size(block_size)
    _check_args(x, weight, scale_inv, block, bias)
    require_triton_device(x, weight, scale_inv, bias)
    if weight.stride(1) != 1 or x.stride(-1) != 1:
        raise ValueError(
            f"fp8_block_gemm needs unit stride along in_features: weight strides {weight.stride()}, x strides "
            f"{x.stride()}; pass .contiguous() tensors"
        )
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    if k == 0:
        out.zero_()
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], n)
    tiles = fp8_gemm_tiles(m, block[1])
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))
    _fp8_block_gemm_kernel[grid](
        x2, weight, scale_inv, bias if bias is not None else x2, out, m, n, k,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), scale_inv.stride(0), scale_inv.stride(1),
        out.stride(0), out.stride(1),
        QUANT_BLOCK_N=block[0], QUANT_BLOCK_K=block[1], HAS_BIAS=bias is not None,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, DOT_PRECISION=dot_precision(x.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out.view(*x.shape[:-1], n)

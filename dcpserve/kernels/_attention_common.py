"""Pieces shared by the paged attention kernels: argument checks and the Triton tile helpers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dcpserve.kernels._triton import jit, tl, triton, triton_interpreting


def check_paged_cache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    block_table: torch.Tensor,
    num_seqs: int,
    v_head_dim: int | None = None,
) -> int:
    """Validates q [*, num_q_heads, head_dim] against the paged caches and the block table; returns the value width.

    Values are the first v_head_dim (default: head_dim) channels of v_cache, or of k_cache when v_cache is None
    (MLA: one cache holds [latent, rope key] and the values are the latent)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens_or_seqs, num_q_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or (v_cache is not None and k_cache.shape != v_cache.shape):
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape) if v_cache is not None else None}"
        )
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"q has head_dim={head_dim} but the cache has head_dim={k_cache.shape[3]}")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads} (GQA/MQA)"
        )
    value_dtype = v_cache.dtype if v_cache is not None else k_cache.dtype
    if q.dtype != k_cache.dtype or k_cache.dtype != value_dtype:
        raise TypeError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {value_dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != num_seqs:
        raise ValueError(f"block_table must be [num_seqs={num_seqs}, max_blocks], got shape {tuple(block_table.shape)}")
    if block_table.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"block_table must be int32 or int64, got {block_table.dtype}")
    if v_head_dim is None:
        return head_dim
    if not isinstance(v_head_dim, int) or not 1 <= v_head_dim <= head_dim:
        raise ValueError(
            f"v_head_dim must be an integer in [1, head_dim={head_dim}] (values are the first v_head_dim channels "
            f"of the value cache), got {v_head_dim!r}"
        )
    return v_head_dim


def check_lengths(name: str, lens: torch.Tensor, num_seqs: int) -> None:
    if lens.shape != (num_seqs,):
        raise ValueError(f"{name} must be [num_seqs={num_seqs}], got shape {tuple(lens.shape)}")
    if lens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {lens.dtype}")


def gather_pages_ref(
    cache: torch.Tensor, pages: torch.Tensor, num_tokens: int, compute_dtype: torch.dtype
) -> torch.Tensor:
    """Torch helper: the first num_tokens slots of the pages listed in `pages` [P], as [num_tokens, H, D]."""
    block_size = cache.shape[1]
    needed = -(-num_tokens // block_size)
    if needed > pages.numel():
        raise ValueError(f"{num_tokens} cached tokens need {needed} pages but the block table row has {pages.numel()}")
    used = pages[:needed].to(torch.int64)
    if needed and (int(used.min()) < 0 or int(used.max()) >= cache.shape[0]):
        raise ValueError(
            f"block table names page {int(used.min()) if int(used.min()) < 0 else int(used.max())} "
            f"outside the cache's {cache.shape[0]} pages"
        )
    return cache[used].reshape(-1, *cache.shape[2:])[:num_tokens].to(compute_dtype)


def compute_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """Attention math runs in fp32, or fp64 when the inputs already are (useful for exact references)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dot_precision(dtype: torch.dtype) -> str | None:
    """fp32 inputs must not silently drop to TF32 on NVIDIA GPUs; other dtypes use the default."""
    return "ieee" if dtype == torch.float32 else None


# tl.dot wants every tile dimension >= 16.
MIN_TILE = 16


@dataclass(frozen=True)
class ChannelTiles:
    """How the Triton kernels cover one head's channels: the value channels [0, v_head_dim) in one tile of
    block_dv columns (read for the scores and, from the value source, for the output), and when the keys are wider
    (MLA: [latent, rope key]) the key-only rest [v_head_dim, head_dim) in a second tile of block_dr columns. Both
    are powers of two, masked past the real widths, so no width has to be one; MLA's 512 + 64 pads nothing."""

    block_dv: int
    block_dr: int
    has_rest: bool


def channel_tiles(head_dim: int, v_head_dim: int) -> ChannelTiles:
    rest = head_dim - v_head_dim
    return ChannelTiles(
        block_dv=max(MIN_TILE, triton.next_power_of_2(v_head_dim)),
        block_dr=max(MIN_TILE, triton.next_power_of_2(rest)) if rest > 0 else MIN_TILE,
        has_rest=rest > 0,
    )


def head_block_size(group: int, block_dv: int) -> int:
    """Query heads one decode program packs (all the heads of a KV head, up to a bound: MLA has every head on its
    one KV head, and a [heads, 512] fp32 accumulator must fit a program's registers)."""
    limit = 16 if block_dv >= 256 else 64
    return max(MIN_TILE, min(int(triton.next_power_of_2(group)), limit))


# What the launchers pass Triton for every attention kernel: its CUDA defaults, written down so that the launch
# configurations (dcpserve/kernels/launch_configs.py) compile exactly what runs.
NUM_WARPS = 4
NUM_STAGES = 3


def use_cuda_tiles(cuda_tiles: bool | None) -> bool:
    """The tile sizes to pick: CUDA's (True) or the interpreter's smaller ones (False); None: CUDA's unless the
    interpreter runs. Tests pass True to run the interpreter at the GPU's tile sizes."""
    return not triton_interpreting() if cuda_tiles is None else cuda_tiles


def default_block_n(block_dv: int = 0, cuda_tiles: bool | None = None) -> int:
    """Keys per tile: smaller for wide heads (the [BLOCK_N, 512] tiles of MLA) and under the interpreter."""
    if not use_cuda_tiles(cuda_tiles):
        return 32
    return 32 if block_dv >= 256 else 64


def shares_values(keys: torch.Tensor, values: torch.Tensor | None) -> bool:
    """True when the values are read from the keys themselves (values None, or the same memory as keys), so a
    kernel reads one tile for both."""
    return values is None or (values.data_ptr() == keys.data_ptr() and values.stride() == keys.stride())


@jit
def load_paged_tile(  # type: ignore[no-untyped-def]  # a Triton kernel: its arguments are typed by Triton at launch
    cache_ptr,
    block_table_row_ptr,
    tokens,
    token_mask,
    kv_head,
    d,
    d_mask,
    stride_b,
    stride_s,
    stride_h,
    block_size: tl.constexpr,
):
    """Loads cache rows for `tokens` (positions in this rank's local sequence) as a [BLOCK_N, BLOCK_D] tile of the
    channels `d`."""
    page = tl.load(block_table_row_ptr + tokens // block_size, mask=token_mask, other=0).to(tl.int64)
    offset = tokens % block_size
    ptrs = cache_ptr + page[:, None] * stride_b + offset[:, None] * stride_s + kv_head * stride_h + d[None, :]
    return tl.load(ptrs, mask=token_mask[:, None] & d_mask[None, :], other=0.0)


@jit
def tile_scores(q_v, k_v, q_r, k_r, scale, HAS_REST: tl.constexpr, DOT_PRECISION: tl.constexpr):  # type: ignore[no-untyped-def]  # a Triton kernel: its arguments are typed by Triton at launch
    """Scaled scores [rows, BLOCK_N] of a key tile: the value channels' dot product plus, for keys wider than the
    values, the rest's (q_r / k_r are ignored without HAS_REST)."""
    s = tl.dot(q_v, tl.trans(k_v), input_precision=DOT_PRECISION)
    if HAS_REST:
        s += tl.dot(q_r, tl.trans(k_r), input_precision=DOT_PRECISION)
    return s * scale


@jit
def online_softmax_step(s, v, visible, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):  # type: ignore[no-untyped-def]  # a Triton kernel: its arguments are typed by Triton at launch
    """One flash-attention step over a key tile's scaled scores s [rows, BLOCK_N] and values v [BLOCK_N, BLOCK_DV]:
    returns the updated (max, sum, accumulator), all fp32.

    Rows whose keys are all invisible in this tile keep their state (exp(-inf) = 0, max guarded)."""
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@jit
def finish_softmax(m_i, l_i, acc):  # type: ignore[no-untyped-def]  # a Triton kernel: its arguments are typed by Triton at launch
    """(out, lse) from the running state; rows that saw no key give out = 0 and lse = -inf."""
    valid = l_i > 0
    out = tl.where(valid[:, None], acc / tl.where(valid, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(valid, m_i + tl.log(tl.where(valid, l_i, 1.0)), float("-inf"))
    return out, lse


def output_buffers(
    like: torch.Tensor,
    num_heads: int,
    out: torch.Tensor | None,
    lse_out: torch.Tensor | None,
    head_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validates caller-provided outputs (e.g. preallocated for CUDA graphs) or allocates them.

    out: [rows, num_heads, head_dim] in like's dtype (head_dim: like's last dimension unless given, e.g. the value
    width when it differs from the key width); lse_out: [rows, num_heads] fp32."""
    rows = like.shape[0]
    head_dim = like.shape[-1] if head_dim is None else head_dim
    if out is None:
        out = torch.empty((rows, num_heads, head_dim), dtype=like.dtype, device=like.device)
    elif out.shape != (rows, num_heads, head_dim) or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(
            f"out must be {like.dtype} [{rows}, {num_heads}, {head_dim}] on {like.device}, got {out.dtype} "
            f"{tuple(out.shape)} on {out.device}"
        )
    if lse_out is None:
        lse_out = torch.empty((rows, num_heads), dtype=torch.float32, device=like.device)
    elif lse_out.shape != (rows, num_heads) or lse_out.dtype != torch.float32 or lse_out.device != like.device:
        raise ValueError(
            f"lse_out must be float32 [{rows}, {num_heads}] on {like.device}, got {lse_out.dtype} "
            f"{tuple(lse_out.shape)} on {lse_out.device}"
        )
    if out.stride(-1) != 1:
        raise ValueError(f"out must be contiguous in head_dim (stride(-1) == 1), got {out.stride()}")
    return out, lse_out

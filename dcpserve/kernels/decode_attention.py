"""Paged decode attention over this rank's KV shard, returning (out, lse) for an exact cross-shard merge.

One query token per sequence attends to the first local_seq_lens[i] slots of its pages. The Triton version
splits each sequence's context across programs (flash-decoding): grid (num_seqs, num_kv_heads * head blocks,
num_splits); every program handles a block of the query heads of one KV head (GQA/MQA packing; MLA, whose every
head uses the one latent KV head, takes them 16 at a time), and the per-split partials are merged with the same
combine kernel that merges DCP shards, so one long sequence still fills the GPU.

Values may be narrower than keys and read from the same cache (MLA: the cache holds [latent, rope key] per token,
the values are the latent): v_head_dim says how many leading channels of the value source are the values, and
v_cache None makes the key cache that source. The output is [.., v_head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dcpserve.kernels._attention_common import (
    NUM_STAGES,
    NUM_WARPS,
    ChannelTiles,
    channel_tiles,
    check_lengths,
    check_paged_cache,
    compute_dtype_for,
    default_block_n,
    dot_precision,
    finish_softmax,
    head_block_size,
    load_paged_tile,
    online_softmax_step,
    output_buffers,
    shares_values,
    tile_scores,
)
from dcpserve.kernels._triton import jit, require_triton_device, tl, triton, triton_interpreting
from dcpserve.kernels.combine import combine_lse_into

MAX_SPLITS = 64


@dataclass(frozen=True)
class DecodeTiles:
    """What the decode launcher picks for one head shape: the channel tiles, the query heads one program packs
    (block_g, head_blocks such blocks per KV head), the keys per tile, and Triton's num_warps / num_stages."""

    channels: ChannelTiles
    block_g: int
    head_blocks: int
    block_n: int
    num_warps: int = NUM_WARPS
    num_stages: int = NUM_STAGES


def decode_tiles(group: int, head_dim: int, v_head_dim: int, cuda_tiles: bool | None = None) -> DecodeTiles:
    """The decode kernel's tiles for `group` query heads per KV head of head_dim key / v_head_dim value channels;
    cuda_tiles as in use_cuda_tiles (None: the device's choice)."""
    channels = channel_tiles(head_dim, v_head_dim)
    block_g = head_block_size(group, channels.block_dv)
    return DecodeTiles(channels, block_g, triton.cdiv(group, block_g), default_block_n(channels.block_dv, cuda_tiles))


def _check_decode_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    block_table: torch.Tensor,
    local_seq_lens: torch.Tensor,
    v_head_dim: int | None = None,
) -> int:
    """Checks the arguments; returns the value width."""
    width = check_paged_cache(q, k_cache, v_cache, block_table, q.shape[0] if q.dim() == 3 else -1, v_head_dim)
    check_lengths("local_seq_lens", local_seq_lens, q.shape[0])
    return width


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    block_table: torch.Tensor,
    local_seq_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    v_head_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference. q [num_seqs, num_q_heads, head_dim]; caches [num_blocks, block_size, num_kv_heads,
    head_dim] (v_cache None: the values are read from k_cache); block_table [num_seqs, max_blocks]; local_seq_lens
    [num_seqs]; v_head_dim: the values are the first v_head_dim channels of the value cache (default head_dim).
    Returns out [num_seqs, num_q_heads, v_head_dim] (q's dtype) and lse [num_seqs, num_q_heads] (fp32), written
    into out / lse_out when given."""
    value_dim = _check_decode_args(q, k_cache, v_cache, block_table, local_seq_lens, v_head_dim)
    num_seqs, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    compute_dtype = compute_dtype_for(q.dtype)
    out, lse = output_buffers(q, num_q_heads, out, lse_out, value_dim)
    out.zero_()
    lse.fill_(float("-inf"))
    lens = local_seq_lens.to(torch.int64)
    if num_seqs == 0 or int(lens.max()) == 0:
        return out, lse
    if int(lens.min()) < 0:
        raise ValueError(f"local_seq_lens must be >= 0, got {int(lens.min())}")
    max_len = int(lens.max())
    pages_needed = -(-max_len // block_size)
    if pages_needed > block_table.shape[1]:
        raise ValueError(
            f"local length {max_len} needs {pages_needed} pages but block_table has {block_table.shape[1]} columns"
        )
    pages = block_table[:, :pages_needed].to(torch.int64)
    token = torch.arange(pages_needed * block_size, device=q.device)
    visible = token[None, :] < lens[:, None]  # [S, T]
    used_pages = pages[(torch.arange(pages_needed, device=q.device)[None, :] * block_size) < lens[:, None]]
    if used_pages.numel() and (int(used_pages.min()) < 0 or int(used_pages.max()) >= num_blocks):
        raise ValueError(f"block_table names pages outside the cache's {num_blocks} pages")
    # Columns past a sequence's used pages may hold padding: clamp them in range; they are masked anyway.
    pages = pages.clamp(0, num_blocks - 1)
    keys = k_cache[pages].reshape(num_seqs, -1, num_kv_heads, head_dim).to(compute_dtype)
    value_cache = k_cache if v_cache is None else v_cache
    values = value_cache[pages][..., :value_dim].reshape(num_seqs, -1, num_kv_heads, value_dim).to(compute_dtype)
    # Slots past a local length are never written (may hold NaN): zero them so 0 * NaN cannot leak.
    values = values.masked_fill(~visible[:, :, None, None], 0.0)
    queries = q.to(compute_dtype).reshape(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("skgd,stkd->skgt", queries, keys) * scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    row_lse = torch.logsumexp(scores, dim=-1)  # -inf for empty rows
    safe_lse = torch.where(torch.isinf(row_lse), torch.zeros_like(row_lse), row_lse)
    probs = torch.exp(scores - safe_lse[..., None])
    result = torch.einsum("skgt,stkd->skgd", probs, values)
    out.copy_(result.reshape(num_seqs, num_q_heads, value_dim))
    lse.copy_(row_lse.reshape(num_seqs, num_q_heads))
    return out, lse


@jit
def _paged_decode_kernel(  # type: ignore[no-untyped-def]  # a Triton kernel: its arguments are typed by Triton at launch
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale,
    head_dim,
    v_head_dim,
    num_splits,
    stride_q_s,
    stride_q_h,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    stride_bt_s,
    stride_po_p,
    stride_po_s,
    stride_po_h,
    stride_pl_p,
    stride_pl_s,
    stride_pl_h,
    GROUP: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    HAS_REST: tl.constexpr,
    SHARED_KV: tl.constexpr,
    block_size: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)  # int64: its products with the strides are element offsets
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    head_block = tl.program_id(1) % HEAD_BLOCKS
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Splits cover whole BLOCK_N tiles; short sequences leave trailing splits empty (lse = -inf, weight 0).
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    g = head_block * BLOCK_G + tl.arange(0, BLOCK_G)
    g_mask = g < GROUP
    dv = tl.arange(0, BLOCK_DV)  # the value channels (keys' first v_head_dim channels too)
    dv_mask = dv < v_head_dim
    dr = v_head_dim + tl.arange(0, BLOCK_DR)  # the keys' channels past the values (MLA: the rope key)
    dr_mask = dr < head_dim
    q_heads = kv_head * GROUP + g
    q_rows = q_ptr + seq * stride_q_s + q_heads[:, None] * stride_q_h
    q_v = tl.load(q_rows + dv[None, :], mask=g_mask[:, None] & dv_mask[None, :], other=0.0)
    if HAS_REST:
        q_r = tl.load(q_rows + dr[None, :], mask=g_mask[:, None] & dr_mask[None, :], other=0.0)
    else:
        q_r = q_v
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
    table_row = block_table_ptr + seq * stride_bt_s
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        k_v = load_paged_tile(
            k_cache_ptr, table_row, tokens, token_mask, kv_head, dv, dv_mask,
            stride_kc_b, stride_kc_s, stride_kc_h, block_size,
        )
        if HAS_REST:
            k_r = load_paged_tile(
                k_cache_ptr, table_row, tokens, token_mask, kv_head, dr, dr_mask,
                stride_kc_b, stride_kc_s, stride_kc_h, block_size,
            )
        else:
            k_r = k_v
        if SHARED_KV:
            v = k_v  # one read of the cache serves the scores and the values
        else:
            v = load_paged_tile(
                v_cache_ptr, table_row, tokens, token_mask, kv_head, dv, dv_mask,
                stride_vc_b, stride_vc_s, stride_vc_h, block_size,
            )
        s = tile_scores(q_v, k_v, q_r, k_r, scale, HAS_REST, DOT_PRECISION)
        m_i, l_i, acc = online_softmax_step(s, v, token_mask[None, :], m_i, l_i, acc, DOT_PRECISION)
    out, lse = finish_softmax(m_i, l_i, acc)
    part = split.to(tl.int64)
    tl.store(
        part_out_ptr + part * stride_po_p + seq * stride_po_s + q_heads[:, None] * stride_po_h + dv[None, :],
        out,
        mask=g_mask[:, None] & dv_mask[None, :],
    )
    tl.store(part_lse_ptr + part * stride_pl_p + seq * stride_pl_s + q_heads * stride_pl_h, lse, mask=g_mask)


def num_splits_for(programs: int, target_programs: int) -> int:
    """Context splits per sequence so that `programs` (sequences x KV heads) times the splits reach target_programs,
    at most MAX_SPLITS."""
    return max(1, min(MAX_SPLITS, -(-target_programs // max(1, programs))))


def split_target(multi_processor_count: int) -> int:
    """Programs that fill a GPU of this many SMs about twice."""
    return 2 * multi_processor_count


def default_num_splits(q: torch.Tensor, num_kv_heads: int) -> int:
    """Enough programs to fill the device about twice (fixed by batch shape, so no host sync on lengths)."""
    if q.is_cuda:
        target = split_target(torch.cuda.get_device_properties(q.device).multi_processor_count)
    else:
        target = 8 if triton_interpreting() else 1
    return num_splits_for(q.shape[0] * num_kv_heads, target)


def paged_decode_attention_split(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    block_table: torch.Tensor,
    local_seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    *,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    v_head_dim: int | None = None,
    cuda_tiles: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """paged_decode_attention with an explicit number of context splits per sequence (tests and tuning).
    cuda_tiles: True picks the tile sizes CUDA runs even under the interpreter (decode_tiles)."""
    value_dim = _check_decode_args(q, k_cache, v_cache, block_table, local_seq_lens, v_head_dim)
    require_triton_device(q, k_cache, v_cache, block_table, local_seq_lens)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive integer, got {num_splits!r}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride(-1) == 1), got {t.stride()}")
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out, lse = output_buffers(q, num_q_heads, out, lse_out, value_dim)
    if num_seqs == 0:
        return out, lse
    part_out = torch.empty((num_splits, num_seqs, num_q_heads, value_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((num_splits, num_seqs, num_q_heads), dtype=torch.float32, device=q.device)
    tiles = decode_tiles(group, head_dim, value_dim, cuda_tiles)
    shared = shares_values(k_cache, v_cache)
    values = k_cache if v_cache is None else v_cache
    _paged_decode_kernel[(num_seqs, num_kv_heads * tiles.head_blocks, num_splits)](
        q,
        k_cache,
        values,
        block_table,
        local_seq_lens,
        part_out,
        part_lse,
        float(scale),
        head_dim,
        value_dim,
        num_splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        values.stride(0),
        values.stride(1),
        values.stride(2),
        block_table.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        part_lse.stride(2),
        GROUP=group,
        HEAD_BLOCKS=tiles.head_blocks,
        BLOCK_G=tiles.block_g,
        BLOCK_N=tiles.block_n,
        BLOCK_DV=tiles.channels.block_dv,
        BLOCK_DR=tiles.channels.block_dr,
        HAS_REST=tiles.channels.has_rest,
        SHARED_KV=shared,
        block_size=block_size,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    combine_lse_into(part_out, part_lse, out, lse)
    return out, lse


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    block_table: torch.Tensor,
    local_seq_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    v_head_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton paged decode attention (same contract as paged_decode_attention_ref; the tiles CUDA runs at, on the
    interpreter: paged_decode_attention_split with cuda_tiles=True)."""
    num_kv_heads = k_cache.shape[2] if k_cache.dim() == 4 else 1
    num_splits = default_num_splits(q, num_kv_heads)
    return paged_decode_attention_split(
        q, k_cache, v_cache, block_table, local_seq_lens, scale, num_splits, out=out, lse_out=lse_out,
        v_head_dim=v_head_dim,
    )

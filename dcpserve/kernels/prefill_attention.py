"""Paged prefill attention for a chunk of new tokens per sequence, returning (out, lse).

Query j of a sequence's chunk (j = 0 .. chunk_len - 1) attends to

  1. the first context_lens[s] slots of the sequence's pages on this rank (its cached context), and
  2. when key/value are given, the chunk's own new tokens 0 .. j (causal).

With DCP the two parts run separately and merge exactly with combine_lse (docs/dcp.md):
the context part runs on every rank of the group with that rank's local context length and the group's
gathered query heads (key/value = None), the new-token part runs locally (every rank has all new K/V)
with context_lens = 0. Without DCP one call does both.

Values may be narrower than keys and read from the same cache (MLA: [latent, rope key] per token, the values are
the latent): v_head_dim says how many leading channels of the value source are the values; v_cache None (and then
value None) makes the keys that source. The output is [.., v_head_dim].

Tokens of all sequences are packed: query_start_loc [num_seqs + 1] gives each sequence's rows in q/key/value.
"""

from __future__ import annotations

import itertools
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
    gather_pages_ref,
    load_paged_tile,
    online_softmax_step,
    output_buffers,
    shares_values,
    tile_scores,
    use_cuda_tiles,
)
from dcpserve.kernels._triton import jit, require_triton_device, tl, triton


@dataclass(frozen=True)
class PrefillTiles:
    """What the prefill launcher picks for one head shape: the channel tiles, the query rows (block_m) and keys
    (block_n) per tile, and Triton's num_warps / num_stages (8 warps at MLA's widths: with 4, ptxas spills some 450
    bytes a thread on sm_90 and sm_100, tests/kernels/test_compile_targets.py)."""

    channels: ChannelTiles
    block_m: int
    block_n: int
    num_warps: int = NUM_WARPS
    num_stages: int = NUM_STAGES


def prefill_tiles(head_dim: int, v_head_dim: int, cuda_tiles: bool | None = None) -> PrefillTiles:
    """The prefill kernel's tiles for head_dim key / v_head_dim value channels; cuda_tiles as in use_cuda_tiles
    (None: the device's choice). Wide heads (MLA's 512-value latent) keep the [BLOCK_M, BLOCK_DV] fp32 accumulator
    within registers."""
    channels = channel_tiles(head_dim, v_head_dim)
    wide = channels.block_dv >= 256
    block_m = 16 if not use_cuda_tiles(cuda_tiles) or wide else 64
    return PrefillTiles(channels, block_m, default_block_n(channels.block_dv, cuda_tiles),
                        num_warps=2 * NUM_WARPS if wide else NUM_WARPS)


def _check_prefill_args(
    q: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    check_values: bool = True,
    v_head_dim: int | None = None,
) -> int:
    """Shapes, dtypes and (check_values) the values of query_start_loc and context_lens, which reads them back from
    the device. Returns the value width."""
    if query_start_loc.dim() != 1 or query_start_loc.numel() < 1:
        raise ValueError(f"query_start_loc must be [num_seqs + 1], got shape {tuple(query_start_loc.shape)}")
    if query_start_loc.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"query_start_loc must be int32 or int64, got {query_start_loc.dtype}")
    num_seqs = query_start_loc.numel() - 1
    value_dim = check_paged_cache(q, k_cache, v_cache, block_table, num_seqs, v_head_dim)
    check_lengths("context_lens", context_lens, num_seqs)
    if v_cache is None:
        if value is not None:
            raise ValueError(
                "value must be None when v_cache is None: the values are read from the keys (the first v_head_dim "
                "channels of key and k_cache)"
            )
    elif (key is None) != (value is None):
        raise ValueError("pass both key and value (context + new tokens) or neither (context only)")
    if key is not None:
        expected = (q.shape[0], k_cache.shape[2], q.shape[2])
        if tuple(key.shape) != expected or (value is not None and tuple(value.shape) != expected):
            raise ValueError(
                f"key and value must be [num_tokens, num_kv_heads, head_dim] = {expected}, got "
                f"{tuple(key.shape)} and {tuple(value.shape) if value is not None else None}"
            )
        if key.dtype != q.dtype or (value is not None and value.dtype != q.dtype):
            raise TypeError(
                f"key/value dtype ({key.dtype}, {value.dtype if value is not None else None}) must match q's "
                f"({q.dtype})"
            )
    if not check_values:
        return value_dim
    starts = query_start_loc.to(torch.int64)
    if int(starts[0]) != 0 or int(starts[-1]) != q.shape[0] or bool((starts[1:] < starts[:-1]).any()):
        raise ValueError(
            f"query_start_loc must rise from 0 to num_tokens={q.shape[0]}, got {query_start_loc.tolist()}"
        )
    if num_seqs and int(context_lens.min()) < 0:
        raise ValueError(f"context_lens must be >= 0, got {int(context_lens.min())}")
    return value_dim


def paged_prefill_attention_ref(
    q: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    *,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    v_head_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference. q [num_tokens, num_q_heads, head_dim]; key/value [num_tokens, num_kv_heads, head_dim]
    or None; caches [num_blocks, block_size, num_kv_heads, head_dim] (v_cache None, and value None: the values are
    read from the keys); block_table [num_seqs, max_blocks]; query_start_loc [num_seqs + 1]; context_lens
    [num_seqs] (cached tokens on this rank); v_head_dim: the values are the first v_head_dim channels (default
    head_dim). Returns out [num_tokens, num_q_heads, v_head_dim] (q's dtype) and lse [num_tokens, num_q_heads]
    (fp32), written into out / lse_out when given.
    max_query_len is accepted for signature parity with the Triton kernel and not needed here."""
    value_dim = _check_prefill_args(q, key, value, k_cache, v_cache, block_table, query_start_loc, context_lens,
                                    v_head_dim=v_head_dim)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    compute_dtype = compute_dtype_for(q.dtype)
    out, lse = output_buffers(q, num_q_heads, out, lse_out, value_dim)
    out.zero_()
    lse.fill_(float("-inf"))
    value_cache = k_cache if v_cache is None else v_cache
    new_values = key if v_cache is None else value
    starts = query_start_loc.tolist()
    ctx_lens = context_lens.tolist()
    for seq, (start, end) in enumerate(itertools.pairwise(starts)):
        chunk = end - start
        if chunk == 0:
            continue
        ctx = int(ctx_lens[seq])
        keys = [gather_pages_ref(k_cache, block_table[seq], ctx, compute_dtype)]
        values = [gather_pages_ref(value_cache, block_table[seq], ctx, compute_dtype)[..., :value_dim]]
        visible = [torch.ones(chunk, ctx, dtype=torch.bool, device=q.device)]
        if key is not None and new_values is not None:
            keys.append(key[start:end].to(compute_dtype))
            values.append(new_values[start:end, :, :value_dim].to(compute_dtype))
            visible.append(torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril())
        k = torch.cat(keys)  # [T, Hk, D]
        v = torch.cat(values)  # [T, Hk, Dv]
        mask = torch.cat(visible, dim=1)  # [chunk, T]
        queries = q[start:end].to(compute_dtype).reshape(chunk, num_kv_heads, group, head_dim)
        scores = torch.einsum("qkgd,tkd->kgqt", queries, k) * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [Hk, G, chunk]
        safe_lse = torch.where(torch.isinf(row_lse), torch.zeros_like(row_lse), row_lse)
        probs = torch.exp(scores - safe_lse[..., None])
        result = torch.einsum("kgqt,tkd->qkgd", probs, v)
        out[start:end] = result.reshape(chunk, num_q_heads, value_dim).to(q.dtype)
        lse[start:end] = row_lse.permute(2, 0, 1).reshape(chunk, num_q_heads).to(torch.float32)
    return out, lse


@jit
def _paged_prefill_kernel(  # type: ignore[no-untyped-def]  # a Triton kernel: its arguments are typed by Triton at launch
    q_ptr,
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    out_ptr,
    lse_ptr,
    scale,
    head_dim,
    v_head_dim,
    stride_q_t,
    stride_q_h,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    stride_bt_s,
    stride_out_t,
    stride_out_h,
    stride_lse_t,
    stride_lse_h,
    GROUP: tl.constexpr,
    HAS_NEW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    HAS_REST: tl.constexpr,
    SHARED_KV: tl.constexpr,
    block_size: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    q_head = tl.program_id(2)
    kv_head = q_head // GROUP
    seq_start = tl.load(query_start_loc_ptr + seq)
    chunk_len = tl.load(query_start_loc_ptr + seq + 1) - seq_start
    if q_block * BLOCK_M < chunk_len:
        rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)  # index inside the chunk
        row_mask = rows < chunk_len
        dv = tl.arange(0, BLOCK_DV)  # the value channels (keys' first v_head_dim channels too)
        dv_mask = dv < v_head_dim
        dr = v_head_dim + tl.arange(0, BLOCK_DR)  # the keys' channels past the values (MLA: the rope key)
        dr_mask = dr < head_dim
        tok = (seq_start + rows).to(tl.int64)
        q_rows = q_ptr + tok[:, None] * stride_q_t + q_head * stride_q_h
        q_v = tl.load(q_rows + dv[None, :], mask=row_mask[:, None] & dv_mask[None, :], other=0.0)
        if HAS_REST:
            q_r = tl.load(q_rows + dr[None, :], mask=row_mask[:, None] & dr_mask[None, :], other=0.0)
        else:
            q_r = q_v
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

        # 1. Cached context on this rank: every row sees all of it.
        context_len = tl.load(context_lens_ptr + seq)
        table_row = block_table_ptr + seq.to(tl.int64) * stride_bt_s
        for tile_start in range(0, context_len, BLOCK_N):
            tokens = tile_start + tl.arange(0, BLOCK_N)
            token_mask = tokens < context_len
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
                v = k_v
            else:
                v = load_paged_tile(
                    v_cache_ptr, table_row, tokens, token_mask, kv_head, dv, dv_mask,
                    stride_vc_b, stride_vc_s, stride_vc_h, block_size,
                )
            s = tile_scores(q_v, k_v, q_r, k_r, scale, HAS_REST, DOT_PRECISION)
            m_i, l_i, acc = online_softmax_step(s, v, token_mask[None, :], m_i, l_i, acc, DOT_PRECISION)

        # 2. The chunk's own tokens, causal: row i sees new tokens 0..i.
        if HAS_NEW:
            new_end = tl.minimum((q_block + 1) * BLOCK_M, chunk_len)
            for tile_start in range(0, new_end, BLOCK_N):
                cols = tile_start + tl.arange(0, BLOCK_N)
                col_mask = cols < chunk_len
                col_tok = (seq_start + cols).to(tl.int64)
                key_rows = key_ptr + col_tok[:, None] * stride_key_t + kv_head * stride_key_h
                k_v = tl.load(key_rows + dv[None, :], mask=col_mask[:, None] & dv_mask[None, :], other=0.0)
                if HAS_REST:
                    k_r = tl.load(key_rows + dr[None, :], mask=col_mask[:, None] & dr_mask[None, :], other=0.0)
                else:
                    k_r = k_v
                if SHARED_KV:
                    v = k_v
                else:
                    v = tl.load(value_ptr + col_tok[:, None] * stride_value_t + kv_head * stride_value_h + dv[None, :],
                                mask=col_mask[:, None] & dv_mask[None, :], other=0.0)
                visible = (cols[None, :] <= rows[:, None]) & col_mask[None, :]
                s = tile_scores(q_v, k_v, q_r, k_r, scale, HAS_REST, DOT_PRECISION)
                m_i, l_i, acc = online_softmax_step(s, v, visible, m_i, l_i, acc, DOT_PRECISION)

        out, lse = finish_softmax(m_i, l_i, acc)
        tl.store(
            out_ptr + tok[:, None] * stride_out_t + q_head * stride_out_h + dv[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & dv_mask[None, :],
        )
        tl.store(lse_ptr + tok * stride_lse_t + q_head * stride_lse_h, lse, mask=row_mask)


def paged_prefill_attention(
    q: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    *,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    validate: bool = True,
    v_head_dim: int | None = None,
    cuda_tiles: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton paged prefill attention (same contract as paged_prefill_attention_ref; cuda_tiles: True picks the
    tile sizes CUDA runs even under the interpreter, prefill_tiles).

    max_query_len sizes the grid; pass it from the scheduler to avoid a device-to-host sync. validate=False skips
    the checks of query_start_loc's and context_lens' values (shapes and dtypes are always checked): they read the
    device back, in every layer; the engine's per-step metadata is built consistent."""
    value_dim = _check_prefill_args(q, key, value, k_cache, v_cache, block_table, query_start_loc, context_lens,
                                    validate, v_head_dim)
    require_triton_device(q, key, value, k_cache, v_cache, block_table, query_start_loc, context_lens)
    for name, t in (("q", q), ("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride(-1) == 1), got {t.stride()}")
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = query_start_loc.numel() - 1
    out, lse = output_buffers(q, num_q_heads, out, lse_out, value_dim)
    if num_tokens == 0:
        return out, lse
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    tiles = prefill_tiles(head_dim, value_dim, cuda_tiles)
    has_new = key is not None
    # One tile for keys and values only where both the cached and the new values are the keys' own memory.
    shared = shares_values(k_cache, v_cache) and (key is None or shares_values(key, value))
    values_cache = k_cache if v_cache is None else v_cache
    # Placeholders keep the launch signature fixed; HAS_NEW=False never reads them, nor SHARED_KV the values.
    key_arg = key if key is not None else q
    value_arg = value if value is not None else key_arg
    grid = (num_seqs, triton.cdiv(max_query_len, tiles.block_m), num_q_heads)
    _paged_prefill_kernel[grid](
        q,
        key_arg,
        value_arg,
        k_cache,
        values_cache,
        block_table,
        query_start_loc,
        context_lens,
        out,
        lse,
        float(scale),
        head_dim,
        value_dim,
        q.stride(0),
        q.stride(1),
        key_arg.stride(0),
        key_arg.stride(1),
        value_arg.stride(0),
        value_arg.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        values_cache.stride(0),
        values_cache.stride(1),
        values_cache.stride(2),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        lse.stride(1),
        GROUP=num_q_heads // num_kv_heads,
        HAS_NEW=has_new,
        BLOCK_M=tiles.block_m,
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
    return out, lse

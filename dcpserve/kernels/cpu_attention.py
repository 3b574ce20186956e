"""Paged decode and prefill attention on CPU through torch's fused flash attention, batched over sequences.

Same contracts as paged_decode_attention_ref / paged_prefill_attention_ref (same checks and errors, out and lse
buffers, lse = fp32 natural-log logsumexp of the scaled scores, out = 0 and lse = -inf where a row sees no key),
without their Python loop over sequences or their float64 math. The engine runs these on CPU.

Every sequence's pages are gathered at once: cache[block_table[:, :pages]] -> [num_seqs, pages * block_size,
num_kv_heads, head_dim], slots past a sequence's length zeroed (they may hold anything, NaN included, and the fused
op reads them before masking: 0 * NaN is NaN) and masked with an additive -inf mask. A caller that keeps those slots
finite (the engine's decode steps: plan_decode_cpu's finite_tail) skips the zeroing; the mask alone then gives them
exactly zero weight. Prefill chunks are padded at
the end to the longest chunk. The context part and the chunk's own causal part run as two fused calls and merge
with the exact LSE rule (dcpserve/kernels/combine.py), as the DCP path does across ranks: the fused op's is_causal is
top-left aligned, right only for the square chunk-over-itself part. For the context part the GQA group folds into
the query rows, so each KV head is read once for all its query heads. A decode step's pages and masks depend only
on the block table and the lengths: plan_decode_cpu checks and builds them once, and the engine's layers share that
plan.

Padding costs what the longest sequence costs, for every sequence: a 3-token chunk beside a 2,000-token one would
do 2,000 tokens of work. So sequences go in pieces, one batched call per piece: the longest remaining sequence
and those within a factor of sqrt(2) of it, in chunk length and in context length (0 apart from non-zero). A batch
of alike sequences is one piece; a piece pads each of its sequences at most sqrt(2)-fold in each length.

torch.ops.aten._scaled_dot_product_flash_attention_for_cpu (the kernel behind F.scaled_dot_product_attention on
CPU), as measured on torch 2.13: inputs [B, heads, L, D] (any strides; key/value may have fewer heads: GQA), the
mask in the query's dtype, returns out [B, heads, L, D] (memory [B, L, heads, D]) and lse [B, heads, L] natural-log
in fp32 (fp64 for fp64 inputs); a fully masked row gives out = 0 but lse = 0 (fixed here to -inf); a zero-sized
dimension crashes the process (SIGFPE), so empty inputs never reach it; query, key and value must have the same head
size. Math runs in fp32 (fp64 for fp64 inputs).

Values narrower than keys (v_head_dim; MLA reads them from the key cache: [latent, rope key] per token, values =
the latent) go through the fused op at the keys' width and the output keeps the first v_head_dim channels: values
read from the keys are the gathered keys themselves (one gather for both), so the extra channels cost compute, not
memory traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dcpserve.kernels._attention_common import compute_dtype_for, output_buffers, shares_values
from dcpserve.kernels.decode_attention import _check_decode_args, paged_decode_attention_ref
from dcpserve.kernels.prefill_attention import _check_prefill_args, paged_prefill_attention_ref

_flash_attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
# Sequences whose lengths are within this factor of a piece's longest share its batched call (module docstring).
PIECE_RATIO = 2**0.5


def _require_cpu(kernel: str, *tensors: torch.Tensor | None) -> None:
    """Raises a clear error when a tensor is not on the CPU (the fused op is CPU-only)."""
    for t in tensors:
        if t is not None and t.device.type != "cpu":
            raise RuntimeError(
                f"{kernel} runs on CPU tensors, got a tensor on {t.device}: on CUDA use the Triton kernel "
                f"({kernel.removesuffix('_cpu')})"
            )


def _pieces(include: torch.Tensor, *lengths: torch.Tensor) -> list[torch.Tensor]:
    """The sequences where include [S] is set, in pieces of alike lengths: in each length [S] (int64 >= 0, in
    order of priority) a piece's sequences are within PIECE_RATIO of the piece's longest, and 0 stays apart from
    non-zero. Returns each piece's sequence indices (int64, ascending); one piece when the lengths are alike.

    Each round takes the longest remaining sequences by the first length, then by the next among those, and so
    on, so the rounds are bounded by how far the lengths spread (about 1 + 2 * log2(longest / shortest) per
    length), not by the number of sequences."""
    remaining = include.nonzero()[:, 0]
    pieces = []
    while remaining.numel():
        taken = torch.ones_like(remaining, dtype=torch.bool)
        for length in lengths:
            values = length[remaining]
            longest = values.masked_fill(~taken, -1).max()
            # 0 is alike only to 0 (its sequence reads nothing); otherwise within the ratio of the longest.
            taken &= (values * PIECE_RATIO >= longest) & ((values > 0) | (longest == 0))
        pieces.append(remaining[taken])
        remaining = remaining[~taken]
    return pieces


def _gather_context(cache: torch.Tensor, pages: torch.Tensor, tail: torch.Tensor | None,
                    compute_dtype: torch.dtype) -> torch.Tensor:
    """cache's slots of pages [S, P] (int64, in range) as [S, P * block_size, num_kv_heads, head_dim] in
    compute_dtype, zero in the rows `tail` names (int64 indices into the S * P * block_size gathered slots: those
    past each sequence's length, which may hold anything, NaN included)."""
    num_seqs = pages.shape[0]
    # index_select over the flat page list: about twice as fast as cache[pages] on CPU.
    gathered = cache.index_select(0, pages.reshape(-1)).to(compute_dtype)
    if tail is not None:
        # index_fill_ of whole rows: at 64 x 128 slots about 40% faster than a masked_fill_ of the tail through a
        # broadcast [S, T, 1, 1] mask (74 vs 119 us a gather), the same at long context.
        gathered.view(-1, cache.shape[2] * cache.shape[3]).index_fill_(0, tail, 0.0)
    return gathered.reshape(num_seqs, -1, *cache.shape[2:])


def _context_masks(lens: torch.Tensor, slots: int, dtype: torch.dtype, min_len: int | None = None,
                   finite_tail: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """For sequences of lens [S] (max >= 1; min_len: their shortest, when known) over `slots` gathered slots each:
    (additive mask [S, 1, 1, slots] in dtype, or None when every sequence fills every slot, the flat indices of the
    gathered slots past each length [n] int64 or None when there are none or finite_tail says they need no zeroing,
    empty rows [S, 1, 1] or None)."""
    if min_len is None:
        min_len = int(lens.min())
    if min_len == slots:  # nothing to hide (a prefill context of whole pages, as a PCP segment's usually is)
        return None, None, None
    visible = torch.arange(slots, device=lens.device)[None, :] < lens[:, None]  # [S, T]
    mask = torch.where(visible, torch.zeros((), dtype=dtype), torch.full((), float("-inf"), dtype=dtype))
    tail = (~visible).reshape(-1).nonzero()[:, 0] if min_len < slots and not finite_tail else None
    empty = (lens == 0)[:, None, None] if min_len == 0 else None
    return mask[:, None, None, :], tail, empty


def _attend_context(
    queries: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    pages: torch.Tensor,
    masks: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    scale: float,
    value_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries [S, L, num_q_heads, D] (compute dtype) over each sequence's cached tokens in pages [S, P]
    (int64, in range), with the masks of _context_masks for their lengths (at least one sequence has a token); the
    values are the first value_dim channels of v_cache (of k_cache when v_cache is None).
    Returns out [S, L, num_q_heads, value_dim] and lse [S, L, num_q_heads] (compute dtype; rows of lens 0: 0 / -inf)."""
    num_seqs, rows, num_q_heads, head_dim = queries.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    mask, tail, empty = masks
    keys = _gather_context(k_cache, pages, tail, queries.dtype)
    values = (keys if v_cache is None or shares_values(k_cache, v_cache)
              else _gather_context(v_cache, pages, tail, queries.dtype))
    # Query rows of one KV head: [S, Hk, L * G, D], row l * G + g is query head kv * G + g of token l.
    folded = queries.reshape(num_seqs, rows, num_kv_heads, group, head_dim).transpose(1, 2)
    folded = folded.reshape(num_seqs, num_kv_heads, rows * group, head_dim)
    out, lse = _flash_attention(
        folded, keys.transpose(1, 2), values.transpose(1, 2), 0.0, False, attn_mask=mask, scale=scale,
    )
    out = out[..., :value_dim].reshape(num_seqs, num_kv_heads, rows, group, value_dim).transpose(1, 2)
    out = out.reshape(num_seqs, rows, num_q_heads, value_dim)
    lse = lse.reshape(num_seqs, num_kv_heads, rows, group).transpose(1, 2).reshape(num_seqs, rows, num_q_heads)
    if empty is not None:  # the fused op gives a fully masked row lse = 0
        out = out.masked_fill(empty[..., None], 0.0)
        lse = lse.masked_fill(empty, float("-inf"))
    return out, lse


@dataclass(frozen=True)
class CpuDecodePlan:
    """What paged_decode_attention_cpu derives from the block table and lengths alone, checked once: the engine
    makes one per step (plan_decode_cpu) and every layer reuses it, so a layer runs only the gathers and the fused
    call. None of it depends on the queries or the cache contents."""

    num_seqs: int
    lens: torch.Tensor  # [S] int64 local lengths
    max_len: int
    pages: torch.Tensor  # [S, P] int64, clamped in range, P = pages of the longest sequence
    pieces: list[torch.Tensor] | None  # sequence indices of each batched call; None: the whole batch in one call
    piece_pages: list[torch.Tensor]  # each piece's pages, cut to its longest sequence
    masks: list[tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]]  # per call: (additive mask
    # [S', 1, 1, T] in the compute dtype or None, flat indices of the gathered slots past each length or None, empty
    # rows or None)
    compute_dtype: torch.dtype


def plan_decode_cpu(
    block_table: torch.Tensor, local_seq_lens: torch.Tensor, num_blocks: int, block_size: int, dtype: torch.dtype,
    validate: bool = True, finite_tail: bool = False,
) -> CpuDecodePlan | None:
    """Checks block_table [S, max_blocks] and local_seq_lens [S] against a cache of num_blocks pages of block_size
    slots (the errors of paged_decode_attention_ref) and plans the batched calls for queries of `dtype`. None when
    no sequence has a token (every output is 0 / -inf).

    validate=False skips the checks of lengths and used pages (the engine's tables, which its persistent batch keeps
    right): a decode step then plans in a few tensor ops. Padding columns are clamped in range either way.

    finite_tail=True: the caller guarantees that every slot the table names past a sequence's length, up to the
    longest sequence's pages, holds finite values (the engine zeroes a page when it is allocated, and a row's
    padding columns repeat its last page: dcpserve/engine/worker/input_batch.py). The additive -inf mask then gives
    those slots exactly zero weight, so the gathered slots are not zeroed first (the default's guard against NaN left
    there by another request)."""
    num_seqs = local_seq_lens.shape[0]
    if num_seqs == 0:
        return None
    lens = local_seq_lens.to(torch.int64)
    min_len, max_len = (int(v) for v in torch.aminmax(lens))
    if max_len == 0:
        return None
    if validate and min_len < 0:
        raise ValueError(f"local_seq_lens must be >= 0, got {min_len}")
    pages_needed = -(-max_len // block_size)
    if validate and pages_needed > block_table.shape[1]:
        raise ValueError(
            f"local length {max_len} needs {pages_needed} pages but block_table has {block_table.shape[1]} columns"
        )
    pages = block_table[:, :pages_needed].to(torch.int64)
    if validate:
        used = (torch.arange(pages_needed, device=lens.device)[None, :] * block_size) < lens[:, None]
        if bool(((pages < 0) | (pages >= num_blocks))[used].any()):
            raise ValueError(f"block_table names pages outside the cache's {num_blocks} pages")
    # Columns past a sequence's used pages may hold padding: clamp them in range; they are masked anyway.
    pages = pages.clamp(0, num_blocks - 1)
    compute_dtype = compute_dtype_for(dtype)
    if min_len > 0 and min_len * PIECE_RATIO >= max_len:
        pieces = None  # what _pieces finds for alike non-zero lengths (the usual decode batch), without its ops
    else:
        pieces = _pieces(lens > 0, lens)
        if len(pieces) == 1 and pieces[0].numel() == num_seqs:  # the whole batch, no empty sequence
            pieces = None
    calls = [(lens, pages, min_len)] if pieces is None else [
        (lens[seqs], pages[seqs, : -(-int(lens[seqs].max()) // block_size)], None) for seqs in pieces]
    masks = [_context_masks(call_lens, call_pages.shape[1] * block_size, compute_dtype, call_min, finite_tail)
             for call_lens, call_pages, call_min in calls]
    return CpuDecodePlan(num_seqs, lens, max_len, pages, pieces, [p for _, p, _ in calls], masks, compute_dtype)


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    block_table: torch.Tensor,
    local_seq_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    plan: CpuDecodePlan | None = None,
    v_head_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU paged decode attention, batched over sequences (same contract as paged_decode_attention_ref).
    q [num_seqs, num_q_heads, head_dim]; caches [num_blocks, block_size, num_kv_heads, head_dim] (v_cache None: the
    values are read from k_cache); block_table [num_seqs, max_blocks]; local_seq_lens [num_seqs]; v_head_dim: the
    values are the first v_head_dim channels (default head_dim). Returns out [num_seqs, num_q_heads, v_head_dim]
    (q's dtype) and lse [num_seqs, num_q_heads] (fp32), written into out / lse_out when given. `plan`:
    plan_decode_cpu of the same block_table and lengths (made once per step by the engine, which checked them there);
    without it the arguments are checked and planned here."""
    value_dim = _check_decode_args(q, k_cache, v_cache, block_table, local_seq_lens, v_head_dim)
    _require_cpu("paged_decode_attention_cpu", q, k_cache, v_cache, block_table, local_seq_lens)
    num_seqs, num_q_heads, head_dim = q.shape
    num_blocks, block_size = k_cache.shape[:2]
    out, lse = output_buffers(q, num_q_heads, out, lse_out, value_dim)
    if plan is None:
        plan = plan_decode_cpu(block_table, local_seq_lens, num_blocks, block_size, q.dtype)
    elif plan.num_seqs != num_seqs or plan.compute_dtype != compute_dtype_for(q.dtype):
        raise ValueError(
            f"the plan was made for {plan.num_seqs} sequences in {plan.compute_dtype}, the call has {num_seqs} in "
            f"{compute_dtype_for(q.dtype)}: make the plan from this call's block table, lengths and dtype"
        )
    if plan is None:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    if num_q_heads == 0 or head_dim == 0:  # shapes the fused op cannot take (nothing to compute)
        return paged_decode_attention_ref(q, k_cache, v_cache, block_table, local_seq_lens, scale, out=out,
                                          lse_out=lse, v_head_dim=v_head_dim)
    queries = q.to(plan.compute_dtype).reshape(num_seqs, 1, num_q_heads, head_dim)
    if plan.pieces is None:  # the whole batch, no empty sequence
        result, result_lse = _attend_context(queries, k_cache, v_cache, plan.piece_pages[0], plan.masks[0],
                                             scale, value_dim)
        out.copy_(result[:, 0])
        lse.copy_(result_lse[:, 0])
        return out, lse
    out.zero_()
    lse.fill_(float("-inf"))
    for seqs, pages, masks in zip(plan.pieces, plan.piece_pages, plan.masks, strict=True):
        result, result_lse = _attend_context(queries[seqs], k_cache, v_cache, pages, masks, scale, value_dim)
        out.index_copy_(0, seqs, result[:, 0].to(out.dtype))
        lse.index_copy_(0, seqs, result_lse[:, 0].to(lse.dtype))
    return out, lse


def _check_context_pages(
    block_table: torch.Tensor, context_lens: torch.Tensor, num_blocks: int, block_size: int
) -> torch.Tensor:
    """The pages [S, P] (int64, clamped in range) holding context_lens [S] tokens per sequence, P for the longest.
    Raises what paged_prefill_attention_ref raises for the first sequence (in order) whose row is too short or
    names a page outside the cache."""
    needed = (context_lens + block_size - 1) // block_size
    width = block_table.shape[1]
    pages_needed = min(int(needed.max()), width)
    pages = block_table[:, :pages_needed].to(torch.int64)
    used = torch.arange(pages_needed, device=pages.device)[None, :] < needed[:, None]
    too_short = needed > width
    out_of_range = (used & ((pages < 0) | (pages >= num_blocks))).any(dim=1)
    failing = too_short | out_of_range
    if bool(failing.any()):
        seq = int(failing.nonzero()[0, 0])
        if bool(too_short[seq]):
            raise ValueError(
                f"{int(context_lens[seq])} cached tokens need {int(needed[seq])} pages but the block table row has "
                f"{width}"
            )
        row = pages[seq][used[seq]]
        low, high = int(row.min()), int(row.max())
        raise ValueError(f"block table names page {low if low < 0 else high} outside the cache's {num_blocks} pages")
    return pages.clamp(0, num_blocks - 1)


def _pad_rows(packed: torch.Tensor, token_rows: torch.Tensor | None, valid: torch.Tensor) -> torch.Tensor:
    """Rows token_rows [R] of packed [T, ...] (all of them when None) -> [n, L, ...], placed where valid [n, L] is
    set in row-major order (a sequence's tokens in packed order); the other rows zero. A view when nothing moves."""
    rows = packed if token_rows is None else packed.index_select(0, token_rows)
    if valid.numel() == rows.shape[0]:
        return rows.reshape(*valid.shape, *rows.shape[1:])
    padded = rows.new_zeros((*valid.shape, *rows.shape[1:]))
    padded[valid] = rows
    return padded


def _attend_piece(
    queries: torch.Tensor,
    keys: torch.Tensor | None,
    values: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    pages: torch.Tensor,
    context: torch.Tensor,
    scale: float,
    value_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill of one piece: queries [n, L, H, D] (chunks padded at the end) over each sequence's cached context
    (context [n] tokens in pages [n, P], P = 0 when none has any) and, when keys [n, L, Hk, D] are given, the chunk
    itself (causal; values [n, L, Hk, D], or None: the keys). Returns out [n, L, H, value_dim] and lse [n, L, H] in
    the compute dtype."""
    result: torch.Tensor | None = None
    result_lse: torch.Tensor | None = None
    if pages.shape[1]:
        masks = _context_masks(context, pages.shape[1] * k_cache.shape[1], queries.dtype)
        result, result_lse = _attend_context(queries, k_cache, v_cache, pages, masks, scale, value_dim)
    if keys is not None:
        new_values = keys if values is None else values
        # Padded rows sit after a chunk's real ones: with top-left causal masking no real row sees them.
        new_out, new_lse = _flash_attention(
            queries.transpose(1, 2), keys.transpose(1, 2), new_values.transpose(1, 2), 0.0, True, scale=scale
        )
        new_out, new_lse = new_out.transpose(1, 2)[..., :value_dim], new_lse.transpose(1, 2)  # [n, L, H, Dv], [n, L, H]
        if result is None or result_lse is None:
            return new_out, new_lse
        # Exact merge (dcpserve/kernels/combine.py); the chunk part always sees its first key, so the total is finite.
        total_lse = torch.logaddexp(result_lse, new_lse)
        context_weight = torch.exp(result_lse - total_lse)[..., None]
        new_weight = torch.exp(new_lse - total_lse)[..., None]
        return result * context_weight + new_out * new_weight, total_lse
    if result is None or result_lse is None:  # context only, and none in this piece
        return (queries.new_zeros((*queries.shape[:3], value_dim)),
                queries.new_full(queries.shape[:3], float("-inf")))
    return result, result_lse


def paged_prefill_attention_cpu(
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
    """CPU paged prefill attention, batched over sequences (same contract as paged_prefill_attention_ref).
    q [num_tokens, num_q_heads, head_dim]; key/value [num_tokens, num_kv_heads, head_dim] or None (context
    only); caches [num_blocks, block_size, num_kv_heads, head_dim] (v_cache None, and value None: the values are
    read from the keys); block_table [num_seqs, max_blocks]; query_start_loc [num_seqs + 1]; context_lens
    [num_seqs] (cached tokens on this rank); v_head_dim: the values are the first v_head_dim channels (default
    head_dim). Returns out [num_tokens, num_q_heads, v_head_dim] (q's dtype) and lse [num_tokens, num_q_heads]
    (fp32), written into out / lse_out when given.
    max_query_len is accepted for signature parity: the chunk lengths are read from query_start_loc, which on
    CPU costs no device sync, so a stale value cannot truncate a chunk."""
    value_dim = _check_prefill_args(q, key, value, k_cache, v_cache, block_table, query_start_loc, context_lens,
                                    v_head_dim=v_head_dim)
    _require_cpu("paged_prefill_attention_cpu", q, key, value, k_cache, v_cache, block_table, query_start_loc,
                 context_lens)
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size = k_cache.shape[:2]
    out, lse = output_buffers(q, num_q_heads, out, lse_out, value_dim)
    if num_tokens == 0:
        return out, lse
    if num_q_heads == 0 or head_dim == 0:  # shapes the fused op cannot take (nothing to compute)
        return paged_prefill_attention_ref(q, key, value, k_cache, v_cache, block_table, query_start_loc,
                                           context_lens, scale, out=out, lse_out=lse, v_head_dim=v_head_dim)
    starts = query_start_loc.to(torch.int64)
    chunk_lens = starts[1:] - starts[:-1]
    # A sequence without new tokens has no rows: its context is neither read nor checked (as in the reference).
    context = torch.where(chunk_lens > 0, context_lens.to(torch.int64), 0)
    pages = _check_context_pages(block_table, context, num_blocks, block_size)
    queries = q.to(compute_dtype_for(q.dtype))
    keys = key.to(queries.dtype) if key is not None else None
    # The same tensor for both when the values are the keys (one padding, one pass through the fused op).
    # (_check_prefill_args: a value comes with a key.)
    values = (value.to(queries.dtype) if value is not None and key is not None and not shares_values(key, value)
              else None)
    for seqs in _pieces(chunk_lens > 0, chunk_lens, context):
        piece_chunks, piece_context = chunk_lens[seqs], context[seqs]
        rows = int(piece_chunks.max())
        valid = torch.arange(rows, device=q.device)[None, :] < piece_chunks[:, None]  # [n, L]
        if seqs.numel() == chunk_lens.numel() and bool(valid.all()):
            token_rows = None  # every sequence's chunk has L rows: the packed [T] rows are [S, L] as they are
        else:
            token_rows = (starts[seqs][:, None] + torch.arange(rows, device=q.device)[None, :])[valid]
        piece_q = _pad_rows(queries, token_rows, valid)
        piece_k = _pad_rows(keys, token_rows, valid) if keys is not None else None
        piece_v = _pad_rows(values, token_rows, valid) if values is not None else None
        max_context = int(piece_context.max())
        piece_pages = pages[seqs, : -(-max_context // block_size)]
        result, result_lse = _attend_piece(
            piece_q, piece_k, piece_v, k_cache, v_cache, piece_pages, piece_context, scale, value_dim
        )
        if token_rows is None:
            out.copy_(result.reshape(num_tokens, num_q_heads, value_dim))
            lse.copy_(result_lse.reshape(num_tokens, num_q_heads))
        else:
            out.index_copy_(0, token_rows, result[valid].to(out.dtype))
            lse.index_copy_(0, token_rows, result_lse[valid].to(lse.dtype))
    return out, lse

"""Test helpers: shard a sequence's K/V over simulated DCP ranks, and a float64 dense attention reference."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dcpserve.kernels import dcp_local_seq_lens, dcp_slot_mapping

Impl = str  # "ref" or "triton"

DTYPE_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@dataclass
class ShardedCache:
    """Per-rank paged caches of a DCP group holding the first `lens[i]` tokens of each sequence."""

    k_caches: list[torch.Tensor]  # N x [num_blocks, block_size, num_kv_heads, head_dim]
    v_caches: list[torch.Tensor | None]  # None: a key-only cache (values read from the keys, as MLA's latent)
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32, shared by every rank
    local_lens: list[torch.Tensor]  # N x [num_seqs] int32


def random_block_table(
    num_blocks_per_seq: list[int], generator: torch.Generator, extra_columns: int = 2, spare_pages: int = 3
) -> tuple[torch.Tensor, int]:
    """Shuffled, non-contiguous page ids per sequence; unused columns hold an out-of-range poison page id."""
    total = sum(num_blocks_per_seq) + spare_pages
    pages = torch.randperm(total, generator=generator)
    width = max(num_blocks_per_seq, default=0) + extra_columns
    poison = total + 1000
    table = torch.full((len(num_blocks_per_seq), width), poison, dtype=torch.int32)
    cursor = 0
    for row, count in enumerate(num_blocks_per_seq):
        table[row, :count] = pages[cursor : cursor + count].to(torch.int32)
        cursor += count
    return table, total


def shard_kv(
    keys: list[torch.Tensor],
    values: list[torch.Tensor] | None,
    dcp_size: int,
    block_size: int,
    interleave: int,
    store: Callable[..., None],
    generator: torch.Generator,
    device: torch.device,
) -> ShardedCache:
    """Stores each sequence's K/V ([L_i, num_kv_heads, head_dim]) on N simulated ranks through
    dcp_slot_mapping + `store`; unwritten cache slots stay NaN so any over-read shows. values None: key-only
    caches (v_caches are None)."""
    lens = [k.shape[0] for k in keys]
    tokens_per_block = block_size * dcp_size
    table, num_pages = random_block_table([-(-n // tokens_per_block) for n in lens], generator)
    num_kv_heads, head_dim = keys[0].shape[1:]
    dtype = keys[0].dtype
    table = table.to(device)
    seq_idx = torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(lens)]).to(device)
    positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens]).to(device)
    all_keys = torch.cat(keys).to(device)
    all_values = torch.cat(values).to(device) if values is not None else None
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    k_caches, v_caches, local_lens = [], [], []
    for rank in range(dcp_size):
        shape = (num_pages, block_size, num_kv_heads, head_dim)
        k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
        v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device) if values is not None else None
        slots = dcp_slot_mapping(table, seq_idx, positions, block_size, dcp_size, rank, interleave)
        store(all_keys, all_values, k_cache, v_cache, slots)
        local = dcp_local_seq_lens(seq_lens, dcp_size, rank, interleave)
        if int((slots >= 0).sum()) != int(local.sum()):
            raise AssertionError(
                f"rank {rank}: {(slots >= 0).sum()} owned slots but local lengths sum to {local.sum()}")
        k_caches.append(k_cache)
        v_caches.append(v_cache)
        local_lens.append(local)
    return ShardedCache(k_caches, v_caches, table, local_lens)


def dense_attention_f64(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, causal_offset: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention of q [M, Hq, D] over keys/values [L, Hk, D]. With causal_offset c, query i sees keys
    0 .. c + i; otherwise all. Returns out [M, Hq, D] and lse [M, Hq] (float64; empty rows 0 / -inf)."""
    num_q_heads = q.shape[1]
    group = num_q_heads // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,lhd->hml", q.double(), k) * scale
    if causal_offset is not None:
        rows = torch.arange(q.shape[0])[:, None]
        cols = torch.arange(keys.shape[0])[None, :]
        scores = scores.masked_fill((cols > rows + causal_offset).to(scores.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, M]
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = torch.einsum("hml,lhd->mhd", torch.exp(scores - safe[..., None]), v)
    return out, lse.T


def assert_close_rows(
    out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor, dtype: torch.dtype
) -> None:
    """Row-wise relative error of out (per token and head, against the row's max |ref|) within the dtype's
    bound, lse within the same bound (absolute, scaled by max(1, |lse|)); empty rows exactly 0 / -inf;
    NaN never passes."""
    tol = DTYPE_TOL[dtype]
    out64 = out.double().cpu()
    lse64 = lse.double().cpu()
    ref_out = ref_out.cpu()
    ref_lse = ref_lse.cpu()
    if torch.isnan(out64).any() or torch.isnan(lse64).any():
        raise AssertionError(
            f"NaN in output ({int(torch.isnan(out64).sum())} out, {int(torch.isnan(lse64).sum())} lse)")
    empty = torch.isinf(ref_lse)
    if not torch.equal(torch.isinf(lse64) & (lse64 < 0), empty):
        raise AssertionError("rows with no keys must have lse = -inf, and only those")
    if empty.any() and out64[empty].abs().max() != 0:
        raise AssertionError("rows with no keys must have out = 0")
    full = ~empty
    if not full.any():
        return
    err = (out64 - ref_out).abs().amax(-1)[full]
    scale = ref_out.abs().amax(-1)[full].clamp_min(1e-30)
    rel = (err / scale).max().item()
    if not rel <= tol:
        raise AssertionError(f"out relative error {rel:.3e} exceeds {tol:.0e} for {dtype}")
    lse_err = ((lse64[full] - ref_lse[full]).abs() / ref_lse[full].abs().clamp_min(1.0)).max().item()
    if not lse_err <= tol:
        raise AssertionError(f"lse error {lse_err:.3e} exceeds {tol:.0e} for {dtype}")

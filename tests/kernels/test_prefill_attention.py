"""Chunked prefill with a DCP-sharded context: context part on every rank + local causal part, merged with
combine_lse, against float64 dense causal attention over the whole sequence."""

from __future__ import annotations

import math

import pytest
import torch

from dcpserve.kernels import dcp_local_seq_lens
from tests.kernels.impls import ATTENTION_IMPLS, IMPLS, attention_params, poisoned
from tests.kernels.sharding import assert_close_rows, dense_attention_f64, shard_kv

# (dcp_size, block_size, interleave, num_kv_heads, group, head_dim)
CASES = [
    (1, 16, 1, 2, 4, 32),
    (2, 16, 2, 1, 8, 64),
    (3, 1, 1, 1, 4, 32),
    (4, 32, 32, 2, 1, 128),
    (8, 16, 1, 1, 4, 32),
]


def chunks(block_size: int, dcp_size: int) -> list[tuple[int, int]]:
    """(context already cached, new tokens in this chunk) per sequence: hostile mixes."""
    logical = block_size * dcp_size
    return [(0, 1), (0, logical + 1), (logical - 1, 3), (1, 0), (logical + 1, 17), (1328, 5), (5, 40)]


def build(case, dtype, impl, device):
    dcp_size, block_size, interleave, num_kv_heads, group, head_dim = case
    gen = torch.Generator().manual_seed(hash(case) % 2**31)
    spec = chunks(block_size, dcp_size)
    full_k = [torch.randn(c + n, num_kv_heads, head_dim, generator=gen).to(dtype) for c, n in spec]
    full_v = [torch.randn(c + n, num_kv_heads, head_dim, generator=gen).to(dtype) for c, n in spec]
    q = torch.randn(sum(n for _, n in spec), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    shards = shard_kv([k[:c] for k, (c, _) in zip(full_k, spec, strict=True)],
                      [v[:c] for v, (c, _) in zip(full_v, spec, strict=True)],
                      dcp_size, block_size, interleave, IMPLS[impl]["store_kv"], gen, device)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, spec, strict=True)]).to(device)
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, spec, strict=True)]).to(device)
    starts = torch.tensor([0] + [n for _, n in spec], dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    return spec, full_k, full_v, q.to(device), new_k, new_v, shards, starts


def check_against_dense(spec, full_k, full_v, q, out, lse, scale, dtype) -> None:
    row = 0
    for (ctx, n), k, v in zip(spec, full_k, full_v, strict=True):
        ref_out, ref_lse = dense_attention_f64(q[row : row + n].cpu(), k, v, scale, causal_offset=ctx)
        assert_close_rows(out[row : row + n], lse[row : row + n], ref_out, ref_lse, dtype)
        row += n


@pytest.mark.parametrize(("case", "dtype", "impl"), attention_params(CASES, ATTENTION_IMPLS))
def test_context_on_every_rank_plus_local_new_part(case, dtype, impl, device) -> None:
    """The engine's DCP path: N context-only partials + one new-token partial, one combine."""
    spec, full_k, full_v, q, new_k, new_v, shards, starts = build(case, dtype, impl, device)
    prefill = IMPLS[impl]["prefill"]
    scale = 1.0 / math.sqrt(q.shape[-1])
    context = torch.tensor([c for c, _ in spec], dtype=torch.int32, device=device)
    dcp_size, interleave = case[0], case[2]
    outs, lses = [], []
    for rank in range(dcp_size):
        local = dcp_local_seq_lens(context, dcp_size, rank, interleave)
        out = poisoned(tuple(q.shape), dtype, device)
        lse = poisoned(tuple(q.shape[:2]), torch.float32, device)
        prefill(q, None, None, shards.k_caches[rank], shards.v_caches[rank], shards.block_table, starts, local,
                scale, out=out, lse_out=lse)
        outs.append(out)
        lses.append(lse)
    no_context = torch.zeros_like(context)
    new_out, new_lse = prefill(q, new_k, new_v, shards.k_caches[0], shards.v_caches[0], shards.block_table,
                               starts, no_context, scale, max_query_len=max(n for _, n in spec))
    out, lse = IMPLS[impl]["combine"](torch.stack(outs + [new_out]), torch.stack(lses + [new_lse]))
    check_against_dense(spec, full_k, full_v, q, out, lse, scale, dtype)


@pytest.mark.parametrize("impl", ATTENTION_IMPLS)
@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: "N{}-B{}-I{}-kv{}-g{}-d{}".format(*c))
def test_new_part_fused_into_one_rank(case, impl, device) -> None:
    """Rank 0 computes its context and the new tokens in one call; the merge is the same."""
    dtype = torch.float32
    spec, full_k, full_v, q, new_k, new_v, shards, starts = build(case, dtype, impl, device)
    prefill = IMPLS[impl]["prefill"]
    scale = 0.3
    context = torch.tensor([c for c, _ in spec], dtype=torch.int32, device=device)
    dcp_size, interleave = case[0], case[2]
    outs, lses = [], []
    for rank in range(dcp_size):
        local = dcp_local_seq_lens(context, dcp_size, rank, interleave)
        k, v = (new_k, new_v) if rank == 0 else (None, None)
        o, lse = prefill(q, k, v, shards.k_caches[rank], shards.v_caches[rank], shards.block_table, starts, local,
                         scale)
        outs.append(o)
        lses.append(lse)
    out, lse = IMPLS[impl]["combine"](torch.stack(outs), torch.stack(lses))
    check_against_dense(spec, full_k, full_v, q, out, lse, scale, dtype)


@pytest.mark.parametrize("impl", ATTENTION_IMPLS)
def test_prefill_rejects_bad_arguments(impl, device) -> None:
    prefill = IMPLS[impl]["prefill"]
    q = torch.zeros(5, 4, 32, device=device)
    kv = torch.zeros(5, 2, 32, device=device)
    cache = torch.zeros(4, 16, 2, 32, device=device)
    table = torch.zeros(2, 3, dtype=torch.int32, device=device)
    lens = torch.zeros(2, dtype=torch.int32, device=device)
    starts = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="both key and value"):
        prefill(q, kv, None, cache, cache, table, starts, lens, 1.0)
    with pytest.raises(ValueError, match="query_start_loc must rise from 0 to num_tokens=5"):
        prefill(q, kv, kv, cache, cache, table, torch.tensor([0, 3, 2], dtype=torch.int32, device=device), lens, 1.0)
    with pytest.raises(ValueError, match="context_lens must be >= 0"):
        prefill(q, kv, kv, cache, cache, table, starts, lens - 1, 1.0)
    with pytest.raises(ValueError, match=r"key and value must be \[num_tokens, num_kv_heads, head_dim\]"):
        prefill(q, kv[:, :1], kv[:, :1], cache, cache, table, starts, lens, 1.0)

"""Paged decode attention on N simulated DCP ranks, merged with combine_lse, against float64 dense attention."""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels.impls import ATTENTION_IMPLS, IMPLS, attention_params, paged_decode_attention_split, poisoned
from tests.kernels.sharding import assert_close_rows, dense_attention_f64, shard_kv

# (dcp_size, block_size, interleave, num_kv_heads, group = q heads per kv head, head_dim)
CASES = [
    (1, 16, 1, 2, 1, 32),
    (1, 1, 1, 1, 8, 64),
    (2, 16, 1, 1, 4, 64),
    (2, 16, 2, 2, 8, 32),
    (2, 32, 32, 1, 1, 32),
    (3, 1, 1, 1, 4, 32),
    (3, 32, 32, 2, 1, 128),
    (4, 16, 16, 1, 8, 64),
    (4, 32, 2, 2, 1, 128),
    (4, 1, 1, 1, 1, 128),
    (8, 16, 1, 1, 4, 32),
    (8, 1, 1, 2, 8, 64),
    (8, 32, 2, 1, 4, 32),
]


def hostile_lengths(block_size: int, dcp_size: int) -> list[int]:
    logical = block_size * dcp_size
    return [0, 1, logical - 1, logical + 1, 1328, 2 * logical]


@pytest.mark.parametrize(("case", "dtype", "impl"), attention_params(CASES, ATTENTION_IMPLS))
def test_sharded_decode_matches_dense(case, dtype, impl, device) -> None:
    dcp_size, block_size, interleave, num_kv_heads, group, head_dim = case
    ops = IMPLS[impl]
    gen = torch.Generator().manual_seed(hash(case) % 2**31)
    lengths = hostile_lengths(block_size, dcp_size)
    keys = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in lengths]
    values = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in lengths]
    q = torch.randn(len(lengths), num_kv_heads * group, head_dim, generator=gen).to(dtype).to(device)
    scale = 1.0 / math.sqrt(head_dim)
    shards = shard_kv(keys, values, dcp_size, block_size, interleave, ops["store_kv"], gen, device)

    outs, lses = [], []
    for rank in range(dcp_size):
        out = poisoned(tuple(q.shape), dtype, device)
        lse = poisoned(tuple(q.shape[:2]), torch.float32, device)
        ops["decode"](q, shards.k_caches[rank], shards.v_caches[rank], shards.block_table,
                      shards.local_lens[rank], scale, out=out, lse_out=lse)
        outs.append(out)
        lses.append(lse)
    out, lse = ops["combine"](torch.stack(outs), torch.stack(lses))

    for i in range(len(lengths)):
        ref_out, ref_lse = dense_attention_f64(q[i : i + 1].cpu(), keys[i], values[i], scale)
        assert_close_rows(out[i : i + 1], lse[i : i + 1], ref_out, ref_lse, dtype)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 64])
def test_split_count_does_not_change_result(num_splits, device) -> None:
    """Flash-decoding splits (including more splits than tiles) merge to the unsplit result."""
    gen = torch.Generator().manual_seed(7)
    lengths = [0, 1, 33, 300]
    keys = [torch.randn(n, 1, 64, generator=gen) for n in lengths]
    values = [torch.randn(n, 1, 64, generator=gen) for n in lengths]
    q = torch.randn(len(lengths), 4, 64, generator=gen).to(device)
    shards = shard_kv(keys, values, 1, 16, 1, IMPLS["ref"]["store_kv"], gen, device)
    args = (q, shards.k_caches[0], shards.v_caches[0], shards.block_table, shards.local_lens[0], 0.125)
    ref_out, ref_lse = IMPLS["ref"]["decode"](*args)
    out, lse = paged_decode_attention_split(*args, num_splits=num_splits)
    assert_close_rows(out, lse, ref_out.double(), ref_lse.double(), torch.float32)


@pytest.mark.parametrize("impl", ATTENTION_IMPLS)
def test_decode_rejects_bad_arguments(impl, device) -> None:
    decode = IMPLS[impl]["decode"]
    q = torch.zeros(2, 6, 32, device=device)
    cache = torch.zeros(4, 16, 4, 32, device=device)
    table = torch.zeros(2, 3, dtype=torch.int32, device=device)
    lens = torch.zeros(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="num_q_heads=6 must be a multiple of num_kv_heads=4"):
        decode(q, cache, cache, table, lens, 1.0)
    with pytest.raises(ValueError, match=r"local_seq_lens must be \[num_seqs=2\]"):
        decode(q[:, :4], cache, cache, table, lens[:1], 1.0)
    with pytest.raises(TypeError, match="share a dtype"):
        decode(q[:, :4].half(), cache, cache, table, lens, 1.0)
    with pytest.raises(ValueError, match="out must be"):
        decode(q[:, :4], cache, cache, table, lens, 1.0, out=torch.zeros(2, 4, 16, device=device))

"""Attention whose values are narrower than its keys and read from the same cache (MLA: one cached vector per token,
[latent (kv_lora_rank) | rope key (qk_rope_head_dim)] = 576 wide; the values are its first 512 channels), with
head widths that are not powers of two. Decode and chunked prefill on N simulated DCP ranks, merged with
combine_lse, against float64 dense attention; outputs poisoned with NaN; every implementation."""

from __future__ import annotations

import math

import pytest
import torch

from dcpserve.kernels import dcp_local_seq_lens
from tests.kernels.impls import ATTENTION_IMPLS, IMPLS, poisoned
from tests.kernels.sharding import assert_close_rows, dense_attention_f64, shard_kv

DTYPES = [torch.float32, torch.float16]

# (dcp_size, block_size, interleave, num_q_heads, head_dim, v_head_dim, separate value cache)
CASES = [
    (1, 16, 1, 16, 576, 512, False),  # DeepSeek's widths: 512 + 64
    (2, 16, 1, 20, 576, 512, False),  # more heads than a Triton program packs at this width: two head blocks
    (4, 4, 2, 8, 44, 24, False),  # neither width a power of two, nor their difference
    (3, 8, 1, 4, 40, 40, False),  # values = the whole key (a key-only cache of MQA)
    (2, 16, 1, 4, 72, 36, True),  # a separate value cache of which the first 36 channels are the values
]
# The interpreter is slow: Triton runs the cases that exercise its two-tile channel split and head blocks.
TRITON_CASES = {CASES[1], CASES[2]}


def case_id(case: tuple) -> str:
    dcp, block, interleave, heads, dk, dv, separate = case
    return f"N{dcp}-B{block}-I{interleave}-h{heads}-dk{dk}-dv{dv}{'-sepv' if separate else ''}"


CASE_IMPLS = [pytest.param(case, impl, id=f"{case_id(case)}-{impl}") for case in CASES for impl in ATTENTION_IMPLS
              if impl != "triton" or case in TRITON_CASES]


def hostile_lengths(block_size: int, dcp_size: int) -> list[int]:
    logical = block_size * dcp_size
    return [0, 1, logical - 1, logical + 1, 333, 2 * logical]


def make_kv(lengths: list[int], head_dim: int, separate: bool, dtype: torch.dtype, gen: torch.Generator
            ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Per-sequence keys [L, 1, head_dim] and, for a separate value cache, values of the same width."""
    keys = [torch.randn(n, 1, head_dim, generator=gen).to(dtype) for n in lengths]
    values = [torch.randn(n, 1, head_dim, generator=gen).to(dtype) for n in lengths] if separate else None
    return keys, values


def value_rows(keys: torch.Tensor, values: torch.Tensor | None, v_head_dim: int) -> torch.Tensor:
    """What attention averages: the first v_head_dim channels of the value source (the keys without one)."""
    return (keys if values is None else values)[..., :v_head_dim]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case,impl", CASE_IMPLS)
def test_sharded_decode_with_narrower_values_matches_dense(case, impl, dtype, device) -> None:
    dcp_size, block_size, interleave, num_heads, head_dim, v_head_dim, separate = case
    ops = IMPLS[impl]
    gen = torch.Generator().manual_seed(hash(case) % 2**31)
    lengths = hostile_lengths(block_size, dcp_size)
    keys, values = make_kv(lengths, head_dim, separate, dtype, gen)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=gen).to(dtype).to(device)
    scale = 1.0 / math.sqrt(head_dim)
    shards = shard_kv(keys, values, dcp_size, block_size, interleave, ops["store_kv"], gen, device)

    outs, lses = [], []
    for rank in range(dcp_size):
        out = poisoned((len(lengths), num_heads, v_head_dim), dtype, device)
        lse = poisoned((len(lengths), num_heads), torch.float32, device)
        result = ops["decode"](q, shards.k_caches[rank], shards.v_caches[rank], shards.block_table,
                               shards.local_lens[rank], scale, out=out, lse_out=lse, v_head_dim=v_head_dim)
        assert result[0] is out and result[1] is lse
        outs.append(out)
        lses.append(lse)
    out, lse = ops["combine"](torch.stack(outs), torch.stack(lses))
    assert out.shape == (len(lengths), num_heads, v_head_dim)

    for i in range(len(lengths)):
        rows = value_rows(keys[i], values[i] if values is not None else None, v_head_dim)
        ref_out, ref_lse = dense_attention_f64(q[i : i + 1].cpu(), keys[i], rows, scale)
        assert_close_rows(out[i : i + 1], lse[i : i + 1], ref_out, ref_lse, dtype)


@pytest.mark.parametrize("case,impl", CASE_IMPLS)
def test_sharded_chunked_prefill_with_narrower_values_matches_dense(case, impl, device) -> None:
    """The engine's DCP prefill: context on every rank (no new tokens), the chunk's own causal part locally (the new
    values read from the new keys when the cache is key-only), one combine."""
    dcp_size, block_size, interleave, num_heads, head_dim, v_head_dim, separate = case
    dtype = torch.float32
    ops = IMPLS[impl]
    gen = torch.Generator().manual_seed(hash(case) % 2**31 + 1)
    logical = block_size * dcp_size
    spec = [(0, 1), (0, logical + 1), (logical - 1, 3), (1, 0), (logical + 1, 17), (100, 5)]
    full_k, full_v = make_kv([c + n for c, n in spec], head_dim, separate, dtype, gen)
    q = torch.randn(sum(n for _, n in spec), num_heads, head_dim, generator=gen).to(dtype).to(device)
    context_v = [v[:c] for v, (c, _) in zip(full_v, spec, strict=True)] if full_v is not None else None
    shards = shard_kv([k[:c] for k, (c, _) in zip(full_k, spec, strict=True)], context_v, dcp_size, block_size,
                      interleave, ops["store_kv"], gen, device)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, spec, strict=True)]).to(device)
    new_v = (torch.cat([v[c:] for v, (c, _) in zip(full_v, spec, strict=True)]).to(device) if full_v is not None
             else None)
    starts = torch.tensor([0] + [n for _, n in spec]).cumsum(0).to(torch.int32).to(device)
    context = torch.tensor([c for c, _ in spec], dtype=torch.int32, device=device)
    scale = 0.3
    shape = (q.shape[0], num_heads, v_head_dim)
    outs, lses = [], []
    for rank in range(dcp_size):
        out = poisoned(shape, dtype, device)
        lse = poisoned(shape[:2], torch.float32, device)
        local = dcp_local_seq_lens(context, dcp_size, rank, interleave)
        ops["prefill"](q, None, None, shards.k_caches[rank], shards.v_caches[rank], shards.block_table, starts,
                       local, scale, out=out, lse_out=lse, v_head_dim=v_head_dim)
        outs.append(out)
        lses.append(lse)
    new_out = poisoned(shape, dtype, device)
    new_lse = poisoned(shape[:2], torch.float32, device)
    ops["prefill"](q, new_k, new_v, shards.k_caches[0], shards.v_caches[0], shards.block_table, starts,
                   torch.zeros_like(context), scale, max(n for _, n in spec), out=new_out, lse_out=new_lse,
                   v_head_dim=v_head_dim)
    out, lse = ops["combine"](torch.stack(outs + [new_out]), torch.stack(lses + [new_lse]))
    row = 0
    for index, ((ctx, n), k) in enumerate(zip(spec, full_k, strict=True)):
        rows = value_rows(k, full_v[index] if full_v is not None else None, v_head_dim)
        ref_out, ref_lse = dense_attention_f64(q[row : row + n].cpu(), k, rows, scale, causal_offset=ctx)
        assert_close_rows(out[row : row + n], lse[row : row + n], ref_out, ref_lse, dtype)
        row += n


@pytest.mark.parametrize("impl", ATTENTION_IMPLS)
def test_one_call_prefill_and_the_same_tensor_as_value_cache(impl, device) -> None:
    """Without DCP one call does context + chunk; passing the key cache itself as v_cache (and the keys as values)
    is the same as a key-only cache."""
    dtype = torch.float32
    ops = IMPLS[impl]
    gen = torch.Generator().manual_seed(5)
    head_dim, v_head_dim, heads = 36, 20, 6
    spec = [(7, 4), (0, 9), (33, 1)]
    full_k, _ = make_kv([c + n for c, n in spec], head_dim, False, dtype, gen)
    q = torch.randn(sum(n for _, n in spec), heads, head_dim, generator=gen).to(device)
    shards = shard_kv([k[:c] for k, (c, _) in zip(full_k, spec, strict=True)], None, 1, 4, 1, ops["store_kv"], gen,
                      device)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, spec, strict=True)]).to(device)
    starts = torch.tensor([0, 4, 13, 14], dtype=torch.int32, device=device)
    context = torch.tensor([c for c, _ in spec], dtype=torch.int32, device=device)
    cache = shards.k_caches[0]
    key_only = ops["prefill"](q, new_k, None, cache, None, shards.block_table, starts, context, 0.2,
                              v_head_dim=v_head_dim)
    same = ops["prefill"](q, new_k, new_k, cache, cache, shards.block_table, starts, context, 0.2,
                          v_head_dim=v_head_dim)
    assert torch.equal(key_only[0], same[0]) and torch.equal(key_only[1], same[1])
    row = 0
    for (ctx, n), k in zip(spec, full_k, strict=True):
        ref_out, ref_lse = dense_attention_f64(q[row : row + n].cpu(), k, k[..., :v_head_dim], 0.2,
                                               causal_offset=ctx)
        assert_close_rows(key_only[0][row : row + n], key_only[1][row : row + n], ref_out, ref_lse, dtype)
        row += n
    decode_lens = torch.tensor([c for c, _ in spec], dtype=torch.int32, device=device)
    decode_q = q[:3].contiguous()
    key_only = ops["decode"](decode_q, cache, None, shards.block_table, decode_lens, 0.2, v_head_dim=v_head_dim)
    same = ops["decode"](decode_q, cache, cache, shards.block_table, decode_lens, 0.2, v_head_dim=v_head_dim)
    assert torch.equal(key_only[0], same[0]) and torch.equal(key_only[1], same[1])


@pytest.mark.parametrize("impl", ATTENTION_IMPLS)
def test_narrower_values_reject_bad_arguments(impl, device) -> None:
    decode, prefill = IMPLS[impl]["decode"], IMPLS[impl]["prefill"]
    q = torch.zeros(2, 4, 40, device=device)
    cache = torch.zeros(4, 16, 1, 40, device=device)
    table = torch.zeros(2, 3, dtype=torch.int32, device=device)
    lens = torch.zeros(2, dtype=torch.int32, device=device)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"v_head_dim must be an integer in \[1, head_dim=40\].*got 41"):
        decode(q, cache, None, table, lens, 1.0, v_head_dim=41)
    with pytest.raises(ValueError, match=r"v_head_dim must be an integer in \[1, head_dim=40\].*got 0"):
        prefill(q, None, None, cache, None, table, starts, lens, 1.0, v_head_dim=0)
    with pytest.raises(ValueError, match="value must be None when v_cache is None"):
        prefill(q, q[:, :1], q[:, :1], cache, None, table, starts, lens, 1.0, v_head_dim=32)
    with pytest.raises(ValueError, match="out must be"):
        decode(q, cache, None, table, lens, 1.0, v_head_dim=32, out=torch.zeros(2, 4, 40, device=device))


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_key_only_store_writes_the_keys_and_nothing_else(impl, device) -> None:
    store = IMPLS[impl]["store_kv"]
    key = torch.randn(6, 1, 36, device=device)
    cache = torch.full((3, 4, 1, 36), float("nan"), device=device)
    slots = torch.tensor([5, -1, 0, 11, -1, 2], device=device)
    store(key, None, cache, None, slots)
    flat = cache.reshape(-1, 1, 36)
    owned = slots >= 0
    assert torch.equal(flat[slots[owned]], key[owned])
    assert int((~torch.isnan(flat[:, 0, 0])).sum()) == int(owned.sum())
    with pytest.raises(ValueError, match="pass value and v_cache together"):
        store(key, key, cache, None, slots)

"""The CPU attention kernels on the batch shapes their vectorized paths special-case, and their errors against the
references'. (The shared decode / prefill suites run them on DCP-sharded hostile lengths too.)"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from dcpserve.kernels import (
    paged_decode_attention_cpu,
    paged_decode_attention_ref,
    paged_prefill_attention_cpu,
    paged_prefill_attention_ref,
    store_kv_ref,
)
from dcpserve.kernels.cpu_attention import _pieces
from tests.kernels.impls import poisoned
from tests.kernels.sharding import assert_close_rows, dense_attention_f64, shard_kv

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def run_prefill(spec: list[tuple[int, int]], num_kv_heads: int, group: int, head_dim: int, block_size: int,
                dtype: torch.dtype, with_new: bool = True) -> None:
    """One cpu prefill call over (context, chunk) per sequence on one rank, against float64 dense attention."""
    gen = torch.Generator().manual_seed(len(spec) * 1000 + sum(c + 7 * n for c, n in spec))
    full_k = [torch.randn(c + n, num_kv_heads, head_dim, generator=gen).to(dtype) for c, n in spec]
    full_v = [torch.randn(c + n, num_kv_heads, head_dim, generator=gen).to(dtype) for c, n in spec]
    q = torch.randn(sum(n for _, n in spec), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    shards = shard_kv([k[:c] for k, (c, _) in zip(full_k, spec, strict=True)],
                      [v[:c] for v, (c, _) in zip(full_v, spec, strict=True)],
                      1, block_size, 1, store_kv_ref, gen, CPU)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, spec, strict=True)]) if with_new else None
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, spec, strict=True)]) if with_new else None
    starts = torch.tensor([0] + [n for _, n in spec]).cumsum(0).to(torch.int32)
    context = torch.tensor([c for c, _ in spec], dtype=torch.int32)
    scale = 1.0 / math.sqrt(head_dim)
    out = poisoned(tuple(q.shape), dtype, CPU)
    lse = poisoned(tuple(q.shape[:2]), torch.float32, CPU)
    paged_prefill_attention_cpu(q, new_k, new_v, shards.k_caches[0], shards.v_caches[0], shards.block_table, starts,
                                context, scale, out=out, lse_out=lse)
    row = 0
    for (ctx, n), k, v in zip(spec, full_k, full_v, strict=True):
        keys, values = (k, v) if with_new else (k[:ctx], v[:ctx])
        ref_out, ref_lse = dense_attention_f64(q[row : row + n], keys, values, scale,
                                               causal_offset=ctx if with_new else None)
        assert_close_rows(out[row : row + n], lse[row : row + n], ref_out, ref_lse, dtype)
        row += n


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", [
    [(0, 33), (1328, 33), (1, 33), (17, 33)],  # equal chunks: the unpadded path, contexts from none to long
    [(0, 1), (5000, 1), (17, 1), (0, 1), (16, 1)],  # chunks of one token: decode-like prefill
    [(0, 300), (2000, 1), (0, 0), (31, 64)],  # one long chunk beside a one-token chunk, an empty sequence
    [(32, 5), (32, 7), (64, 3)],  # contexts of whole pages: pieces with nothing to mask run without a mask
], ids=["equal-chunks", "one-token-chunks", "mixed", "whole-pages"])
def test_prefill_batches(spec, dtype) -> None:
    run_prefill(spec, num_kv_heads=2, group=4, head_dim=32, block_size=16, dtype=dtype)


@pytest.mark.parametrize("spec", [
    [(0, 3), (0, 1)],  # no sequence has context: every row empty
    [(0, 3), (40, 5), (0, 0), (16, 2)],
], ids=["no-context", "mixed"])
def test_prefill_context_only(spec) -> None:
    run_prefill(spec, num_kv_heads=1, group=8, head_dim=64, block_size=16, dtype=torch.float32, with_new=False)


def test_prefill_float64_is_exact() -> None:
    """fp64 inputs compute in fp64: far inside fp32's bound."""
    spec = [(0, 9), (70, 4), (3, 1)]
    gen = torch.Generator().manual_seed(3)
    full_k = [torch.randn(c + n, 1, 16, generator=gen, dtype=torch.float64) for c, n in spec]
    full_v = [torch.randn(c + n, 1, 16, generator=gen, dtype=torch.float64) for c, n in spec]
    q = torch.randn(sum(n for _, n in spec), 2, 16, generator=gen, dtype=torch.float64)
    shards = shard_kv([k[:c] for k, (c, _) in zip(full_k, spec, strict=True)],
                      [v[:c] for v, (c, _) in zip(full_v, spec, strict=True)],
                      1, 4, 1, store_kv_ref, gen, CPU)
    starts = torch.tensor([0, 9, 13, 14], dtype=torch.int32)
    context = torch.tensor([c for c, _ in spec], dtype=torch.int32)
    out, lse = paged_prefill_attention_cpu(
        q, torch.cat([k[c:] for k, (c, _) in zip(full_k, spec, strict=True)]),
        torch.cat([v[c:] for v, (c, _) in zip(full_v, spec, strict=True)]),
        shards.k_caches[0], shards.v_caches[0], shards.block_table, starts, context, 0.25)
    assert out.dtype == torch.float64 and lse.dtype == torch.float32
    row = 0
    for (ctx, n), k, v in zip(spec, full_k, full_v, strict=True):
        ref_out, ref_lse = dense_attention_f64(q[row : row + n], k, v, 0.25, causal_offset=ctx)
        assert (out[row : row + n] - ref_out).abs().max() < 1e-12
        assert (lse[row : row + n].double() - ref_lse).abs().max() < 1e-5
        row += n


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lengths", [[0, 4099, 0, 1, 16], [64, 64, 64], [0, 0, 5]],
                         ids=["zero-beside-long", "equal-full-pages", "mostly-empty"])
def test_decode_batches(lengths, dtype) -> None:
    gen = torch.Generator().manual_seed(sum(lengths))
    keys = [torch.randn(n, 1, 32, generator=gen).to(dtype) for n in lengths]
    values = [torch.randn(n, 1, 32, generator=gen).to(dtype) for n in lengths]
    q = torch.randn(len(lengths), 4, 32, generator=gen).to(dtype)
    shards = shard_kv(keys, values, 1, 16, 1, store_kv_ref, gen, CPU)
    out = poisoned(tuple(q.shape), dtype, CPU)
    lse = poisoned(tuple(q.shape[:2]), torch.float32, CPU)
    paged_decode_attention_cpu(q, shards.k_caches[0], shards.v_caches[0], shards.block_table, shards.local_lens[0],
                               0.2, out=out, lse_out=lse)
    for i in range(len(lengths)):
        ref_out, ref_lse = dense_attention_f64(q[i : i + 1], keys[i], values[i], 0.2)
        assert_close_rows(out[i : i + 1], lse[i : i + 1], ref_out, ref_lse, dtype)


@pytest.mark.parametrize("lengths", [[0, 4099, 0, 1, 16], [64, 64, 64], [0, 0, 0]])
def test_a_step_plan_gives_the_same_bits_in_every_layer(lengths: list[int]) -> None:
    """The engine plans a decode step once (plan_decode_cpu) and every layer reuses it: the same output as planning
    in the call, for another layer's cache too; a plan made for another batch is refused."""
    from dcpserve.kernels import plan_decode_cpu

    gen = torch.Generator().manual_seed(len(lengths))
    keys = [torch.randn(n, 1, 32, generator=gen) for n in lengths]
    values = [torch.randn(n, 1, 32, generator=gen) for n in lengths]
    shards = shard_kv(keys, values, 1, 16, 1, store_kv_ref, gen, CPU)
    table, lens = shards.block_table, shards.local_lens[0]
    k_cache, v_cache = shards.k_caches[0], shards.v_caches[0]
    assert v_cache is not None
    # A second layer: other cache contents (stale slots included) under the same block table.
    other = (torch.randn(k_cache.shape, generator=gen), torch.randn(v_cache.shape, generator=gen))
    layers = [(k_cache, v_cache), other]
    plan = plan_decode_cpu(table, lens, k_cache.shape[0], 16, torch.float32)
    assert (plan is None) == (max(lengths) == 0)
    for layer_k, layer_v in layers:
        q = torch.randn(len(lengths), 4, 32, generator=gen)
        planned = paged_decode_attention_cpu(q, layer_k, layer_v, table, lens, 0.2, plan=plan)
        direct = paged_decode_attention_cpu(q, layer_k, layer_v, table, lens, 0.2)
        assert torch.equal(planned[0], direct[0]) and torch.equal(planned[1], direct[1])
    if plan is not None:
        with pytest.raises(ValueError, match="the plan was made for"):
            paged_decode_attention_cpu(q[:1], k_cache, v_cache, table[:1], lens[:1], 0.2, plan=plan)


@pytest.mark.parametrize("lengths", [[0, 4099, 0, 1, 16], [64, 64, 64], [5, 3, 7, 40]])
def test_a_finite_tail_plan_masks_without_zeroing(lengths: list[int]) -> None:
    """finite_tail: the caller keeps every slot past each length finite (the engine zeroes fresh pages, and padding
    columns repeat the row's own last page), so the plan skips zeroing the gathered tails: the -inf mask alone
    gives those slots zero weight, the same bits as the default plan."""
    from dcpserve.kernels import plan_decode_cpu

    gen = torch.Generator().manual_seed(sum(lengths) + 1)
    keys = [torch.randn(n, 1, 32, generator=gen) for n in lengths]
    values = [torch.randn(n, 1, 32, generator=gen) for n in lengths]
    shards = shard_kv(keys, values, 1, 16, 1, store_kv_ref, gen, CPU)
    table, lens = shards.block_table, shards.local_lens[0]
    caches = []
    v_cache = shards.v_caches[0]
    assert v_cache is not None
    for cache in (shards.k_caches[0], v_cache):  # never-written slots: stale finite values, not NaN
        cache = cache.clone()
        stale = torch.isnan(cache)
        cache[stale] = 100 * torch.randn(int(stale.sum()), generator=gen)
        caches.append(cache)
    q = torch.randn(len(lengths), 4, 32, generator=gen)
    num_blocks = caches[0].shape[0]
    k_cache, v_cache = caches
    zeroed = paged_decode_attention_cpu(q, k_cache, v_cache, table, lens, 0.2,
                                        plan=plan_decode_cpu(table, lens, num_blocks, 16, torch.float32))
    masked = paged_decode_attention_cpu(q, k_cache, v_cache, table, lens, 0.2, plan=plan_decode_cpu(
        table, lens, num_blocks, 16, torch.float32, validate=False, finite_tail=True))
    assert torch.equal(zeroed[0], masked[0]) and torch.equal(zeroed[1], masked[1])
    for i in range(len(lengths)):
        ref_out, ref_lse = dense_attention_f64(q[i : i + 1], keys[i], values[i], 0.2)
        assert_close_rows(masked[0][i : i + 1], masked[1][i : i + 1], ref_out, ref_lse, torch.float32)


def test_pieces_group_alike_sequences() -> None:
    """One piece for alike sequences; a long one apart from short ones; no sequence twice or lost."""
    lens = torch.tensor([4096, 4000, 3, 0, 2, 4096])
    chunks = torch.tensor([2048, 2048, 2048, 5, 1, 1])
    assert [p.tolist() for p in _pieces(lens > 0, lens)] == [[0, 1, 5], [2], [4]]
    pieces = _pieces(torch.ones(6, dtype=torch.bool), chunks, lens)
    assert sorted(i for p in pieces for i in p.tolist()) == list(range(6))
    assert [p.tolist() for p in pieces] == [[0, 1], [2], [3], [5], [4]]
    assert [p.tolist() for p in _pieces(torch.ones(3, dtype=torch.bool), torch.full((3,), 7))] == [[0, 1, 2]]
    assert _pieces(torch.zeros(2, dtype=torch.bool), torch.ones(2, dtype=torch.int64)) == []


def test_empty_batches() -> None:
    cache = torch.zeros(4, 16, 1, 32)
    q = torch.zeros(0, 4, 32)
    table = torch.zeros(0, 2, dtype=torch.int32)
    lens = torch.zeros(0, dtype=torch.int32)
    out, lse = paged_decode_attention_cpu(q, cache, cache, table, lens, 1.0)
    assert out.shape == (0, 4, 32) and lse.shape == (0, 4)
    starts = torch.zeros(3, dtype=torch.int32)  # two sequences, no tokens
    out, lse = paged_prefill_attention_cpu(q, q[:, :1], q[:, :1], cache, cache, torch.zeros(2, 2, dtype=torch.int32),
                                           starts, torch.tensor([5, 0], dtype=torch.int32), 1.0)
    assert out.shape == (0, 4, 32) and lse.shape == (0, 4)


def raised(fn: Callable[..., object], *args: object, **kwargs: object) -> tuple[type, str]:
    with pytest.raises(Exception) as info:
        fn(*args, **kwargs)
    return type(info.value), str(info.value)


def test_errors_match_the_references() -> None:
    """The same bad inputs raise the same exception, with the same message, as the references."""
    cache = torch.zeros(4, 16, 1, 32)
    q = torch.zeros(3, 4, 32)
    kv = torch.zeros(3, 1, 32)
    table = torch.tensor([[0, 1], [2, 9], [-1, 3]], dtype=torch.int32)
    starts = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    decode_cases = [
        (q, cache, cache, table, torch.tensor([16, 17, 1], dtype=torch.int32)),  # page 9 of 4
        (q, cache, cache, table, torch.tensor([1, 1, 1], dtype=torch.int32)),  # page -1
        (q, cache, cache, table, torch.tensor([33, 1, 1], dtype=torch.int32)),  # more pages than columns
        (q, cache, cache, table, torch.tensor([3, -2, 1], dtype=torch.int32)),
        (q, cache, cache.half(), table, torch.tensor([3, 2, 1], dtype=torch.int32)),
    ]
    for args in decode_cases:
        assert raised(paged_decode_attention_cpu, *args, 1.0) == raised(paged_decode_attention_ref, *args, 1.0)
    prefill_cases = [
        torch.tensor([16, 17, 1], dtype=torch.int32),  # second sequence: page 9 of 4
        torch.tensor([16, 1, 1], dtype=torch.int32),  # third sequence: page -1
        torch.tensor([5, 40, 1], dtype=torch.int32),  # second sequence: more pages than columns
        torch.tensor([5, 1, -3], dtype=torch.int32),
    ]
    for context in prefill_cases:
        prefill_args = (q, kv, kv, cache, cache, table, starts, context, 1.0)
        assert raised(paged_prefill_attention_cpu, *prefill_args) == raised(paged_prefill_attention_ref, *prefill_args)
    # A sequence without new tokens is not read: its bad page is no error for either.
    skip = torch.tensor([0, 1, 1, 2], dtype=torch.int32)
    context = torch.tensor([1, 17, 0], dtype=torch.int32)
    out, lse = paged_prefill_attention_cpu(q[:2], kv[:2], kv[:2], cache, cache, table, skip, context, 1.0)
    ref_out, ref_lse = paged_prefill_attention_ref(q[:2], kv[:2], kv[:2], cache, cache, table, skip, context, 1.0)
    assert torch.allclose(out, ref_out) and torch.allclose(lse, ref_lse)


def test_refuses_cuda_tensors() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cache = torch.zeros(4, 16, 1, 32, device="cuda")
    q = torch.zeros(1, 4, 32, device="cuda")
    table = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="paged_decode_attention_cpu runs on CPU tensors"):
        paged_decode_attention_cpu(q, cache, cache, table, torch.ones(1, dtype=torch.int32, device="cuda"), 1.0)

"""store_kv writes exactly the owned slots, bit for bit, and nothing else."""

from __future__ import annotations

import re

import pytest
import torch

from dcpserve.kernels import StorePlan, dcp_slot_mapping, store_kv_planned, store_kv_ref
from tests.kernels.impls import IMPLS, TEST_DTYPES


@pytest.mark.parametrize("dtype", TEST_DTYPES, ids=str)
@pytest.mark.parametrize("block_size,dcp_size,interleave,num_kv_heads,head_dim", [
    (1, 1, 1, 1, 32), (16, 2, 1, 2, 64), (16, 4, 16, 1, 128), (32, 3, 2, 4, 32), (16, 8, 1, 1, 80),
])
def test_triton_store_equals_reference_exactly(block_size, dcp_size, interleave, num_kv_heads, head_dim,
                                               dtype, device) -> None:
    gen = torch.Generator().manual_seed(block_size * 131 + dcp_size)
    num_tokens = 3 * block_size * dcp_size + max(1, block_size * dcp_size // 2)  # 4 logical blocks
    num_pages = 8
    table = torch.randperm(num_pages, generator=gen)[:4].reshape(1, 4).to(torch.int32).to(device)
    positions = torch.randperm(num_tokens, generator=gen).to(device)  # scattered order, like a real batch
    seq_idx = torch.zeros_like(positions)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    for rank in range(dcp_size):
        slots = dcp_slot_mapping(table, seq_idx, positions, block_size, dcp_size, rank, interleave)
        caches = {}
        for impl in ("ref", "triton"):
            shape = (num_pages, block_size, num_kv_heads, head_dim)
            k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
            v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
            IMPLS[impl]["store_kv"](key, value, k_cache, v_cache, slots)
            caches[impl] = (k_cache, v_cache)
        for ref, got in zip(caches["ref"], caches["triton"], strict=True):
            assert torch.equal(torch.isnan(ref), torch.isnan(got))
            assert torch.equal(ref.nan_to_num(0.0), got.nan_to_num(0.0))
        # Every owned token landed at its slot; the number of written slots equals the owned count.
        k_cache = caches["triton"][0].reshape(-1, num_kv_heads, head_dim)
        owned = slots >= 0
        assert torch.equal(k_cache[slots[owned]], key[owned])
        written = (~torch.isnan(k_cache[:, 0, 0])).sum().item()
        assert written == owned.sum().item()


@pytest.mark.parametrize("impl", ["ref", "triton", "cpu"])
def test_store_with_no_owned_tokens_changes_nothing(impl, device) -> None:
    key = torch.randn(5, 1, 32, device=device)
    k_cache = torch.zeros(2, 4, 1, 32, device=device)
    v_cache = torch.zeros(2, 4, 1, 32, device=device)
    IMPLS[impl]["store_kv"](key, key, k_cache, v_cache, torch.full((5,), -1, device=device))
    assert not k_cache.any() and not v_cache.any()
    IMPLS[impl]["store_kv"](key[:0], key[:0], k_cache, v_cache, torch.zeros(0, dtype=torch.int64, device=device))
    assert not k_cache.any()


@pytest.mark.parametrize("impl", ["ref", "triton", "cpu"])
def test_store_rejects_mismatched_arguments(impl, device) -> None:
    store = IMPLS[impl]["store_kv"]
    key = torch.randn(5, 2, 32, device=device)
    cache = torch.zeros(2, 4, 2, 32, device=device)
    slots = torch.zeros(5, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="num_kv_heads, head_dim"):
        store(key[:, :1], key[:, :1], cache, cache, slots)
    with pytest.raises(ValueError, match=r"slot_mapping must be \[num_tokens=5\]"):
        store(key, key, cache, cache, slots[:4])
    with pytest.raises(TypeError, match="must match the cache"):
        store(key.half(), key.half(), cache, cache, slots)
    with pytest.raises(TypeError, match="int32 or int64"):
        store(key, key, cache, cache, slots.float())


@pytest.mark.parametrize("key_only", [False, True], ids=["kv", "key_only"])
@pytest.mark.parametrize("num_tokens,dcp_size", [(1, 2), (1, 1), (7, 2), (40, 4), (40, 1)])
def test_a_step_store_plan_gives_the_reference_bits_in_every_layer(num_tokens, dcp_size, key_only) -> None:
    # The engine's CPU path: one StorePlan per step, reused by each layer's caches (here three layers, one of them a
    # non-contiguous cache), every rank of the DCP group: at batch 1 all but one rank own none of the step's tokens.
    gen = torch.Generator().manual_seed(num_tokens * 7 + dcp_size)
    block_size, num_pages, heads, dim = 4, 16, 2, 8
    table = torch.randperm(num_pages, generator=gen)[:12].reshape(1, 12).to(torch.int32)
    positions = torch.randperm(num_tokens, generator=gen) + 3
    for rank in range(dcp_size):
        slots = dcp_slot_mapping(table, torch.zeros_like(positions), positions, block_size, dcp_size, rank, 1)
        plan = StorePlan(slots, all_owned=dcp_size == 1)
        assert (plan.slots is None) == bool((slots < 0).all())
        for layer in range(3):
            key = torch.randn(num_tokens, heads, dim, generator=gen)
            value = None if key_only else torch.randn(num_tokens, heads, dim, generator=gen)
            got: list[torch.Tensor] = []
            want: list[torch.Tensor] = []
            for store, out in ((store_kv_ref, want), (None, got)):
                shape = (num_pages, block_size, heads, dim)
                caches = [torch.full(shape, float("nan")) for _ in range(1 if key_only else 2)]
                if layer == 2:  # a strided view: the per-slot assignment path
                    caches = [torch.full((num_pages, block_size, heads, 2 * dim), float("nan"))[..., :dim]
                              for _ in caches]
                v_cache = None if key_only else caches[1]
                if store is None:
                    store_kv_planned(key, value, caches[0], v_cache, slots, plan)
                else:
                    store(key, value, caches[0], v_cache, slots)
                out.extend(caches)
            for a, b in zip(want, got, strict=True):
                assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def test_a_store_plan_refuses_a_slot_mapping_that_is_not_one_int_vector() -> None:
    with pytest.raises(TypeError, match="slot_mapping must be int32 or int64, got torch.float32"):
        StorePlan(torch.zeros(3, dtype=torch.float32))
    with pytest.raises(ValueError, match=re.escape("slot_mapping must be [num_tokens], got (2, 3)")):
        StorePlan(torch.zeros(2, 3, dtype=torch.int64))

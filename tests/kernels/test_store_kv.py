"""store_kv writes exactly the owned slots, bit for bit, and nothing else."""

from __future__ import annotations

import pytest
import torch

from dcpserve.kernels import dcp_slot_mapping
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


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_store_with_no_owned_tokens_changes_nothing(impl, device) -> None:
    key = torch.randn(5, 1, 32, device=device)
    k_cache = torch.zeros(2, 4, 1, 32, device=device)
    v_cache = torch.zeros(2, 4, 1, 32, device=device)
    IMPLS[impl]["store_kv"](key, key, k_cache, v_cache, torch.full((5,), -1, device=device))
    assert not k_cache.any() and not v_cache.any()
    IMPLS[impl]["store_kv"](key[:0], key[:0], k_cache, v_cache, torch.zeros(0, dtype=torch.int64, device=device))
    assert not k_cache.any()


@pytest.mark.parametrize("impl", ["ref", "triton"])
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

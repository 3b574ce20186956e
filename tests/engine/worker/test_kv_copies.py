"""A rank's host KV pool (dcpserve/engine/worker/kv_copies.py) on CPU: its pages in the device cache's layout (every
layer, K and V or a key-only cache once), a step's copies in their order (swap-outs, then swap-ins that may read a
slot written by this step's swap-outs), untouched pages and slots left as they were, and the counters."""

from __future__ import annotations

import pytest
import torch

from dcpserve.engine.kv_cache import KvCacheSpec
from dcpserve.engine.worker.kv_copies import HostKvPool


@pytest.mark.parametrize("has_value_cache", [True, False], ids=["kv", "key_only"])
def test_a_steps_copies_move_whole_pages_in_order(has_value_cache: bool) -> None:
    spec = KvCacheSpec(num_layers=3, num_kv_heads=2, head_dim=4, has_value_cache=has_value_cache)
    caches = spec.allocate(num_blocks=6, block_size=2, dtype=torch.float32, device="cpu")
    tensors = [t for keys, values in caches for t in ((keys,) if values is keys else (keys, values))]
    for index, tensor in enumerate(tensors):
        tensor.copy_(torch.randn(tensor.shape, generator=torch.Generator().manual_seed(index)))
    before = [t.clone() for t in tensors]
    pool = HostKvPool(4, caches)
    assert pool.bytes_per_slot == 2 * spec.bytes_per_token(torch.float32)
    pool.apply(swap_out=[(1, 3), (4, 0)], swap_in=[])
    # Page 2 is evicted into slot 1 and read back into page 5 in one step; slot 3 (page 1's) goes to page 0.
    pool.apply(swap_out=[(2, 1)], swap_in=[(1, 5), (3, 0)])
    for tensor, old in zip(tensors, before, strict=True):
        assert torch.equal(tensor[5], old[2]) and torch.equal(tensor[0], old[1])
        assert torch.equal(tensor[1:5], old[1:5])  # pages no copy wrote are untouched
    counters = pool.counters
    assert (counters.blocks_out, counters.blocks_in) == (3, 2)
    assert (counters.bytes_out, counters.bytes_in) == (3 * pool.bytes_per_slot, 2 * pool.bytes_per_slot)
    assert counters.seconds_out > 0 and counters.seconds_in > 0 and pool.last_seconds()[1] > 0
    with pytest.raises(ValueError, match="at least one slot"):
        HostKvPool(0, caches)

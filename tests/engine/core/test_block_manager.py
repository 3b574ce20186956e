"""Logical KV blocks: promises, allocation, freeing, and the one blocks_needed() rule."""

from __future__ import annotations

import pytest

from dcpserve.engine.core.block_manager import BlockManager, blocks_needed, num_blocks_for_budget
from dcpserve.engine.core.request import Request
from dcpserve.engine.sampling_params import SamplingParams


def request(name: str = "r", prompt: int = 10, max_tokens: int = 5) -> Request:
    return Request(name, list(range(prompt)), SamplingParams(max_tokens=max_tokens))


def test_blocks_needed_counts_logical_blocks_of_block_size_times_dcp() -> None:
    assert blocks_needed(0, 32) == 0
    assert blocks_needed(1, 32) == 1
    assert blocks_needed(32, 32) == 1
    assert blocks_needed(33, 32) == 2
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        blocks_needed(-1, 32)
    manager = BlockManager(num_blocks=10, block_size=16, dcp_size=4)
    assert manager.tokens_per_block == 64
    assert manager.capacity_tokens == 640
    assert manager.blocks_for(65) == 2


def test_budget_gives_pages_per_rank() -> None:
    # 1 MiB per rank, 16-token pages, 512 bytes per token per rank -> 128 pages.
    assert num_blocks_for_budget(1 << 20, 16, 512) == 128


def test_promises_are_kept_and_accounted() -> None:
    manager = BlockManager(num_blocks=10, block_size=4, dcp_size=2)  # 8 tokens per block
    a = request("a")
    assert manager.reserve(a, 40)  # 5 blocks promised
    usage = manager.usage()
    assert (usage.used, usage.reserved, usage.free) == (0, 5, 5)
    assert manager.allocate(a, 9)  # 2 blocks, from the promise
    usage = manager.usage()
    assert (usage.used, usage.reserved, usage.free) == (2, 5, 5)
    b = request("b")
    assert not manager.reserve(b, 48)  # 6 blocks > 5 free: refused, nothing changed
    assert b.reserved_blocks == 0 and manager.usage().reserved == 5
    assert manager.reserve(b, 40)
    assert manager.num_free_blocks == 0
    # a's promise still holds even though the pool has no unpromised blocks.
    assert manager.allocate(a, 40)
    assert not manager.allocate(a, 41)  # beyond its promise and nothing free
    manager.free(a)
    manager.free(b)
    usage = manager.usage()
    assert (usage.used, usage.reserved, usage.free) == (0, 0, 10)
    assert a.block_ids == [] and a.reserved_blocks == 0


def test_allocation_beyond_promise_uses_free_blocks_only() -> None:
    manager = BlockManager(num_blocks=3, block_size=1, dcp_size=1)
    a, b = request("a"), request("b")
    assert manager.reserve(a, 1) and manager.reserve(b, 2)
    assert manager.allocate(a, 1)
    assert not manager.allocate(a, 2)  # the only other blocks are b's promise
    assert manager.allocate(b, 2)
    assert sorted(a.block_ids + b.block_ids) == [0, 1, 2]  # distinct blocks


def test_empty_pool_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="raise the KV memory budget"):
        BlockManager(num_blocks=0, block_size=16, dcp_size=1)

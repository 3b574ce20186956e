"""The ownership rule, slot mapping and local lengths (docs/dcp.md), by example and by property."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcpserve.kernels import dcp_local_seq_lens, dcp_slot_mapping, dcp_token_owner


def test_worked_example_nine_tokens_two_ranks_interleave_one() -> None:
    # B=2, N=2: logical blocks of 4 tokens; pages 5, 1, 7 (deliberately not contiguous).
    table = torch.tensor([[5, 1, 7]], dtype=torch.int32)
    positions = torch.arange(9)
    seq_idx = torch.zeros(9, dtype=torch.int64)
    rank0 = dcp_slot_mapping(table, seq_idx, positions, 2, 2, 0)
    rank1 = dcp_slot_mapping(table, seq_idx, positions, 2, 2, 1)
    assert rank0.tolist() == [10, -1, 11, -1, 2, -1, 3, -1, 14]
    assert rank1.tolist() == [-1, 10, -1, 11, -1, 2, -1, 3, -1]
    lens = torch.tensor([9])
    assert dcp_local_seq_lens(lens, 2, 0).tolist() == [5]
    assert dcp_local_seq_lens(lens, 2, 1).tolist() == [4]


def test_worked_example_interleave_two() -> None:
    # B=4, N=2, I=2: positions 0,1 -> rank 0; 2,3 -> rank 1; 4,5 -> rank 0; ...
    owner = dcp_token_owner(torch.arange(9), 2, 2)
    assert owner.tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 0]
    table = torch.tensor([[3, 0]], dtype=torch.int32)
    slots = dcp_slot_mapping(table, torch.zeros(9, dtype=torch.int64), torch.arange(9), 4, 2, 1, 2)
    assert slots.tolist() == [-1, -1, 12, 13, -1, -1, 14, 15, -1]
    assert dcp_local_seq_lens(torch.tensor([9]), 2, 0, 2).tolist() == [5]
    assert dcp_local_seq_lens(torch.tensor([9]), 2, 1, 2).tolist() == [4]


@settings(max_examples=300, deadline=None)
@given(
    dcp_size=st.integers(1, 8),
    block_size=st.sampled_from([1, 2, 4, 16, 32]),
    interleave_choice=st.integers(0, 5),
    seq_lens=st.lists(st.integers(0, 700), min_size=1, max_size=4),
)
def test_ownership_properties(dcp_size, block_size, interleave_choice, seq_lens) -> None:
    divisors = [d for d in range(1, block_size + 1) if block_size % d == 0]
    interleave = divisors[interleave_choice % len(divisors)]
    tokens_per_block = block_size * dcp_size
    blocks = [-(-n // tokens_per_block) for n in seq_lens]
    width = max(max(blocks), 1)
    # Distinct pages for every (sequence, block): a shuffled range.
    pages = torch.randperm(len(seq_lens) * width, generator=torch.Generator().manual_seed(sum(seq_lens)))
    table = pages.reshape(len(seq_lens), width).to(torch.int32)
    seq_idx = torch.cat([torch.full((n,), i) for i, n in enumerate(seq_lens)]).to(torch.int64)
    positions = torch.cat([torch.arange(n) for n in seq_lens]).to(torch.int64)
    lens = torch.tensor(seq_lens)

    per_rank = [dcp_slot_mapping(table, seq_idx, positions, block_size, dcp_size, r, interleave)
                for r in range(dcp_size)]
    owned = torch.stack([s >= 0 for s in per_rank])
    # Every position has exactly one owner, and it is the rule's owner.
    assert torch.equal(owned.sum(0), torch.ones(len(positions), dtype=torch.int64))
    assert torch.equal(owned.int().argmax(0), dcp_token_owner(positions, dcp_size, interleave))
    local = torch.stack([dcp_local_seq_lens(lens, dcp_size, r, interleave) for r in range(dcp_size)])
    assert local.dtype == torch.int32
    # Local lengths sum to the sequence lengths.
    assert torch.equal(local.sum(0).to(torch.int64), lens.to(torch.int64))
    for rank, slots in enumerate(per_rank):
        mine = slots[slots >= 0]
        # Slots are unique on each rank ...
        assert mine.unique().numel() == mine.numel()
        for seq in range(len(seq_lens)):
            seq_slots = slots[(seq_idx == seq) & (slots >= 0)]
            # ... and dense: they are exactly the first local_len slots of the sequence's pages, in page order.
            count = int(local[rank, seq])
            assert seq_slots.numel() == count
            expected = (table[seq].to(torch.int64)[:, None] * block_size + torch.arange(block_size)).flatten()[:count]
            assert torch.equal(seq_slots.sort().values, expected.sort().values)
            # Positions in order map to slots in order: the shard is a prefix in sequence order.
            assert torch.equal(seq_slots, expected)


def test_layout_errors_name_the_value_and_fix() -> None:
    table = torch.zeros(1, 2, dtype=torch.int32)
    idx = torch.zeros(3, dtype=torch.int64)
    pos = torch.arange(3)
    with pytest.raises(ValueError, match="interleave=3 must divide block_size=16"):
        dcp_slot_mapping(table, idx, pos, 16, 2, 0, 3)
    with pytest.raises(ValueError, match=r"dcp_rank must be in \[0, dcp_size=2\), got 2"):
        dcp_slot_mapping(table, idx, pos, 16, 2, 2)
    with pytest.raises(ValueError, match="dcp_size must be a positive integer, got 0"):
        dcp_local_seq_lens(torch.tensor([3]), 0, 0)
    with pytest.raises(ValueError, match="needs logical block 2 but block_table has only 2 columns"):
        dcp_slot_mapping(table, idx, torch.tensor([0, 1, 64]), 16, 2, 0)
    with pytest.raises(TypeError, match="integer tensor"):
        dcp_local_seq_lens(torch.tensor([3.0]), 2, 0)

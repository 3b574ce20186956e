"""Simulated tokens behave as the list of ids the scheduler takes them for, and trace prefix ids name blocks so that
equal leading trace ids (and only those) give equal leading block names, at any block unit."""

from __future__ import annotations

import pytest

from dcpserve.engine.core.block_manager import BlockManager
from dcpserve.engine.core.request import Request
from dcpserve.engine.sampling_params import SamplingParams
from dcpserve.simulator.tokens import PromptTokens, SequenceTokens, trace_block_hashes


def test_sequence_tokens_act_like_the_list_they_stand_for() -> None:
    tokens = PromptTokens(5) + [7, 8]
    assert isinstance(tokens, SequenceTokens)
    reference = [0, 0, 0, 0, 0, 7, 8]
    assert len(tokens) == len(reference)
    assert list(tokens) == reference
    for start in range(-2, 9):
        for stop in range(-2, 9):
            assert tokens[start:stop] == reference[start:stop], (start, stop)
    assert [tokens[i] for i in range(-7, 7)] == [reference[i] for i in range(-7, 7)]
    tokens.append(9)
    assert tokens[-1] == 9 and len(tokens) == 8
    with pytest.raises(IndexError):
        tokens[8]


def test_a_request_on_simulated_tokens() -> None:
    """Request builds its sequence as prompt + outputs: the outputs it appends show up in the sequence."""
    request = Request("r", PromptTokens(100), SamplingParams(max_tokens=4))  # type: ignore[arg-type]  # the point
    request.append_output(3)
    assert request.num_tokens == 101 and request.num_prompt_tokens == 100
    assert request.all_token_ids[99:101] == [0, 3]


@pytest.mark.parametrize("tokens_per_block", [64, 512, 1024, 96])
def test_block_names_follow_the_trace_ids(tokens_per_block: int) -> None:
    shared = trace_block_hashes((1, 2, 3, 4), 2048, 512, tokens_per_block)
    other_tail = trace_block_hashes((1, 2, 3, 9), 2048, 512, tokens_per_block)
    other_head = trace_block_hashes((5, 2, 3, 4), 2048, 512, tokens_per_block)
    assert len(shared) == 2048 // tokens_per_block
    assert len(set(shared)) == len(shared)
    # Blocks entirely inside the first three trace blocks agree; from the first one touching the fourth, none does.
    same = (3 * 512) // tokens_per_block
    assert shared[:same] == other_tail[:same]
    assert all(a != b for a, b in zip(shared[same:], other_tail[same:], strict=True))
    assert all(a != b for a, b in zip(shared, other_head, strict=True))
    assert trace_block_hashes((1, 2, 3, 4), 2048, 512, tokens_per_block) == shared  # deterministic


def test_block_names_need_the_trace_ids_that_cover_the_prompt() -> None:
    with pytest.raises(ValueError, match="do not cover"):
        trace_block_hashes((1,), 1024, 512, 256)


def test_the_block_manager_hits_a_shared_prefix_named_by_trace_ids() -> None:
    """Two simulated requests with the same first trace blocks: the second takes the first one's cached blocks."""
    manager = BlockManager(num_blocks=64, block_size=16, dcp_size=2, enable_prefix_caching=True)
    first = Request("a", PromptTokens(1000), SamplingParams(max_tokens=4))  # type: ignore[arg-type]  # the point
    first.block_hashes = trace_block_hashes((1, 2), 1000, 512, 32)
    assert manager.admit(first, first.num_tokens)
    assert manager.allocate(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    manager.cache_computed(first)
    second = Request("b", PromptTokens(900), SamplingParams(max_tokens=4))  # type: ignore[arg-type]  # the point
    second.block_hashes = trace_block_hashes((1, 7), 900, 512, 32)
    assert len(manager.find_cached(second)) == 512 // 32

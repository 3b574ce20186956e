"""How a step's rows split across PCP ranks (dcpserve/engine/worker/pcp.py): every prefill token on exactly one rank,
each rank one early and one late part of each chunk, the last token of every chunk on rank 0 (which samples), decodes on
every rank, and the gathered layout putting each rank's rows where its peers expect them."""

from __future__ import annotations

import pytest
import torch

from dcpserve.engine.worker.attention_metadata import AttentionMetadata
from dcpserve.engine.worker.pcp import PcpSplit, chunk_parts, rank_segments


@pytest.mark.parametrize("pcp", [2, 3, 4])
@pytest.mark.parametrize("length", [1, 2, 3, 7, 8, 33, 4096])
def test_parts_cover_the_chunk_in_order_and_the_last_is_never_empty(pcp: int, length: int) -> None:
    parts = chunk_parts(length, pcp)
    assert len(parts) == 2 * pcp
    assert [start for start, _ in parts] == [sum(size for _, size in parts[:i]) for i in range(2 * pcp)]
    assert sum(size for _, size in parts) == length
    sizes = [size for _, size in parts]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes)
    assert parts[-1][1] >= 1


@pytest.mark.parametrize("pcp", [2, 4])
def test_every_token_is_on_exactly_one_rank_and_causal_work_balances(pcp: int) -> None:
    chunk_lens = [1, 5, 64, 1000]
    owner: dict[tuple[int, int], int] = {}
    work = []
    for q in range(pcp):
        cost = 0
        for segment in rank_segments(chunk_lens, pcp, q):
            for i in range(segment.start, segment.start + segment.length):
                assert (segment.chunk, i) not in owner
                owner[(segment.chunk, i)] = q
                cost += i + 1  # keys a causal query at chunk offset i reads from its own chunk
        work.append(cost)
    assert len(owner) == sum(chunk_lens)
    for chunk, length in enumerate(chunk_lens):
        assert owner[(chunk, length - 1)] == 0, "the chunk's last token (the one sampled) is PCP rank 0's"
    # The head-tail pairing: the 1000-token chunk's causal work is within 1% across ranks.
    assert max(work) / min(work) < 1.01


def test_rows_and_gathered_layout() -> None:
    # 2 decodes, then chunks of 5 and 2 tokens at pcp 2: parts of 5 are [1, 1, 1, 2], of 2 are [0, 0, 1, 1].
    splits = [PcpSplit.of(2, [5, 2], 2, q) for q in range(2)]
    assert splits[0].own_rows() == [0, 1, 2, 5, 6, 8]  # decodes; chunk 0 parts 0 and 3; chunk 1 part 3
    assert splits[1].own_rows() == [0, 1, 3, 4, 7]  # decodes; chunk 0 parts 1 and 2; chunk 1 part 2
    assert splits[0].rows_max == 4
    assert splits[1].gathered_rows() == [0, 1, 2, 5, 6, 8, 3, 4, 7, -1]


def test_rank_metadata_names_each_segment_with_its_whole_context() -> None:
    """A segment's context is the chunk's cached context plus the chunk's earlier parts; slots follow the rows."""
    table = torch.tensor([[10, 11, 12, 13]], dtype=torch.int32)
    slots = torch.arange(100, 108)  # the full step's slot of each of its 8 rows (one 8-token chunk, no decodes)
    full = AttentionMetadata(
        slot_mapping=slots, num_decode_tokens=0, decode_block_table=table[:0],
        decode_local_seq_lens=torch.zeros(0, dtype=torch.int32), prefill_block_table=table,
        prefill_query_start_loc=torch.tensor([0, 8], dtype=torch.int32),
        prefill_local_context_lens=torch.tensor([6], dtype=torch.int32), prefill_max_query_len=8)
    own, split = full.for_pcp_rank([8], [6], pcp_size=2, pcp_rank=1, dcp_size=1, dcp_rank=0)
    assert split.own_rows() == [2, 3, 4, 5]  # parts 1 and 2 of [0-1, 2-3, 4-5, 6-7]
    assert own.slot_mapping.tolist() == [102, 103, 104, 105]
    assert own.prefill_query_start_loc.tolist() == [0, 2, 4]
    assert own.prefill_local_context_lens.tolist() == [6 + 2, 6 + 4]
    assert own.prefill_block_table.tolist() == [[10, 11, 12, 13]] * 2
    assert own.pcp is not None and own.pcp.rows_max == 4
    # Gathered: rank 0's parts 0 and 3, then rank 1's parts 1 and 2.
    assert own.pcp.gathered_slot_mapping.tolist() == [100, 101, 106, 107, 102, 103, 104, 105]
    assert own.pcp.gathered_local_context_lens.tolist() == [6, 12, 8, 10]
    # dcp = 2: this rank's share of each context (positions alternate ranks).
    own, _ = full.for_pcp_rank([8], [6], pcp_size=2, pcp_rank=1, dcp_size=2, dcp_rank=1)
    assert own.prefill_local_context_lens.tolist() == [4, 5]

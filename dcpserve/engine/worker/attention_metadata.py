"""Per-step attention inputs of one rank, built once by the model runner and passed to every layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dcpserve.engine.worker.pcp import PcpMetadata, PcpSplit, split_metadata
from dcpserve.engine.worker.step_timer import ExchangeTimer


@dataclass
class AttentionMetadata:
    """Rows of the step's token batch: decode tokens first (one per decoding sequence), then prefill chunks.

    Every rank of a DCP group gets the same rows and block tables; slot_mapping and the local lengths are its own.
    With PCP (pcp > 1) the rows are this rank's: every decode, then its segments of the prefill chunks
    (dcpserve/engine/worker/pcp.py), each segment a prefill sequence whose context is every token before it; `pcp` says
    how the step's rows gather across PCP ranks (None in a decode-only step, where every PCP group has the same rows).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: this rank's cache slot for each new token, -1 if not owned
    num_decode_tokens: int  # rows [0, num_decode_tokens) are decodes
    decode_block_table: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_local_seq_lens: torch.Tensor  # [num_decodes] int32: tokens on this rank, including the new one
    prefill_block_table: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32, offsets into the prefill rows
    prefill_local_context_lens: torch.Tensor  # [num_prefills] int32: cached tokens on this rank before the chunk
    prefill_max_query_len: int
    exchange_timer: ExchangeTimer | None = None  # this step's DCP exchange time (None: not measured)
    # Every slot decode_block_table names past a sequence's local length holds finite values (the model runner zeroes
    # pages when they are allocated, and padding columns repeat the row's last page): the CPU decode kernel may then
    # mask those slots without zeroing them first (dcpserve/kernels/cpu_attention.py, plan_decode_cpu).
    finite_tail: bool = False
    # No slot_mapping entry is -1 (no DCP, and no padding row): the reference store skips looking for unowned slots.
    all_slots_owned: bool = False
    # Per-step work a kernel derives from the fields above alone (e.g. the CPU decode plan: checked pages and masks),
    # made by the first layer that needs it and reused by the others; keyed by the kernel's own key.
    kernel_plans: dict[Any, Any] = field(default_factory=dict)
    pcp: PcpMetadata | None = None

    def for_pcp_rank(self, chunk_lens: list[int], chunk_starts: list[int], pcp_size: int, pcp_rank: int,
                     dcp_size: int, dcp_rank: int, interleave: int = 1) -> tuple[AttentionMetadata, PcpSplit]:
        """This metadata, built for the whole step's rows (prefill chunks of chunk_lens tokens from chunk_starts),
        cut to PCP rank pcp_rank's rows (dcpserve/engine/worker/pcp.py), with the split. A decode-only step keeps its
        rows."""
        split = PcpSplit.of(self.num_decode_tokens, chunk_lens, pcp_size, pcp_rank)
        if not chunk_lens:
            return self, split
        slots, table, start_loc, context, longest, pcp = split_metadata(
            self.slot_mapping, self.prefill_block_table, chunk_starts, split, dcp_size, dcp_rank, interleave)
        own = AttentionMetadata(
            slot_mapping=slots, num_decode_tokens=self.num_decode_tokens, decode_block_table=self.decode_block_table,
            decode_local_seq_lens=self.decode_local_seq_lens, prefill_block_table=table,
            prefill_query_start_loc=start_loc, prefill_local_context_lens=context, prefill_max_query_len=longest,
            exchange_timer=self.exchange_timer, finite_tail=self.finite_tail, pcp=pcp)
        return own, split

    @property
    def num_prefills(self) -> int:
        return self.prefill_query_start_loc.numel() - 1

    @property
    def num_decodes(self) -> int:
        return self.num_decode_tokens


def no_prefill_tensors(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode-only step's prefill fields: (prefill_query_start_loc [0], prefill_local_context_lens []), int32.
    Kernels only read them, so the pair made once at start serves every such step."""
    return torch.zeros(1, dtype=torch.int32, device=device), torch.zeros(0, dtype=torch.int32, device=device)

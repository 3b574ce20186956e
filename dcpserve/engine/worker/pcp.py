"""Prefill context parallelism: how a step's prefill rows split across PCP groups, and the collectives that trade
them (docs/dcp.md, "Prefill context parallelism").

Every PCP group runs the step's decode rows (the same rows on every group). Each prefill chunk of L tokens is cut
into 2 * pcp parts of L // (2 * pcp) tokens, the L % (2 * pcp) extra tokens going one each to the last parts;
PCP rank q computes parts q and 2 * pcp - 1 - q (one early, one late slice: causal attention costs about the same
on every rank). A rank's rows are then the decodes followed, chunk by chunk, by its two parts ("segments"). The
last part of every chunk is PCP rank 0's, so the rows the step samples are all on PCP group 0, which alone runs
the LM head.

Collectives pad each PCP rank's prefill rows to the step's longest (rows_max, the same on every rank): the
"gathered" layout of a step is the decode rows, then PCP rank 0's prefill rows padded to rows_max, then rank 1's,
and so on. K/V of the whole step come together in that layout (each rank stores the slots it owns), and the DCP
exchange of a PCP step computes every rank's queries in it (dcpserve/kernels/exchange.py, PcpAttentionExchange).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dcpserve.kernels import dcp_local_seq_lens
from dcpserve.kernels.collectives import Collectives


@dataclass(frozen=True)
class Segment:
    """One part of a prefill chunk on one PCP rank: `length` tokens from `start` inside chunk `chunk`."""

    chunk: int
    start: int
    length: int


def chunk_parts(length: int, pcp_size: int) -> list[tuple[int, int]]:
    """(start, length) of the 2 * pcp parts of a chunk of `length` tokens: L // (2 * pcp) each, the remainder one
    token each to the last parts (so the last part is never empty)."""
    parts = 2 * pcp_size
    base, extra = divmod(length, parts)
    sizes = [base + (1 if i >= parts - extra else 0) for i in range(parts)]
    starts = [sum(sizes[:i]) for i in range(parts)]
    return list(zip(starts, sizes, strict=True))


def rank_segments(chunk_lens: list[int], pcp_size: int, pcp_rank: int) -> list[Segment]:
    """PCP rank pcp_rank's non-empty segments, in row order: per chunk, part pcp_rank then part 2 * pcp - 1 -
    pcp_rank."""
    segments = []
    for chunk, length in enumerate(chunk_lens):
        parts = chunk_parts(length, pcp_size)
        for part in (pcp_rank, 2 * pcp_size - 1 - pcp_rank):
            start, size = parts[part]
            if size:
                segments.append(Segment(chunk, start, size))
    return segments


@dataclass(frozen=True)
class PcpSplit:
    """A step's rows split across PCP ranks (the same on every rank), seen from rank `pcp_rank`."""

    pcp_size: int
    pcp_rank: int
    num_decodes: int
    chunk_lens: tuple[int, ...]
    segments: tuple[tuple[Segment, ...], ...]  # per PCP rank

    @classmethod
    def of(cls, num_decodes: int, chunk_lens: list[int], pcp_size: int, pcp_rank: int) -> PcpSplit:
        return cls(pcp_size, pcp_rank, num_decodes, tuple(chunk_lens),
                   tuple(tuple(rank_segments(chunk_lens, pcp_size, q)) for q in range(pcp_size)))

    def prefill_rows(self, q: int) -> int:
        return sum(s.length for s in self.segments[q])

    @property
    def rows_max(self) -> int:
        return max(self.prefill_rows(q) for q in range(self.pcp_size))

    def _full_rows(self, q: int) -> list[int]:
        """The full step's row of each of PCP rank q's prefill rows."""
        first = [self.num_decodes + sum(self.chunk_lens[:c]) for c in range(len(self.chunk_lens))]
        return [first[s.chunk] + s.start + i for s in self.segments[q] for i in range(s.length)]

    def own_rows(self) -> list[int]:
        """The full step's rows this rank computes: every decode, then its segments."""
        return list(range(self.num_decodes)) + self._full_rows(self.pcp_rank)

    def gathered_rows(self) -> list[int]:
        """The full step's row at each row of the gathered layout, -1 where it pads."""
        rows = list(range(self.num_decodes))
        for q in range(self.pcp_size):
            own = self._full_rows(q)
            rows += own + [-1] * (self.rows_max - len(own))
        return rows


@dataclass
class PcpMetadata:
    """What a PCP rank's attention needs beyond its own rows' AttentionMetadata."""

    rows_max: int  # prefill rows of every PCP rank, padded
    gathered_slot_mapping: torch.Tensor  # [D + pcp * rows_max] int64: this rank's slot per gathered row, -1 skip
    # The gathered layout's prefill rows as sequences (each rank's segments, then one padding sequence per rank
    # short of rows_max, with no context): their block table rows, row offsets and local context lengths (the
    # tokens before each segment that this rank holds). Read by the DCP exchange (dcp > 1) only.
    gathered_block_table: torch.Tensor  # [S, max_blocks] int32
    gathered_query_start_loc: torch.Tensor  # [S + 1] int32
    gathered_local_context_lens: torch.Tensor  # [S] int32
    gathered_max_query_len: int


def split_metadata(full_slot_mapping: torch.Tensor, prefill_block_table: torch.Tensor, chunk_starts: list[int],
                   split: PcpSplit, dcp_size: int, dcp_rank: int, interleave: int = 1
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, PcpMetadata]:
    """This PCP rank's prefill fields and PcpMetadata, from the full step's slot mapping (this rank's slots for
    every row), its prefill block table rows and each chunk's start position. Returns (own row slot mapping, own
    segments' block table, their query_start_loc, their local context lengths, their longest segment, PcpMetadata).
    A segment's context is everything before it: the chunk's cached context and the chunk's earlier tokens."""
    device = full_slot_mapping.device

    def sequences(segments: list[Segment], pad: int) -> tuple[list[int], list[int], list[int]]:
        chunks = [s.chunk for s in segments]
        lens = [s.length for s in segments]
        contexts = [chunk_starts[s.chunk] + s.start for s in segments]
        if pad:
            chunks, lens, contexts = chunks + [0], lens + [pad], contexts + [0]
        return chunks, lens, contexts

    def tensors(chunks: list[int], lens: list[int], contexts: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        table = prefill_block_table[torch.tensor(chunks, dtype=torch.int64, device=device)]
        start_loc = torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
        local = dcp_local_seq_lens(torch.tensor(contexts, dtype=torch.int64), dcp_size, dcp_rank, interleave)
        return table, start_loc, local.to(device)

    own = list(split.segments[split.pcp_rank])
    own_table, own_start_loc, own_context = tensors(*sequences(own, 0))
    all_chunks: list[int] = []
    all_lens: list[int] = []
    all_contexts: list[int] = []
    for q in range(split.pcp_size):
        chunks, lens, contexts = sequences(list(split.segments[q]), split.rows_max - split.prefill_rows(q))
        all_chunks += chunks
        all_lens += lens
        all_contexts += contexts
    gathered_table, gathered_start_loc, gathered_context = tensors(all_chunks, all_lens, all_contexts)
    rows = torch.tensor(split.gathered_rows(), dtype=torch.int64, device=device)
    gathered_slots = torch.where(rows >= 0, full_slot_mapping[rows.clamp(min=0)], -1)
    own_slots = full_slot_mapping[torch.tensor(split.own_rows(), dtype=torch.int64, device=device)]
    metadata = PcpMetadata(split.rows_max, gathered_slots, gathered_table, gathered_start_loc, gathered_context,
                           max(all_lens, default=0))
    return own_slots, own_table, own_start_loc, own_context, max((s.length for s in own), default=0), metadata


def gather_prefill_rows(x: torch.Tensor, num_decodes: int, rows_max: int, pcp: Collectives | None,
                        pcp_size: int) -> torch.Tensor:
    """x [D + own prefill rows, ...] on every PCP peer -> [D + pcp * rows_max, ...] in the gathered layout (the
    decode rows are this rank's: every peer has the same), padding rows zero."""
    if pcp_size == 1 or pcp is None:
        return x
    padded = x.new_zeros((rows_max, *x.shape[1:]))
    padded[: x.shape[0] - num_decodes] = x[num_decodes:]
    gathered = pcp.all_gather(padded)
    return torch.cat([x[:num_decodes], gathered.reshape(pcp_size * rows_max, *x.shape[1:])])


def unsplit_rows(x: torch.Tensor, split: PcpSplit, pcp: Collectives | None) -> torch.Tensor:
    """x [own rows, ...] on every PCP peer -> [the full step's rows, ...] on every peer (prompt logprobs read the
    hidden states of every prompt row)."""
    gathered = gather_prefill_rows(x, split.num_decodes, split.rows_max, pcp, split.pcp_size)
    rows = torch.tensor(split.gathered_rows(), dtype=torch.int64, device=x.device)
    keep = (rows >= 0).nonzero()[:, 0]
    full = x.new_empty((split.num_decodes + sum(split.chunk_lens), *x.shape[1:]))
    full[rows[keep]] = gathered[keep]
    return full

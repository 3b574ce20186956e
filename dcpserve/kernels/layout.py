"""Where each token of a sequence lives when its KV cache is sharded over a DCP group.

The rules (docs/dcp.md): token at position p belongs to DCP rank (p // I) % N. A logical block of
B*N tokens is one physical page of B slots on every rank of the group, and the block table is the same
on every rank. Each rank's tokens form a dense prefix of its pages, so a paged kernel reads them with
the shared block table and a per-rank local length.

Pure torch: these are index computations, cheap and exact on any device.
"""

from __future__ import annotations

import torch


def check_dcp_args(dcp_size: int, dcp_rank: int, interleave: int, block_size: int | None = None) -> None:
    """Raises ValueError naming the bad value when a DCP layout argument is out of range."""
    if not isinstance(dcp_size, int) or dcp_size < 1:
        raise ValueError(f"dcp_size must be a positive integer, got {dcp_size!r}")
    if not isinstance(dcp_rank, int) or not 0 <= dcp_rank < dcp_size:
        raise ValueError(f"dcp_rank must be in [0, dcp_size={dcp_size}), got {dcp_rank!r}")
    if not isinstance(interleave, int) or interleave < 1:
        raise ValueError(f"interleave must be a positive integer, got {interleave!r}")
    if block_size is not None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if block_size % interleave != 0:
            raise ValueError(
                f"interleave={interleave} must divide block_size={block_size}: otherwise one rank would own "
                f"more than block_size tokens of a logical block. Use an interleave among the divisors of "
                f"{block_size} (1 is always valid)."
            )


def dcp_local_seq_lens(
    seq_lens: torch.Tensor, dcp_size: int, dcp_rank: int, interleave: int = 1
) -> torch.Tensor:
    """Tokens of each sequence held by `dcp_rank`, as int32 on seq_lens' device.

    base = (L // I // N) * I;  rem = L - base * N;  local = base + clamp(rem - rank * I, 0, I)
    """
    check_dcp_args(dcp_size, dcp_rank, interleave)
    if seq_lens.dtype.is_floating_point or seq_lens.dtype == torch.bool:
        raise TypeError(f"seq_lens must be an integer tensor, got {seq_lens.dtype}")
    if dcp_size == 1:  # one rank holds every token
        return seq_lens.to(torch.int32)
    lens = seq_lens.to(torch.int64)
    base = (lens // interleave // dcp_size) * interleave
    rem = lens - base * dcp_size
    local = base + (rem - dcp_rank * interleave).clamp(min=0, max=interleave)
    return local.to(torch.int32)


def dcp_slot_mapping(
    block_table: torch.Tensor,
    seq_idx: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    dcp_size: int,
    dcp_rank: int,
    interleave: int = 1,
    validate: bool = True,
) -> torch.Tensor:
    """Slot on `dcp_rank` of each new token, or -1 where another rank of the group owns it.

    block_table: [num_seqs, max_blocks] int32, one row of logical (= physical page) ids per sequence.
    seq_idx:     [num_tokens] row of block_table that each token belongs to.
    positions:   [num_tokens] position of each token in its sequence.
    Returns [num_tokens] int64 slots, page * block_size + offset inside the page.
    validate=False skips the value checks (positions >= 0, blocks inside the table), which read device values
    back to the host: the engine's per-step inputs on CUDA, built from a table the scheduler keeps consistent.
    """
    check_dcp_args(dcp_size, dcp_rank, interleave, block_size)
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [num_seqs, max_blocks], got shape {tuple(block_table.shape)}")
    if seq_idx.shape != positions.shape or seq_idx.dim() != 1:
        raise ValueError(
            f"seq_idx and positions must be 1-D of the same length, got {tuple(seq_idx.shape)} "
            f"and {tuple(positions.shape)}"
        )
    positions = positions.to(torch.int64)
    seq_idx = seq_idx.to(torch.int64)
    if validate and positions.numel() and int(positions.min()) < 0:
        raise ValueError(f"positions must be >= 0, got {int(positions.min())}")
    logical_block_tokens = block_size * dcp_size
    blk = positions // logical_block_tokens
    if validate and positions.numel() and int(blk.max()) >= block_table.shape[1]:
        raise ValueError(
            f"position {int(positions.max())} needs logical block {int(blk.max())} but block_table has only "
            f"{block_table.shape[1]} columns ({logical_block_tokens} tokens each): allocate blocks first"
        )
    off = positions - blk * logical_block_tokens
    if dcp_size == 1:  # every token is this rank's, at its offset in the block's page
        return block_table[seq_idx, blk].to(torch.int64) * block_size + off  # index, then widen: not the table
    owner = (off // interleave) % dcp_size
    local = (off // (dcp_size * interleave)) * interleave + off % interleave
    pages = block_table[seq_idx, blk].to(torch.int64)
    slots = pages * block_size + local
    return torch.where(owner == dcp_rank, slots, torch.full_like(slots, -1))


def dcp_token_owner(positions: torch.Tensor, dcp_size: int, interleave: int = 1) -> torch.Tensor:
    """DCP rank that owns each position: (p // I) % N."""
    check_dcp_args(dcp_size, 0, interleave)
    return (positions.to(torch.int64) // interleave) % dcp_size

"""The `dcpserve` command line.

    dcpserve layout --tokens 9 --dcp 2 [--block-size 2] [--interleave 1]
        which DCP rank holds each token of a sequence, at which page and slot (docs/dcp.md)
"""

from __future__ import annotations

import argparse
import sys

import torch

from kernels import dcp_local_seq_lens, dcp_slot_mapping, dcp_token_owner
from kernels.layout import check_dcp_args


def layout_table(num_tokens: int, dcp_size: int, block_size: int, interleave: int) -> str:
    """A text table of the DCP layout of one sequence whose logical block i is page i on every rank."""
    check_dcp_args(dcp_size, 0, interleave, block_size)
    tokens_per_block = block_size * dcp_size
    num_blocks = max(1, -(-num_tokens // tokens_per_block))
    table = torch.arange(num_blocks, dtype=torch.int32)[None, :]
    positions = torch.arange(num_tokens)
    seq_idx = torch.zeros(num_tokens, dtype=torch.int64)
    owners = dcp_token_owner(positions, dcp_size, interleave)
    slots = torch.stack(
        [dcp_slot_mapping(table, seq_idx, positions, block_size, dcp_size, r, interleave) for r in range(dcp_size)]
    )
    lines = [
        f"{num_tokens} tokens, dcp={dcp_size}, block_size={block_size}, interleave={interleave}: "
        f"logical blocks of {tokens_per_block} tokens; logical block i = page i on every rank",
        "",
        "position  rank  page  offset  slot",
    ]
    for p in range(num_tokens):
        rank = int(owners[p])
        slot = int(slots[rank, p])
        lines.append(f"{p:>8}  {rank:>4}  {slot // block_size:>4}  {slot % block_size:>6}  {slot:>4}")
    lines.append("")
    lens = torch.tensor([num_tokens])
    for r in range(dcp_size):
        local = int(dcp_local_seq_lens(lens, dcp_size, r, interleave)[0])
        held = [p for p in range(num_tokens) if int(owners[p]) == r]
        lines.append(f"rank {r}: local_seq_len {local}, positions {held}")
    return "\n".join(lines)


def _cmd_layout(args: argparse.Namespace) -> int:
    if args.tokens < 0:
        raise SystemExit(f"--tokens must be >= 0, got {args.tokens}")
    try:
        print(layout_table(args.tokens, args.dcp, args.block_size, args.interleave))
    except ValueError as err:
        raise SystemExit(f"dcpserve layout: {err}") from err
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dcpserve", description="Long-context LLM serving with decode context parallelism.")
    commands = parser.add_subparsers(dest="command", required=True)
    layout = commands.add_parser("layout", help="show which DCP rank holds each token of a sequence")
    layout.add_argument("--tokens", type=int, required=True, help="sequence length")
    layout.add_argument("--dcp", type=int, required=True, help="decode context parallel size N")
    layout.add_argument("--block-size", type=int, default=16, help="tokens per physical page on a rank (default 16)")
    layout.add_argument("--interleave", type=int, default=1, help="consecutive tokens per rank turn (default 1)")
    layout.set_defaults(func=_cmd_layout)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

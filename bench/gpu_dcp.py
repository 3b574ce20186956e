"""GPU check stage: the attention kernels against the torch reference at long context, with DCP emulated in one
process.

Each case's context is split over `dcp` shards by the engine's own layout (dcpserve/kernels/layout.py: token p on
rank (p // interleave) % dcp); each shard gets a paged cache of its own tokens (pages handed out in a random
permutation), its partial attention runs there, and the partials merge with combine_lse in fp32, as the exchange
merges them (dcpserve/kernels/exchange.py packs the partials in fp32). The merged out and lse are compared with the
unsharded torch reference over the whole context. Decode: one query per sequence over `context` tokens. Prefill: a
chunk of new tokens after `context` cached ones; each shard attends its part of the cache (key/value None, as every
rank of a DCP group does), the chunk's own causal part runs once, and the dcp + 1 partials merge.

`impl="triton"` runs the Triton kernels (CUDA, or the CPU interpreter in tests: fp32 there, the interpreter's bf16
is broken); `impl="torch"` the references for the shards too, so only the sharding and the merge are checked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from bench.kernels import LSE_ATOL, OUT_RTOL
from dcpserve.kernels.combine import combine_lse, combine_lse_ref
from dcpserve.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref
from dcpserve.kernels.layout import dcp_token_owner
from dcpserve.kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref

Impl = Literal["triton", "torch"]
Partial = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Heads:
    """The attention widths of one rank: query heads, KV heads, head_dim."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int


LLAMA3_8B = Heads(32, 8, 128)  # Llama-3-8B's attention at tp = 1


@dataclass(frozen=True)
class DcpCase:
    """One check: `kind` attention over `context` cached tokens sharded over `dcp` ranks (interleave tokens each)."""

    kind: Literal["decode", "prefill"]
    context: int
    dcp: int
    batch: int = 1
    new_tokens: int = 1  # prefill: the chunk's length (decode: one query per sequence)
    interleave: int = 1

    @property
    def label(self) -> str:
        chunk = f" + {self.new_tokens} new" if self.kind == "prefill" else ""
        return f"{self.kind} {self.context}{chunk} x{self.batch}, dcp={self.dcp}"


@dataclass(frozen=True)
class DcpResult:
    """A case's error against the unsharded reference: max |out err| / max |ref out|, max |lse err|."""

    case: DcpCase
    out_rel_err: float
    lse_err: float
    passed: bool


GPU_CASES = (
    *(DcpCase("decode", context, dcp, batch=4) for context in (32768, 131072) for dcp in (1, 2, 4, 8)),
    *(DcpCase("prefill", context, dcp, new_tokens=256) for context in (32768, 131072) for dcp in (1, 4)),
)


def paged(keys: torch.Tensor, values: torch.Tensor, block_size: int,
          generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """keys / values [batch, tokens, kv_heads, head_dim] -> (k_cache, v_cache [pages, block_size, kv_heads,
    head_dim], block table [batch, pages per sequence] int32): each sequence's tokens in pages handed out in a random
    permutation, slots past a sequence's end NaN (a kernel that reads one poisons its result)."""
    batch, tokens = keys.shape[:2]
    per_seq = max(1, -(-tokens // block_size))
    order = torch.randperm(batch * per_seq, generator=generator).to(keys.device)

    def cache(dense: torch.Tensor) -> torch.Tensor:
        padded = dense.new_full((batch, per_seq * block_size, *dense.shape[2:]), float("nan"))
        padded[:, :tokens] = dense
        pages = torch.empty((batch * per_seq, block_size, *dense.shape[2:]), dtype=dense.dtype, device=dense.device)
        pages[order] = padded.view(batch * per_seq, block_size, *dense.shape[2:])
        return pages

    return cache(keys), cache(values), order.view(batch, per_seq).to(torch.int32)


def shard_tokens(context: int, dcp: int, rank: int, interleave: int, device: torch.device) -> torch.Tensor:
    """Positions (ascending) of the context's tokens that DCP rank `rank` holds."""
    positions = torch.arange(context, device=device)
    return positions[dcp_token_owner(positions, dcp, interleave) == rank]


def merge(partials: list[Partial], impl: Impl) -> Partial:
    """The exchange's merge: the shards' partials packed in fp32 and combined by combine_lse (or its reference)."""
    outs = torch.stack([out.float() for out, _ in partials])
    lses = torch.stack([lse.float() for _, lse in partials])
    return (combine_lse if impl == "triton" else combine_lse_ref)(outs, lses)


def _decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_size: int, impl: Impl,
            generator: torch.Generator) -> Partial:
    """q [batch, H, D], one query per sequence, attending all of keys / values [batch, tokens, kv, D]."""
    k_cache, v_cache, table = paged(keys, values, block_size, generator)
    lens = torch.full((q.shape[0],), keys.shape[1], dtype=torch.int32, device=q.device)
    attention = paged_decode_attention if impl == "triton" else paged_decode_attention_ref
    return attention(q, k_cache, v_cache, table, lens, q.shape[-1] ** -0.5)


def _prefill(q: torch.Tensor, new_k: torch.Tensor | None, new_v: torch.Tensor | None, keys: torch.Tensor,
             values: torch.Tensor, block_size: int, impl: Impl, generator: torch.Generator) -> Partial:
    """q [batch * chunk, H, D] attending the cached keys / values [batch, tokens, kv, D] and, given, the chunk's own
    new_k / new_v [batch * chunk, kv, D] causally."""
    batch, chunk = keys.shape[0], q.shape[0] // keys.shape[0]
    k_cache, v_cache, table = paged(keys, values, block_size, generator)
    starts = torch.arange(0, batch * chunk + 1, chunk, dtype=torch.int32, device=q.device)
    lens = torch.full((batch,), keys.shape[1], dtype=torch.int32, device=q.device)
    attention = paged_prefill_attention if impl == "triton" else paged_prefill_attention_ref
    return attention(q, new_k, new_v, k_cache, v_cache, table, starts, lens, q.shape[-1] ** -0.5, chunk)


def check_case(case: DcpCase, heads: Heads, dtype: torch.dtype, device: torch.device, impl: Impl,
               block_size: int = 16, seed: int = 0,
               drop: Callable[[torch.Tensor], torch.Tensor] | None = None) -> DcpResult:
    """Runs one case sharded and unsharded and compares them; `drop` (tests) may edit each shard's token positions
    before its cache is built, to show a wrong shard is caught."""
    generator = torch.Generator().manual_seed(seed)  # the page permutations
    data = torch.Generator(device=device).manual_seed(seed)  # the tensors, made where they are used

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=data, device=device, dtype=dtype)

    keys = randn(case.batch, case.context, heads.num_kv_heads, heads.head_dim)
    values = randn(case.batch, case.context, heads.num_kv_heads, heads.head_dim)
    rows = case.batch * (case.new_tokens if case.kind == "prefill" else 1)
    q = randn(rows, heads.num_q_heads, heads.head_dim)
    new_k, new_v = randn(rows, heads.num_kv_heads, heads.head_dim), randn(rows, heads.num_kv_heads, heads.head_dim)
    partials: list[Partial] = []
    for rank in range(case.dcp):
        mine = shard_tokens(case.context, case.dcp, rank, case.interleave, device)
        mine = drop(mine) if drop is not None else mine
        if case.kind == "decode":
            partials.append(_decode(q, keys[:, mine], values[:, mine], block_size, impl, generator))
        else:
            partials.append(_prefill(q, None, None, keys[:, mine], values[:, mine], block_size, impl, generator))
    if case.kind == "decode":
        reference = _decode(q, keys, values, block_size, "torch", generator)
    else:  # the chunk's own part, once (every rank holds the new K/V), then the merge of dcp + 1 partials
        empty = keys[:, :0]
        partials.append(_prefill(q, new_k, new_v, empty, empty, block_size, impl, generator))
        reference = _prefill(q, new_k, new_v, keys, values, block_size, "torch", generator)
    out, lse = merge(partials, impl)
    ref_out, ref_lse = reference
    out_err = (out.to(dtype).float() - ref_out.float()).abs().max().item()
    out_rel = out_err / max(ref_out.float().abs().max().item(), 1e-6)
    lse_err = (lse.float() - ref_lse.float()).abs().max().item()
    passed = out_rel <= OUT_RTOL[dtype] and lse_err <= LSE_ATOL
    return DcpResult(case, out_rel, lse_err, passed)


def markdown_rows(results: list[DcpResult], dtype: torch.dtype) -> list[str]:
    """The results as a markdown table."""
    lines = [f"| case | out err / max out (<= {OUT_RTOL[dtype]:g}) | lse err (<= {LSE_ATOL:g}) | |",
             "|---|---:|---:|---|"]
    lines += [f"| {r.case.label} | {r.out_rel_err:.1e} | {r.lse_err:.1e} | {'ok' if r.passed else 'WRONG'} |"
              for r in results]
    return lines

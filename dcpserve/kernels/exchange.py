"""The cross-rank step of DCP attention over a DCP group's collectives (docs/dcp.md, steps 1-4).

Each rank of a DCP group holds num_heads_per_rank query heads and one shard of the group's KV head:

    q_group = exchange.gather_queries(q_own)           # [T, h, D] -> [T, N*h, D], ordered by group rank
    out, lse = attention over the local shard (q_group)  # partial: [T, N*h, D], [T, N*h]
    out_own, lse_own = exchange.combine(out, lse)      # exact merge over the group, own heads: [T, h, D], [T, h]

combine sends (out, lse) packed in fp32 with one all_to_all (rank j receives every rank's partial for its own
heads) and merges locally with combine_lse, so the sum is always fp32 (never a bf16 reduce inside a collective).
Where a backend lacks all_to_all, method="all_gather" gathers every partial and merges the own slice: same
result, N times the bytes. The collectives are any transport of dcpserve/kernels/collectives.py (shared memory, gloo,
NCCL).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from dcpserve.kernels._triton import HAS_TRITON, triton_interpreting
from dcpserve.kernels.collectives import Collectives
from dcpserve.kernels.combine import combine_lse, combine_lse_ref

ExchangeMethod = Literal["all_to_all", "all_gather"]


CombineFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # combine_lse's signature (outs, lses) -> (out, lse)


def combine_fn_for(use_triton: bool | None, t: torch.Tensor) -> CombineFn:
    """combine_lse (Triton) or combine_lse_ref; None: Triton where it runs for t (CUDA, or the interpreter)."""
    if use_triton is None:
        use_triton = HAS_TRITON and (t.is_cuda or triton_interpreting())
    return combine_lse if use_triton else combine_lse_ref


class DcpAttentionExchange:
    """Gathers a DCP group's query heads and merges its ranks' partial attentions exactly."""

    def __init__(
        self,
        collectives: Collectives,
        method: ExchangeMethod = "all_to_all",
        use_triton: bool | None = None,
        combine: CombineFn | None = None,
    ) -> None:
        if method not in ("all_to_all", "all_gather"):
            raise ValueError(f"method must be 'all_to_all' or 'all_gather', got {method!r}")
        self.collectives = collectives
        self.method: ExchangeMethod = method
        self.world_size = collectives.size
        self.rank = collectives.rank
        self.use_triton = use_triton
        self.combine_fn = combine  # None: combine_fn_for(use_triton)

    def _combine_fn(self, t: torch.Tensor) -> CombineFn:
        return self.combine_fn if self.combine_fn is not None else combine_fn_for(self.use_triton, t)

    def gather_queries(self, q: torch.Tensor) -> torch.Tensor:
        """q [num_tokens, heads_per_rank, head_dim] -> [num_tokens, dcp_size * heads_per_rank, head_dim]."""
        if q.dim() != 3:
            raise ValueError(f"q must be [num_tokens, heads_per_rank, head_dim], got shape {tuple(q.shape)}")
        if self.world_size == 1:
            return q
        num_tokens, heads, head_dim = q.shape
        # q is often a strided view of the fused QKV output: copied once here, as NCCL needs a contiguous buffer
        gathered = self.collectives.all_gather(q.contiguous())
        return gathered.permute(1, 0, 2, 3).reshape(num_tokens, self.world_size * heads, head_dim)

    def combine(self, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Partial (out [T, N*h, D], lse [T, N*h]) over this rank's shard -> exact (out [T, h, D], lse [T, h])
        over the whole group, for this rank's own heads. out keeps its dtype; lse is fp32."""
        if out.dim() != 3 or lse.shape != out.shape[:2]:
            raise ValueError(
                f"out must be [T, N*h, D] and lse [T, N*h], got {tuple(out.shape)} and {tuple(lse.shape)}"
            )
        num_tokens, group_heads, head_dim = out.shape
        n = self.world_size
        if group_heads % n != 0:
            raise ValueError(f"{group_heads} query heads do not split evenly over the DCP group of {n} ranks")
        heads = group_heads // n
        combine_fn = self._combine_fn(out)
        if n == 1:
            merged, merged_lse = combine_fn(out[None], lse[None])
            return merged, merged_lse
        packed = torch.cat([out.float(), lse.float()[..., None]], dim=-1)  # [T, N*h, D+1]
        by_owner = packed.reshape(num_tokens, n, heads, head_dim + 1).permute(1, 0, 2, 3).contiguous()
        if self.method == "all_to_all":
            received = self.collectives.all_to_all(by_owner)  # received[j] = rank j's partial for this rank's heads
        else:
            received = self.collectives.all_gather(by_owner)[:, self.rank]
        merged, merged_lse = combine_fn(received[..., :head_dim], received[..., head_dim])
        return merged.to(out.dtype), merged_lse


class PcpAttentionExchange:
    """The DCP exchange of a replica with prefill context parallelism (docs/dcp.md).

    The DCP group is pcp_size PCP groups' runs of `a` consecutive TP ranks (group rank q * a + u: PCP rank q, u-th
    TP rank of the run). Ranks of one run hold different query heads of one KV head; ranks of different PCP groups
    hold the same heads but computed different prefill rows. Rows come in the gathered layout
    (dcpserve/engine/worker/pcp.py): D decode rows (the same on every PCP rank), then each PCP rank's rows_max prefill
    rows.

        q_group = gather_queries(q_own, D, R)   # [D + R_own, h] -> [D + pcp * R, a * h]: all rows, the run's heads
        partial attention over the local shard   # [D + pcp * R, a * h]
        out, lse = combine(out, lse, D, R)      # exact over the group: [D + R, h], this rank's rows and heads

    combine sends each rank only its rows and heads (one all_to_all of fp32 partials) and merges with combine_lse.
    """

    def __init__(self, collectives: Collectives, heads_ranks: int, pcp_size: int, pcp_rank: int,
                 use_triton: bool | None = None, combine: CombineFn | None = None) -> None:
        self.collectives = collectives
        self.world_size = collectives.size
        if self.world_size != heads_ranks * pcp_size:
            raise ValueError(f"the DCP group has {self.world_size} ranks, not heads_ranks={heads_ranks} x "
                             f"pcp_size={pcp_size}")
        self.a, self.b, self.pcp_rank = heads_ranks, pcp_size, pcp_rank
        self.use_triton = use_triton
        self.combine_fn = combine  # None: combine_fn_for(use_triton)

    def gather_queries(self, q: torch.Tensor, num_decodes: int, rows_max: int) -> torch.Tensor:
        """q [D + own prefill rows, h, Dq] -> [D + pcp * rows_max, a * h, Dq] (padding rows zero)."""
        rows, heads, head_dim = q.shape
        width = num_decodes + rows_max
        padded = q.new_zeros((width, heads, head_dim))
        padded[:rows] = q
        gathered = self.collectives.all_gather(padded)
        by_rank = gathered.view(self.b, self.a, width, heads, head_dim)
        decodes = by_rank[self.pcp_rank, :, :num_decodes].permute(1, 0, 2, 3)
        prefills = by_rank[:, :, num_decodes:].permute(0, 2, 1, 3, 4)
        return torch.cat([decodes.reshape(num_decodes, self.a * heads, head_dim),
                          prefills.reshape(self.b * rows_max, self.a * heads, head_dim)])

    def combine(self, out: torch.Tensor, lse: torch.Tensor, num_decodes: int,
                rows_max: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Partial (out [D + pcp * R, a * h, Dv], lse) over this rank's shard -> exact (out [D + R, h, Dv], lse
        [D + R, h]) over the group, for this rank's rows and heads. out keeps its dtype; lse is fp32."""
        group_heads, value_dim = out.shape[1], out.shape[2]
        heads = group_heads // self.a
        width = num_decodes + rows_max
        packed = torch.cat([out.float(), lse.float()[..., None]], dim=-1).view(-1, self.a, heads, value_dim + 1)
        decodes = packed[:num_decodes].permute(1, 0, 2, 3)[None].expand(self.b, -1, -1, -1, -1)
        prefills = packed[num_decodes:].view(self.b, rows_max, self.a, heads, value_dim + 1).permute(0, 2, 1, 3, 4)
        send = torch.cat([decodes, prefills], dim=2).reshape(self.world_size, width, heads, value_dim + 1)
        received = self.collectives.all_to_all(send)  # received[j]: rank j's partial for this rank's rows and heads
        combine_fn = self.combine_fn if self.combine_fn is not None else combine_fn_for(self.use_triton, out)
        merged, merged_lse = combine_fn(received[..., :value_dim], received[..., value_dim])
        return merged.to(out.dtype), merged_lse

"""The cross-rank step of DCP attention on a torch.distributed process group (docs/dcp.md, steps 1-4).

Each rank of a DCP group holds num_heads_per_rank query heads and one shard of the group's KV head:

    q_group = exchange.gather_queries(q_own)           # [T, h, D] -> [T, N*h, D], ordered by group rank
    out, lse = attention over the local shard (q_group)  # partial: [T, N*h, D], [T, N*h]
    out_own, lse_own = exchange.combine(out, lse)      # exact merge over the group, own heads: [T, h, D], [T, h]

combine sends (out, lse) packed in fp32 with one all_to_all (rank j receives every rank's partial for its own
heads) and merges locally with combine_lse, so the sum is always fp32 (never a bf16 reduce inside a collective).
Where a backend lacks all_to_all, method="all_gather" gathers every partial and merges the own slice: same
result, N times the bytes. Works on gloo (CPU) and NCCL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist

from engine.kernels._triton import HAS_TRITON, triton_interpreting
from engine.kernels.combine import combine_lse, combine_lse_ref

ExchangeMethod = Literal["all_to_all", "all_gather"]


class DcpAttentionExchange:
    """Gathers a DCP group's query heads and merges its ranks' partial attentions exactly."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        method: ExchangeMethod = "all_to_all",
        use_triton: bool | None = None,
    ) -> None:
        if method not in ("all_to_all", "all_gather"):
            raise ValueError(f"method must be 'all_to_all' or 'all_gather', got {method!r}")
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized: call init_process_group before building the exchange")
        self.group = group
        self.method: ExchangeMethod = method
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.use_triton = use_triton

    def _combine_fn(self, t: torch.Tensor) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        use_triton = self.use_triton
        if use_triton is None:
            use_triton = HAS_TRITON and (t.is_cuda or triton_interpreting())
        return combine_lse if use_triton else combine_lse_ref

    def gather_queries(self, q: torch.Tensor) -> torch.Tensor:
        """q [num_tokens, heads_per_rank, head_dim] -> [num_tokens, dcp_size * heads_per_rank, head_dim]."""
        if q.dim() != 3:
            raise ValueError(f"q must be [num_tokens, heads_per_rank, head_dim], got shape {tuple(q.shape)}")
        if self.world_size == 1:
            return q
        num_tokens, heads, head_dim = q.shape
        gathered = torch.empty((self.world_size, num_tokens, heads, head_dim), dtype=q.dtype, device=q.device)
        dist.all_gather(list(gathered.unbind(0)), q.contiguous(), group=self.group)
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
            received = torch.empty_like(by_owner)  # received[j] = rank j's partial for this rank's heads
            dist.all_to_all_single(received, by_owner, group=self.group)
        else:
            everything = torch.empty((n, *by_owner.shape), dtype=by_owner.dtype, device=by_owner.device)
            dist.all_gather(list(everything.unbind(0)), by_owner, group=self.group)
            received = everything[:, self.rank]
        merged, merged_lse = combine_fn(received[..., :head_dim], received[..., head_dim])
        return merged.to(out.dtype), merged_lse

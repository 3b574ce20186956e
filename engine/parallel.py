"""This rank's place in its replica: TP rank, DCP rank, process groups, and the collectives layers use.

tp = 1 needs no torch.distributed at all (ParallelState.single()). With tp > 1 every rank of the worker group
calls init_parallel_state(); the TP group is the whole world of the worker group and DCP groups are runs of
dcp consecutive TP ranks (docs/dcp.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class ParallelState:
    """TP and DCP coordinates of one rank, with its process groups (None when the size is 1)."""

    tp_size: int
    tp_rank: int
    dcp_size: int
    dcp_rank: int
    num_kv_heads: int  # the model's KV heads (for which ones this rank holds)
    tp_group: dist.ProcessGroup | None = None
    dcp_group: dist.ProcessGroup | None = None

    @classmethod
    def single(cls, num_kv_heads: int) -> ParallelState:
        return cls(tp_size=1, tp_rank=0, dcp_size=1, dcp_rank=0, num_kv_heads=num_kv_heads)

    @property
    def is_driver(self) -> bool:
        """Rank 0 samples and returns tokens."""
        return self.tp_rank == 0

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def first_kv_head(self) -> int:
        """Index of the first KV head this rank holds. With tp > kv_heads a head is replicated on tp / kv_heads
        consecutive ranks (and sharded along the sequence among the DCP ranks of those)."""
        if self.tp_size <= self.num_kv_heads:
            return self.tp_rank * self.kv_heads_per_rank
        return self.tp_rank // (self.tp_size // self.num_kv_heads)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the TP group (row-parallel outputs); identity at tp = 1."""
        if self.tp_size == 1:
            return x
        dist.all_reduce(x, group=self.tp_group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """All-gather shards along the last dimension in TP-rank order (vocab-parallel logits)."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def gather_last_dim_to_driver(self, x: torch.Tensor) -> torch.Tensor | None:
        """Gathers shards along the last dimension in TP-rank order onto the driver (TP rank 0) only; None on the
        other ranks. Sampling needs the full vocabulary on the driver alone, so the others receive nothing."""
        if self.tp_size == 1:
            return x
        x = x.contiguous()
        driver = dist.get_global_rank(self.tp_group, 0)
        parts = [torch.empty_like(x) for _ in range(self.tp_size)] if self.is_driver else None
        dist.gather(x, parts, dst=driver, group=self.tp_group)
        return torch.cat(parts, dim=-1) if parts is not None else None


def init_parallel_state(
    tp_size: int,
    tp_rank: int,
    dcp_size: int,
    num_kv_heads: int,
    init_method: str,
    backend: str,
    timeout_s: float = 300.0,
) -> ParallelState:
    """Joins this worker group's process group (one per group: its own init_method address and port) and builds
    the DCP subgroups. Every rank must call it with the same arguments except tp_rank."""
    if tp_size == 1:
        return ParallelState.single(num_kv_heads)
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        world_size=tp_size,
        rank=tp_rank,
        timeout=timedelta(seconds=timeout_s),
    )
    dcp_group = None
    if dcp_size > 1:
        # new_group is collective: every rank creates every DCP group, keeps its own.
        for start in range(0, tp_size, dcp_size):
            group = dist.new_group(list(range(start, start + dcp_size)))
            if start <= tp_rank < start + dcp_size:
                dcp_group = group
    return ParallelState(
        tp_size=tp_size,
        tp_rank=tp_rank,
        dcp_size=dcp_size,
        dcp_rank=tp_rank % dcp_size,
        num_kv_heads=num_kv_heads,
        tp_group=dist.group.WORLD,
        dcp_group=dcp_group,
    )


def destroy_parallel_state(state: ParallelState) -> None:
    if state.tp_size > 1 and dist.is_initialized():
        dist.destroy_process_group()

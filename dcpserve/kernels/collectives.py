"""The collectives a replica's ranks issue to each other, behind one interface the model code and the exchange call.

A `Collectives` is one group of ranks (a replica's TP, DCP or PCP group) and the four operations the engine needs:

    all_reduce(x)   sum over the group, in place (row-parallel outputs, the vocab-parallel embedding)
    all_gather(x)   [size, *x.shape]: every rank's x, by group rank (the DCP queries, PCP rows, logits)
    all_to_all(x)   x [size, ...] -> out [size, ...], out[j] = rank j's x[this rank] (the DCP (out, lse) partials)
    gather(x)       all_gather onto group rank 0 only (None elsewhere): the logits on the sampling rank

Two transports implement it: `TorchCollectives` (torch.distributed: NCCL on CUDA, which CUDA graphs can capture,
and gloo over TCP as the fallback between nodes) and `ShmCollectives` (dcpserve/kernels/shm_collectives.py: shared
memory between the CPU ranks of one node). dcpserve/engine/worker/rank_transport.py picks one per group, by device
and placement. Every rank of a group issues the same operations in the same order with the same shapes and dtypes
(NCCL's rule, which the shared-memory transport relies on too); tests/engine/worker/collectives_recorder.py checks
it on every layout the tests run.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist


@runtime_checkable
class Collectives(Protocol):
    """One group of ranks and the collectives the engine issues over it (see the module docstring)."""

    name: str  # the group's role: "tp", "dcp" or "pcp" (in errors and the recorder's log)
    transport: str  # "shm", "gloo" or "nccl"
    size: int
    rank: int  # this rank's index in the group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the group in place and returns it. x must be contiguous."""
        ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[size, *x.shape]: each rank's x in group-rank order."""
        ...

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """x [size, ...] -> [size, ...] where out[j] is rank j's x[self.rank]."""
        ...

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """[size, *x.shape] on group rank 0, None on the others."""
        ...

    def close(self) -> None:
        """Releases what the transport holds (shared memory); the group is unusable afterwards."""
        ...


class TorchCollectives:
    """A torch.distributed process group (NCCL or gloo) as a Collectives. `group` None is the default group."""

    def __init__(self, group: dist.ProcessGroup | None = None, name: str = "world") -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized: call init_process_group before building the collectives")
        self.group = group
        self.name = name
        self.transport = str(dist.get_backend(group))
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._first = dist.get_global_rank(group, 0) if group is not None else 0  # gather's destination

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        gathered = x.new_empty((self.size, *x.shape))
        if self.transport == "nccl":  # one output buffer: no per-rank tensors to assemble
            dist.all_gather_into_tensor(gathered.view(-1), x.contiguous().view(-1), group=self.group)
        else:  # gloo takes a list of outputs
            dist.all_gather(list(gathered.unbind(0)), x.contiguous(), group=self.group)
        return gathered

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != self.size:
            raise ValueError(f"all_to_all takes [group size {self.size}, ...], got shape {tuple(x.shape)}")
        received = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(received, x.contiguous(), group=self.group)
        return received

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        x = x.contiguous()
        if self.rank != 0:
            dist.gather(x, None, dst=self._first, group=self.group)
            return None
        gathered = x.new_empty((self.size, *x.shape))
        dist.gather(x, list(gathered.unbind(0)), dst=self._first, group=self.group)
        return gathered

    def close(self) -> None:
        return None  # the process group is destroyed with the default group (destroy_parallel_state)

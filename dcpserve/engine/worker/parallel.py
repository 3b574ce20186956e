"""This rank's place in its replica: TP rank, PCP rank, DCP rank, process groups, and the collectives layers use.

A replica is pcp groups of tp ranks: world rank r is TP rank r % tp of PCP group r // tp. tp = pcp = 1 needs no
torch.distributed at all (ParallelState.single()). Otherwise every rank of the worker group calls
init_parallel_state(). The TP group is the rank's own PCP group (the whole world at pcp = 1). A DCP group of
dcp = a * pcp ranks (a = dcp at pcp = 1) is, in every PCP group, the run of a consecutive TP ranks holding copies
of the same KV heads: DCP rank q * a + t % a for TP rank t of PCP group q. The PCP peers of a rank are the ranks
with its TP rank in every PCP group: they hold the same KV heads and trade a prefill's K/V (docs/dcp.md).

Each group's collectives (`tp_comm`, `dcp_comm`, `pcp_comm`: dcpserve/kernels/collectives.py) run over the transport
dcpserve/engine/worker/rank_transport.py picks for it: NCCL on CUDA, shared memory between CPU ranks of one node,
gloo over TCP otherwise. The torch.distributed groups exist in every case (gloo's are the fallback).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dcpserve.engine.worker.rank_transport import group_collectives, publish_node
from dcpserve.kernels.collectives import Collectives


@dataclass
class ParallelState:
    """TP, PCP and DCP coordinates of one rank, with its process groups (None when the size is 1)."""

    tp_size: int
    tp_rank: int
    dcp_size: int
    dcp_rank: int
    num_kv_heads: int  # the model's KV heads (for which ones this rank holds)
    tp_comm: Collectives | None = None
    dcp_comm: Collectives | None = None
    pcp_size: int = 1
    pcp_rank: int = 0
    pcp_comm: Collectives | None = None  # this TP rank in every PCP group (None at pcp = 1)

    @classmethod
    def single(cls, num_kv_heads: int) -> ParallelState:
        return cls(tp_size=1, tp_rank=0, dcp_size=1, dcp_rank=0, num_kv_heads=num_kv_heads)

    @property
    def world_rank(self) -> int:
        return self.pcp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.pcp_size * self.tp_size

    @property
    def dcp_heads(self) -> int:
        """a: the consecutive TP ranks of one PCP group inside this rank's DCP group (they hold one KV head
        between them and split its query heads); dcp / pcp at pcp > 1 with DCP, dcp at pcp = 1."""
        return self.dcp_size // self.pcp_size if self.pcp_size > 1 and self.dcp_size > 1 else self.dcp_size

    @property
    def samples(self) -> bool:
        """Whether this rank's TP group runs the LM head: PCP group 0's (every group runs the step's decodes and the
        last token of every prefill chunk is PCP group 0's: dcpserve/engine/worker/pcp.py)."""
        return self.pcp_rank == 0

    @property
    def is_driver(self) -> bool:
        """World rank 0 samples and returns tokens."""
        return self.tp_rank == 0 and self.pcp_rank == 0

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
        """Sum over the TP group (row-parallel outputs), in place; identity at tp = 1."""
        if self.tp_comm is None:
            return x
        return self.tp_comm.all_reduce(x)

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """All-gather shards along the last dimension in TP-rank order (vocab-parallel logits)."""
        if self.tp_comm is None:
            return x
        return torch.cat(self.tp_comm.all_gather(x).unbind(0), dim=-1)

    def gather_last_dim_to_driver(self, x: torch.Tensor) -> torch.Tensor | None:
        """Gathers shards along the last dimension in TP-rank order onto the driver (TP rank 0) only; None on the
        other ranks. Sampling needs the full vocabulary on the driver alone, so the others receive nothing."""
        if self.tp_comm is None:
            return x
        parts = self.tp_comm.gather(x)
        return torch.cat(parts.unbind(0), dim=-1) if parts is not None else None

    @property
    def transports(self) -> dict[str, str]:
        """Each group's transport ("shm", "gloo", "nccl") by role; empty at tp = pcp = 1."""
        comms = {"tp": self.tp_comm, "dcp": self.dcp_comm, "pcp": self.pcp_comm}
        return {name: comm.transport for name, comm in comms.items() if comm is not None}


class Rendezvous:
    """Rank 0's end of a worker group's rendezvous: a TCP socket listening on one address, from the moment the port
    is chosen until the group's store takes it over.

    torch's TCPStore, left to itself, binds its server to every interface ("::"), whatever host the init_method
    names; handed this socket (master_listen_fd) it serves on the address the cluster uses, loopback on a local
    cluster. Holding the port from the start also leaves no window in which another group on the host takes it."""

    def __init__(self, host: str) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock: socket.socket | None = socket.create_server((host, 0), family=family, backlog=128)
        self.host = host
        self.port: int = self._sock.getsockname()[1]

    @property
    def init_method(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    def take_fd(self) -> int:
        """The listening socket's descriptor, handed over once: the store owns (and closes) it from then on."""
        if self._sock is None:
            raise RuntimeError("this rendezvous socket was already handed to a store")
        sock, self._sock = self._sock, None
        return sock.detach()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def parse_tcp_init_method(init_method: str) -> tuple[str, int]:
    """("host", port) of "tcp://host:port" (an IPv6 host in brackets)."""
    prefix = "tcp://"
    host, sep, port = init_method.removeprefix(prefix).rpartition(":")
    if not init_method.startswith(prefix) or not sep or not host or not port.isdigit():
        raise ValueError(f"init_method must be tcp://host:port, got {init_method!r}")
    return host.strip("[]"), int(port)


def interface_with_address(address: str) -> str | None:
    """The name of the network interface that holds this IPv4 address (Linux), or None."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                reply = fcntl.ioctl(probe.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
        if socket.inet_ntoa(reply[20:24]) == address:
            return name
    return None


def init_parallel_state(
    tp_size: int,
    tp_rank: int,
    dcp_size: int,
    num_kv_heads: int,
    init_method: str,
    backend: str,
    timeout_s: float = 300.0,
    rendezvous: Rendezvous | None = None,
    local_address: str | None = None,
    pcp_size: int = 1,
    transport: str = "auto",
) -> ParallelState:
    """Joins this worker group's process group (one per group: its own init_method address and port) and builds
    the TP, DCP and PCP subgroups, each with the transport dcpserve/engine/worker/rank_transport.py picks for it
    (`transport`: the rank_transport argument; `backend` is torch.distributed's, "nccl" on CUDA ranks, "gloo" on
    CPU ones). `tp_rank` is the rank in the whole group (the world rank: the TP rank at pcp = 1). Every rank must
    call it with the same arguments except tp_rank, `rendezvous` (rank 0's listening socket for the group's store,
    whose init_method every rank is given) and `local_address` (this rank's node address: gloo's connections
    between ranks listen there rather than wherever the host name resolves, unless GLOO_SOCKET_IFNAME is set).
    `timeout_s` bounds every collective wait of every transport."""
    if tp_size == 1 and pcp_size == 1:
        return ParallelState.single(num_kv_heads)
    world_size, rank = tp_size * pcp_size, tp_rank
    if backend == "gloo" and local_address is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
        interface = interface_with_address(local_address)
        if interface is not None:
            # Read by every ProcessGroupGloo torch creates in this process (the world and the DCP groups); this rank
            # actor's process exists for this group alone.
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    host, port = parse_tcp_init_method(init_method)
    timeout = timedelta(seconds=timeout_s)
    if rendezvous is not None and rank != 0:
        raise ValueError(f"only rank 0 hosts the rendezvous; rank {rank} was given one")
    store = dist.TCPStore(host, port, world_size=world_size, is_master=rank == 0, timeout=timeout,
                          master_listen_fd=None if rendezvous is None else rendezvous.take_fd())
    dist.init_process_group(backend=backend, store=store, world_size=world_size, rank=rank, timeout=timeout)
    publish_node(store, rank)
    pcp_rank, local_tp_rank = divmod(rank, tp_size)
    a = dcp_size // pcp_size if pcp_size > 1 and dcp_size > 1 else dcp_size
    # new_group is collective: every rank creates every group, in the same order, and keeps its own.
    tp_ranks: list[int] = list(range(world_size))
    tp_group: dist.ProcessGroup | None = None  # the default group
    pcp_ranks: list[int] = []
    pcp_group = dcp_group = None
    dcp_ranks: list[int] = []
    if pcp_size > 1:
        for q in range(pcp_size):
            members = list(range(q * tp_size, (q + 1) * tp_size))
            group = dist.new_group(members)
            if q == pcp_rank:
                tp_group, tp_ranks = group, members
        for t in range(tp_size):
            members = list(range(t, world_size, tp_size))
            group = dist.new_group(members)
            if t == local_tp_rank:
                pcp_group, pcp_ranks = group, members
    if dcp_size > 1:
        for start in range(0, tp_size, a):
            # Sorted world ranks: group rank q * a + u is TP rank start + u of PCP group q, its DCP rank.
            members = [q * tp_size + start + u for q in range(dcp_size // a) for u in range(a)]
            group = dist.new_group(members)
            if start <= local_tp_rank < start + a:
                dcp_group, dcp_ranks = group, members
    device_type = "cuda" if backend == "nccl" else "cpu"

    def collectives(name: str, members: list[int], group: dist.ProcessGroup | None) -> Collectives:
        return group_collectives(store, name, members, rank, group, device_type, transport, timeout_s)

    return ParallelState(
        tp_size=tp_size,
        tp_rank=local_tp_rank,
        dcp_size=dcp_size,
        dcp_rank=(pcp_rank * a + local_tp_rank % a) if dcp_size > 1 else 0,
        num_kv_heads=num_kv_heads,
        tp_comm=collectives("tp", tp_ranks, tp_group) if tp_size > 1 else None,
        dcp_comm=collectives("dcp", dcp_ranks, dcp_group) if dcp_size > 1 else None,
        pcp_size=pcp_size,
        pcp_rank=pcp_rank,
        pcp_comm=collectives("pcp", pcp_ranks, pcp_group) if pcp_size > 1 else None,
    )


def destroy_parallel_state(state: ParallelState) -> None:
    for comm in (state.tp_comm, state.dcp_comm, state.pcp_comm):
        if comm is not None:
            comm.close()
    if state.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()

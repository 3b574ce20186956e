"""This rank's place in its replica: TP rank, DCP rank, process groups, and the collectives layers use.

tp = 1 needs no torch.distributed at all (ParallelState.single()). With tp > 1 every rank of the worker group
calls init_parallel_state(); the TP group is the whole world of the worker group and DCP groups are runs of
dcp consecutive TP ranks (docs/dcp.md).
"""

from __future__ import annotations

import os
import socket
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
        assert self.tp_group is not None  # set whenever tp_size > 1
        driver = dist.get_global_rank(self.tp_group, 0)
        parts = [torch.empty_like(x) for _ in range(self.tp_size)] if self.is_driver else None
        dist.gather(x, parts, dst=driver, group=self.tp_group)
        return torch.cat(parts, dim=-1) if parts is not None else None


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
) -> ParallelState:
    """Joins this worker group's process group (one per group: its own init_method address and port) and builds
    the DCP subgroups. Every rank must call it with the same arguments except tp_rank, `rendezvous` (rank 0's
    listening socket for the group's store, whose init_method every rank is given) and `local_address` (this
    rank's node address: gloo's connections between ranks listen there rather than wherever the host name
    resolves, unless GLOO_SOCKET_IFNAME is set)."""
    if tp_size == 1:
        return ParallelState.single(num_kv_heads)
    if backend == "gloo" and local_address is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
        interface = interface_with_address(local_address)
        if interface is not None:
            # Read by every ProcessGroupGloo torch creates in this process (the world and the DCP groups); this rank
            # actor's process exists for this group alone.
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    host, port = parse_tcp_init_method(init_method)
    timeout = timedelta(seconds=timeout_s)
    if rendezvous is not None and tp_rank != 0:
        raise ValueError(f"only TP rank 0 hosts the rendezvous; rank {tp_rank} was given one")
    store = dist.TCPStore(host, port, world_size=tp_size, is_master=tp_rank == 0, timeout=timeout,
                          master_listen_fd=None if rendezvous is None else rendezvous.take_fd())
    dist.init_process_group(backend=backend, store=store, world_size=tp_size, rank=tp_rank, timeout=timeout)
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

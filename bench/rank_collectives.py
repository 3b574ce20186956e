"""bench/rank_transport.py's collectives section: each collective the engine issues, over each CPU transport of
dcpserve/engine/worker/rank_transport.py (shared memory, gloo over TCP loopback), between ranks in processes of their
own (torch.multiprocessing, no Ray).

Each size is a message a step of the tiny model or of a real one sends: a decode batch's hidden states, a DCP
exchange's (out, lse) partials, a prefill chunk's hidden states (more than a shared-memory slot: several rounds). The
transports alternate per size, so load spikes hit both; every rank times the same calls and rank 0 reports the
median per call.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.harness.model_harness import free_port
from dcpserve.engine.worker.rank_transport import group_collectives, publish_node

TRANSPORTS = ("shm", "gloo")


@dataclass(frozen=True)
class Message:
    label: str
    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def nbytes(self, size: int) -> int:
        elements = 1
        for dim in self.shape:
            elements *= dim
        return elements * torch.tensor([], dtype=self.dtype).element_size() * (size if self.op == "all_to_all" else 1)


MESSAGES = (
    Message("decode hidden, batch 8, tiny model", "all_reduce", (8, 128), torch.float32),
    Message("decode queries, batch 8, tiny model", "all_gather", (8, 2, 32), torch.float32),
    Message("decode (out, lse), batch 8, tiny model", "all_to_all", (8, 2, 33), torch.float32),
    Message("logits to rank 0, batch 8, tiny model", "gather", (8, 256), torch.float32),
    Message("decode hidden, batch 64, hidden 7168 (bf16)", "all_reduce", (64, 7168), torch.bfloat16),
    Message("prefill hidden, 2048 tokens, hidden 4096 (bf16)", "all_reduce", (2048, 4096), torch.bfloat16),
)


def _rank(rank: int, size: int, port: int, calls: int, rounds: int, results: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size=size, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timedelta(seconds=60))
    try:
        publish_node(store, rank)
        members = list(range(size))
        comms = {name: group_collectives(store, "tp", members, rank, None, "cpu", name, 60.0) for name in TRANSPORTS}
        for message in MESSAGES:
            shape = (size, *message.shape) if message.op == "all_to_all" else message.shape
            # all_reduce sums in place: zeros keep repeated calls finite (the work is the same for any values)
            x = (torch.zeros(shape) if message.op == "all_reduce" else torch.randn(shape)).to(message.dtype)
            for _ in range(rounds):
                for name, comm in comms.items():
                    op = getattr(comm, message.op)
                    op(x)  # warm
                    dist.barrier()
                    times = []
                    for _ in range(calls):
                        start = time.perf_counter()
                        op(x)
                        times.append(time.perf_counter() - start)
                    if rank == 0:  # a manager's dict: assign, do not mutate the value in place
                        key = f"{message.label}|{name}"
                        results[key] = results.get(key, []) + times
        for comm in comms.values():
            comm.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure(size: int = 2, calls: int = 50, rounds: int = 3) -> dict[tuple[str, str], float]:
    """Median seconds per call of each message over each transport, (label, transport) -> seconds."""
    with mp.Manager() as manager:
        shared = manager.dict()
        mp.spawn(_rank, (size, free_port(), calls, rounds, shared), nprocs=size)
        medians: dict[tuple[str, str], float] = {}
        for key, times in shared.items():
            label, transport = key.split("|")
            medians[(label, transport)] = statistics.median(times)
        return medians


def table(size: int, medians: dict[tuple[str, str], float]) -> list[str]:
    lines = [f"collectives between {size} CPU ranks, {os.cpu_count()} cores, torch {torch.__version__}; "
             f"median us per call",
             f"  {'message':48s} {'op':10s} {'bytes':>10s} {'shm':>9s} {'gloo':>9s} {'gloo/shm':>9s}"]
    for message in MESSAGES:
        shm, gloo = (medians[(message.label, name)] * 1e6 for name in TRANSPORTS)
        lines.append(f"  {message.label:48s} {message.op:10s} {message.nbytes(size):10d} {shm:9.1f} {gloo:9.1f} "
                     f"{gloo / shm:8.1f}x")
    return lines

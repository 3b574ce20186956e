"""Micro-benchmark of the driver <-> TP rank step transport, with echo ranks (no model): how long one step's round
trip takes and what the ranks cost while they wait for the next step.

Three transports, measured in alternating rounds on one local Ray instance so load spikes hit all of them:
- ray.put + one actor task per rank per step (the worker group's transport before the step channel),
- a Ray compiled graph (ray.dag InputNode -> one bind per rank -> MultiOutputNode, experimental_compile()),
- the step channel the worker group uses (dcpserve.engine.worker.rank_channel: one authenticated connection per
  rank), over TCP and over the Unix socket a rank on the driver's host takes.
Each step is a pickled stand-in of a SchedulerOutput (per sequence: an id, one new token, its position, its block
table and a dict of sampling parameters); rank 0 replies with one sampled token per sequence, the others with None.

Then (first in the output) the collectives between the ranks, shared memory against gloo (bench/rank_collectives.py).

    python -m bench rank_transport               # tp=2
    python -m bench rank_transport --tp 4 --rounds 10
    python -m bench rank_transport --collectives-only
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray.dag import InputNode, MultiOutputNode

from bench.rank_collectives import measure, table
from dcpserve.engine.worker.rank_channel import ChannelListener, FrameSocket, connect_rank
from dcpserve.local.tls import local_ray_tls

# (label, sequences, block-table entries per sequence)
STEPS = [("decode, batch 8", 8, 4), ("decode, batch 64", 64, 4), ("batch 64, 4096 blocks each", 64, 4096)]


@ray.remote(concurrency_groups={"steps": 2})  # type: ignore[call-overload]  # Ray's overloads of remote() omit concurrency_groups
class EchoRank:
    """A rank that unpickles the step and replies like a RankWorker, without a model."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def pid(self) -> int:
        return os.getpid()

    def execute(self, step: bytes) -> bytes:
        rows = pickle.loads(step)
        return pickle.dumps(({row[0]: 1 for row in rows} if self.rank == 0 else None, 0.0))

    @ray.method(concurrency_group="steps")
    def serve_steps(self, address: tuple[str, int], authkey: bytes, local_address: str | None) -> None:
        channel = connect_rank(address, authkey, self.rank, timeout_s=60, local_address=local_address)
        try:
            while True:
                try:
                    step = channel.recv()
                except EOFError:
                    return
                channel.send(self.execute(bytes(step)))
        finally:
            channel.close()


def step_payload(sequences: int, blocks: int) -> bytes:
    params = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": 64, "seed": None, "logprobs": None}
    return pickle.dumps([(f"{i:032x}", [i], 64 + i, list(range(i, i + blocks)), params) for i in range(sequences)],
                        protocol=pickle.HIGHEST_PROTOCOL)


class Transports:
    """The three ways of sending a step to every rank and collecting the replies, on the same echo ranks."""

    def __init__(self, tp: int) -> None:
        self.ranks = [EchoRank.remote(r) for r in range(tp)]  # type: ignore[attr-defined]  # mypy applies no class decorator: an ActorClass
        self.pids = ray.get([rank.pid.remote() for rank in self.ranks])
        with InputNode() as step:
            graph = MultiOutputNode([rank.execute.bind(step) for rank in self.ranks])
        self.graph = graph.experimental_compile(_max_inflight_executions=1)
        self.loops: list[Any] = []
        self.channels: dict[str, list[FrameSocket]] = {}
        for transport, local in (("tcp", False), ("unix", True)):
            listener = ChannelListener(ray.util.get_node_ip_address(), local=local)
            self.loops += [rank.serve_steps.remote(listener.address, listener.authkey, listener.local_address)
                           for rank in self.ranks]
            connected = dict(accepted for accepted in (listener.accept(tp, 60) for _ in range(tp)) if accepted)
            listener.close()
            self.channels[transport] = [connected[rank] for rank in range(tp)]
            if {channel.transport for channel in self.channels[transport]} != {transport}:
                raise RuntimeError(f"the {transport} step channels connected over another transport")

    def tasks(self, step: bytes) -> list[Any]:
        ref = ray.put(step)
        refs = [rank.execute.remote(ref) for rank in self.ranks]
        pending = refs
        while pending:  # as the worker group did: fail as soon as any rank fails
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done)
        return [pickle.loads(reply) for reply in ray.get(refs)]

    def compiled_graph(self, step: bytes) -> list[Any]:
        return [pickle.loads(reply) for reply in ray.get(self.graph.execute(step), timeout=-1)]

    def step_channel(self, step: bytes, transport: str = "unix") -> list[Any]:
        import selectors

        channels = self.channels[transport]
        for channel in channels:
            channel.send(step)
        replies: dict[int, Any] = {}
        with selectors.DefaultSelector() as selector:
            for rank, channel in enumerate(channels):
                selector.register(channel, selectors.EVENT_READ, rank)
            while len(replies) < len(channels):
                for key, _ in selector.select():
                    replies[key.data] = pickle.loads(channels[key.data].recv())
        return [replies[rank] for rank in range(len(channels))]

    def idle_cores(self, seconds: float = 3.0) -> list[float]:
        """CPU cores each rank process uses over `seconds` in which no step is sent."""
        before = [_cpu_seconds(pid) for pid in self.pids]
        time.sleep(seconds)
        return [(_cpu_seconds(pid) - start) / seconds for pid, start in zip(self.pids, before, strict=True)]

    def close(self) -> None:
        self.graph.teardown()
        for channels in self.channels.values():
            for channel in channels:
                channel.close()
        ray.get(self.loops, timeout=30)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentiles(seconds: list[float]) -> str:
    ordered = sorted(seconds)

    def at(q: float) -> float:
        return 1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return f"{1e3 * statistics.median(ordered):8.3f} {at(0.9):8.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="echo ranks (default 2)")
    parser.add_argument("--rounds", type=int, default=20, help="alternating rounds of --steps steps per transport")
    parser.add_argument("--steps", type=int, default=25, help="steps per transport per round (default 25)")
    parser.add_argument("--collectives-only", action="store_true",
                        help="only the collectives section (shared memory vs gloo; no Ray)")
    args = parser.parse_args(argv)
    print("\n".join(table(args.tp, measure(args.tp))))
    if args.collectives_only:
        return 0
    ray_dir = tempfile.mkdtemp(prefix="dcpbench-", dir="/tmp")  # Ray's socket paths must stay short
    local_ray_tls(Path(ray_dir), print)  # mutual TLS with a CA of this instance's own (python -m bench prepared it)
    ray.init(address="local", num_cpus=max(8, args.tp), include_dashboard=False, log_to_driver=False,
             _temp_dir=ray_dir)
    try:
        transports = Transports(args.tp)
        runs: dict[str, Callable[[bytes], list[Any]]] = {
            "ray.put + task per rank": transports.tasks,
            "compiled graph": transports.compiled_graph,
            "step channel, TCP": lambda step: transports.step_channel(step, "tcp"),
            "step channel, Unix socket": transports.step_channel,
        }
        print(f"tp={args.tp} echo ranks, {os.cpu_count()} cores, ray {ray.__version__}; round trip ms (p50 p90)")
        for label, sequences, blocks in STEPS:
            step = step_payload(sequences, blocks)
            rounds = args.rounds if blocks < 100 else max(1, args.rounds // 5)
            times: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(rounds):
                for name, run in runs.items():
                    for _ in range(args.steps):
                        start = time.perf_counter()
                        replies = run(step)
                        times[name].append(time.perf_counter() - start)
                        if len(replies[0][0]) != sequences:
                            raise RuntimeError(f"{name}: rank 0 replied for {len(replies[0][0])} of {sequences}")
            print(f"{label} ({len(step)} B):")
            for name in runs:
                print(f"  {name:26s} {percentiles(times[name])}")
        graph_idle = transports.idle_cores()
        transports.graph.teardown()
        channel_idle = transports.idle_cores()
        print(f"idle ranks, cores per rank process: compiled graph compiled {[round(c, 2) for c in graph_idle]}; "
              f"step channel only {[round(c, 2) for c in channel_idle]}")
        transports.close()
    finally:
        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The TTFT bound (issue 51 item 4) in the simulator: later turns' TTFT misses with and without it, and why the rest
still miss.

The layout-pools study's load (bench/simulate_pools.py: Kimi K2 on 8 x H200 per replica, the `chat` + `agentic`
presets mixed, open loop) on one layout, every replica tp=8 dcp=1 by default, replayed once per bound (0: off). For
each request the queue is asked to grant, its arrival is looked at from every replica: the prefill that replica had
queued then (its scheduler's prompt tokens still to compute) and the request's own prefill there (its prompt less the
cached run the queue knows there), each at least as long as its chunks of `max_num_batched_tokens` take on the step
model, one chunk a step with nothing else in it. A later turn that missed the TTFT target is counted as one no replica
could have started in time when, on every replica, even that lower bound was past the target at its arrival (the
issue's alternative acceptance: "every replica's prefill backlog past the bound at those arrivals"); the queue's own
estimate (replica_choice.start_estimate: prefill at the replica's measured price, KvReport.prefill_s_per_token) is
counted beside it.

    python -m bench simulate_bound --nodes 4 --chat-rate 10 --agentic-rate 4 --ttft-target-s 2
    python -m bench simulate_bound --nodes 16 --write-docs   # docs/benchmarks.md's section
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from bench.harness.docs_section import DocsSection, bench_command
from bench.simulate_pools import SERVE, Load, shape_of, trace_of
from dcpserve.deployments.admission.queue import AdmissionQueue
from dcpserve.deployments.admission.replica_choice import (
    prefix_credit,
    prompt_blocks,
    start_estimate,
)
from dcpserve.deployments.messages import Acquire, AcquireReply
from dcpserve.simulator.metrics import RequestRecord
from dcpserve.simulator.replica import SimReplica
from dcpserve.simulator.run import SimPool, Simulation, SimulationConfig
from dcpserve.simulator.step_time import StepWork


@dataclass(frozen=True)
class Arrival:
    """One request at its arrival, seen from every replica: the soonest start, by the replicas' true queued prefill
    and by the queue's estimate, and the grant's reason."""

    true_start_s: float  # min over replicas: at least its queued prefill (scheduler) + its own there (step model)
    estimated_start_s: float  # min over replicas: the queue's start_estimate
    decision: str = ""


@contextmanager
def observed(simulation: list[Simulation], arrivals: dict[str, Arrival]) -> Iterator[None]:
    """Records an Arrival for every request the queue is asked to grant (AdmissionQueue.acquire_reply, wrapped for
    the run); `simulation`: the one running (its replicas are the truth)."""
    real = AdmissionQueue.acquire_reply

    async def acquire_reply(queue: AdmissionQueue, request: Acquire, retry_after_s: int) -> AcquireReply:
        if request.ticket not in arrivals and isinstance(request.need, int):  # its first ask (not a retry)
            arrivals[request.ticket] = look(queue, simulation[0], request)
        reply = await real(queue, request, retry_after_s)
        grant = queue.grant_of(request.ticket)
        if grant is not None:
            arrivals[request.ticket] = dataclasses.replace(arrivals[request.ticket], decision=grant.decision)
        return reply

    AdmissionQueue.acquire_reply = acquire_reply  # type: ignore[method-assign,assignment]  # this process' runs
    try:
        yield
    finally:
        AdmissionQueue.acquire_reply = real  # type: ignore[method-assign]


def look(queue: AdmissionQueue, simulation: Simulation, request: Acquire) -> Arrival:
    now = queue.now()
    assert isinstance(request.need, int)  # one layout
    true_start, estimated_start = float("inf"), float("inf")
    for replica_id, replica in simulation.replicas.items():
        kv = queue.replicas.get(replica_id)
        if kv is None or not kv.grantable:
            continue
        reported, inflight = kv.prefix.match(request.ask)
        own_blocks = max(prompt_blocks(request.need, request.ask) - max(prefix_credit(kv, reported), inflight), 0.0)
        estimated_start = min(estimated_start, start_estimate(kv, own_blocks, now).start_s)
        true_start = min(true_start, queued_prefill_s(replica) + own_prefill_s(replica, request, own_blocks))
    return Arrival(true_start, estimated_start)


def prefill_s(replica: SimReplica, start: int, tokens: int) -> float:
    """At least how long `tokens` of prompt after `start` cached ones take on the replica: chunks of its step's token
    budget, one chunk a step with nothing else in it (the replica's step model)."""
    chunk = replica.shape.scheduler.max_num_batched_tokens
    seconds = 0.0
    while tokens > 0:
        n = min(chunk, tokens)
        seconds += replica.step_model.step_seconds(StepWork.from_rows([(start, n)]))
        start, tokens = start + n, tokens - n
    return seconds


def queued_prefill_s(replica: SimReplica) -> float:
    """At least how long the prompts the replica has still to compute take (its scheduler's requests, a waiting
    one's cached run not counted: what its KvLedger.prefill_tokens counts)."""
    seconds = 0.0
    block_manager = replica.block_manager
    for request in replica.scheduler.requests.values():
        left = request.num_prompt_tokens - request.num_computed_tokens
        if left > 0 and request.num_computed_tokens == 0:
            left -= block_manager.hit_blocks(request) * block_manager.tokens_per_block
        if left > 0:
            seconds += prefill_s(replica, request.num_prompt_tokens - left, left)
    return seconds


def own_prefill_s(replica: SimReplica, request: Acquire, own_blocks: float) -> float:
    """At least how long the request's own prompt takes there: its tokens past the cached run the queue knows."""
    prompt = request.ask.num_prompt_tokens if request.ask is not None else 0
    own = min(round(own_blocks * replica.shape.tokens_per_block), prompt)
    return prefill_s(replica, prompt - own, own)


def run_bound(load: Load, dcp: int, nodes: int, bound_s: float) -> dict[str, Any]:
    shape, step_model = shape_of(dcp)
    serve = dataclasses.replace(SERVE, admission_ttft_bound_s=bound_s)
    pool = SimPool("chat" if dcp == 1 else "long", shape, nodes, step_model)  # as bench/simulate_pools.py names it
    config = SimulationConfig(shape=shape, num_replicas=1, serve=serve, pools=(pool,))
    simulation = Simulation(config, step_model)
    arrivals: dict[str, Arrival] = {}
    wall = time.perf_counter()
    with observed([simulation], arrivals):
        summary = simulation.run(trace_of(load))
    wall = time.perf_counter() - wall
    target = load.ttft_target_s
    rows: dict[str, dict[str, int]] = {}
    for kind in ("agentic", "all"):
        later = [(ticket, r) for ticket, r in simulation.recorder.records.items()
                 if r.turn > 0 and (kind == "all" or (r.session_id or "").startswith(f"{kind}-"))]
        missed = [(ticket, r) for ticket, r in later if missed_ttft(r, target)]
        row = {"later_turns": len(later), "missed": len(missed), "no_replica_in_time": 0, "queue_saw_none": 0}
        for ticket, _ in missed:
            arrival = arrivals.get(ticket)
            if arrival is None:
                continue
            row["no_replica_in_time"] += arrival.true_start_s > target
            row["queue_saw_none"] += arrival.estimated_start_s > target
            key = f"granted_{arrival.decision or 'never'}"
            row[key] = row.get(key, 0) + 1
        rows[kind] = row
    return {"bound_s": bound_s, "wall_s": wall, "rows": rows, "decisions": summary.get("admission", {}),
            "ttft_s": summary["ttft_s"]}


SCRIPT = "bench/simulate_bound.py"


def missed_ttft(record: RequestRecord, target_s: float) -> bool:
    return record.first_token_at is None or record.first_token_at - record.arrival > target_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=4, help="nodes of 8 GPUs, one tp=8 replica each (default 4)")
    parser.add_argument("--requests-per-node", type=int, default=400)
    parser.add_argument("--chat-rate", type=float, default=10.0, help="chat sessions/s per node (default 10)")
    parser.add_argument("--agentic-rate", type=float, default=4.0, help="agentic sessions/s per node (default 4)")
    parser.add_argument("--ttft-target-s", type=float, default=2.0, help="the TTFT target (default 2)")
    parser.add_argument("--dcp", type=int, choices=(1, 8), default=1, help="every replica tp=8 x this (default 1)")
    parser.add_argument("--bounds", type=float, nargs="+", default=[0.0, 2.0],
                        help="the queue's admission_ttft_bound_s per run (default 0 2; 0: off)")
    parser.add_argument("--write-docs", action="store_true", help="write the section of docs/benchmarks.md")
    args = parser.parse_args(argv)
    docs = DocsSection(SCRIPT)
    if args.write_docs:
        docs.check()  # fail now, not after a long run
    load = Load(args.nodes, args.requests_per_node, args.chat_rate, args.agentic_rate, args.ttft_target_s, 0.05)
    results = [run_bound(load, args.dcp, args.nodes, bound) for bound in args.bounds]
    command = bench_command("simulate_bound", sys.argv[1:] if argv is None else argv)
    lines = [f"## The TTFT bound in the simulator (`{SCRIPT}`)", "",
             f"`{command}`. Kimi K2 on 8 x H200 per replica, {args.nodes} replicas of tp=8 dcp={args.dcp}; the "
             f"`chat` + `agentic` presets mixed, open loop at {args.chat_rate:g} chat + {args.agentic_rate:g} agentic "
             f"sessions/s per node, {args.requests_per_node * args.nodes:,} requests, TTFT target "
             f"{args.ttft_target_s:g} s. Later turns: every turn of a session after its first. \"no replica could "
             "start in time\": at the turn's arrival, every replica's queued prefill plus its own (at least its "
             "chunks on the step model) was past the target; \"queue's estimate\": the same by the queue's "
             "start_estimate.", "",
             "| bound | sessions | later turns | later-turn TTFT misses | of them, no replica could start in time "
             "(true backlog) | (queue's estimate) | their grants | TTFT p50 / p90 | wall |",
             "|---|---|---|---|---|---|---|---|---|"]
    for result in results:
        ttft = result["ttft_s"]
        for kind, row in result["rows"].items():
            grants = ", ".join(f"{k.removeprefix('granted_')} {v}" for k, v in sorted(row.items())
                               if k.startswith("granted_"))
            lines.append(f"| {result['bound_s']:g} s | {kind} | {row['later_turns']} | {row['missed']} | "
                         f"{row['no_replica_in_time']} | {row['queue_saw_none']} | {grants} | "
                         f"{ttft['p50']:.2f} / {ttft['p90']:.2f} s | {result['wall_s']:.0f} s |")
    if len(results) > 1 and results[0]["bound_s"] == 0:
        lines.append("")
        for kind in results[0]["rows"]:
            off = results[0]["rows"][kind]["missed"]
            for result in results[1:]:
                on = result["rows"][kind]["missed"]
                change = f"{(on - off) / off:+.0%}" if off else "-"
                lines.append(f"- {kind} later-turn TTFT misses, bound {result['bound_s']:g} s against off: "
                             f"{off} -> {on} ({change}; target -30%)")
    section = "\n".join(lines)
    print(section)
    if args.write_docs:
        docs.write(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())

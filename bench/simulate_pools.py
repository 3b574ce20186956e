"""Layout pools at cluster scale in the simulator: the best pooled split against the best single layout, same GPUs.

Kimi K2 (4-bit weights, fp8 KV, 256k context) on 8 x H200 per replica, every replica tp=8. The trace mixes the
`chat` and `agentic` presets (dcpserve/simulator/synth.py `mix`): short chat turns and long agentic coding sessions,
open loop at rates scaled with the nodes so that every node sees the same load. Each configuration replays the same
trace through the app's real admission queue (pool choice included) and schedulers on simulated GPUs:

- single layouts: every replica tp=8 dcp=1, or every replica tp=8 dcp=8;
- pooled splits: k replicas of tp=8 dcp=1 ("chat" pool) and the rest tp=8 dcp=8 ("long" pool), for k a quarter,
  half and three quarters of the replicas.

Goodput is the requests that finished with TTFT <= --ttft-target-s and their own mean ITL <= --itl-target-s, per
second of the window in which sessions start (the same for every configuration: dcpserve/simulator/metrics.py
`goodput`); the table gives the share met per class of request too.

    python -m bench simulate_pools --nodes 64          # 512 GPUs (about an hour on 2 cores)
    python -m bench simulate_pools --nodes 4 --quick   # a quick look
    python -m bench simulate_pools --nodes 64 --write-docs
    python -m bench simulate_pools --nodes 4 --rule fastest   # the queue's earlier pool choice, for comparison

`--rule fastest` prices a pool by its replica's recent step alone (the lowest step with room wins, as the queue
chose before it weighed the request's share of the KV): the comparison docs/structure.md quotes.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import dcpserve.deployments.admission.pools as admission_pools
from bench.harness.docs_section import DocsSection, bench_command
from dcpserve.cluster.published_models import model_spec
from dcpserve.engine.config import SchedulerConfig
from dcpserve.simulator.gpus import gpu_spec
from dcpserve.simulator.metrics import goodput, mean_itl_s, meets_slo
from dcpserve.simulator.replica import ReplicaShape
from dcpserve.simulator.run import ServeSettings, SimPool, Simulation, SimulationConfig
from dcpserve.simulator.step_time import RooflineModel
from dcpserve.simulator.synth import PRESETS, generate, mix

SCRIPT = "bench/simulate_pools.py"
GPUS_PER_NODE = 8
BLOCK_SIZE = 64
MAX_MODEL_LEN = 262144
SERVE = ServeSettings(max_queued_requests=100_000, queue_timeout_s=120.0)


@dataclass(frozen=True)
class Setup:
    """One configuration: replicas of tp=8 dcp=1 and of tp=8 dcp=8."""

    label: str
    dcp1: int
    dcp8: int


@dataclass(frozen=True)
class Load:
    nodes: int
    requests_per_node: int
    chat_rate_per_node: float  # chat sessions per second per node
    agentic_rate_per_node: float  # agentic sessions per second per node
    ttft_target_s: float
    itl_target_s: float
    rule: str = "cheapest"
    ttft_bound_s: float = SERVE.admission_ttft_bound_s  # the queue's admission_ttft_bound_s (0: off)


def step_alone(replica: object, blocks: int, step_s: float) -> float:
    """The earlier rule's price of a pool: its replica's recent step, whatever the request's share of it."""
    return step_s


def trace_of(load: Load) -> list[Any]:
    share = load.requests_per_node * load.nodes // 2
    chat = dataclasses.replace(PRESETS["chat"], rate_per_s=load.chat_rate_per_node * load.nodes)
    agentic = dataclasses.replace(PRESETS["agentic"], rate_per_s=load.agentic_rate_per_node * load.nodes)
    return mix([generate(chat, share, seed=0), generate(agentic, share, seed=1)])


def shape_of(dcp: int) -> tuple[ReplicaShape, RooflineModel]:
    step_model = RooflineModel(model_spec("kimi-k2"), gpu_spec("h200"), 8, dcp, weight_dtype="nvfp4",
                               kv_dtype="float8")
    scheduler = SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=1024, max_num_batched_tokens=8192)
    shape = ReplicaShape(tp=8, dcp=dcp, num_blocks=step_model.kv_blocks_per_replica(BLOCK_SIZE),
                         block_size=BLOCK_SIZE, scheduler=scheduler)
    return shape, step_model


def run_setup(job: tuple[Setup, Load]) -> dict[str, Any]:
    setup, load = job
    if load.rule == "fastest":  # this process runs only this rule's setups
        admission_pools.gpu_seconds_per_token = step_alone
    pools = []
    for name, dcp, replicas in (("chat", 1, setup.dcp1), ("long", 8, setup.dcp8)):
        if replicas:
            shape, step_model = shape_of(dcp)
            pools.append(SimPool(name, shape, replicas, step_model))
    serve = dataclasses.replace(SERVE, admission_ttft_bound_s=load.ttft_bound_s)
    config = SimulationConfig(shape=pools[0].shape, num_replicas=1, serve=serve, pools=tuple(pools))
    trace = trace_of(load)
    wall = time.perf_counter()
    assert pools[0].step_model is not None
    simulation = Simulation(config, pools[0].step_model)
    summary = simulation.run(trace)
    records = list(simulation.recorder.records.values())
    # Every configuration is sent the same sessions at the same times: goodput over the window in which sessions
    # start, the same for all, so that a configuration that serves slower does not earn a longer run to divide by.
    window = max(r.timestamp_ms or 0.0 for r in trace) / 1000.0
    good = goodput(records, window, summary["gpu_seconds"], load.ttft_target_s, load.itl_target_s)
    classes = {}
    for kind in ("chat", "agentic"):
        mine = [r for r in records if (r.session_id or "").startswith(f"{kind}-")]
        misses = {"ttft": 0, "itl": 0, "refused": 0, "later_turns": 0, "later_ttft": 0}
        for r in mine:
            misses["later_turns"] += r.turn > 0  # a session's turns after its first
            if r.outcome != "finished" or r.first_token_at is None:
                misses["refused"] += 1
                continue
            misses["ttft"] += r.first_token_at - r.arrival > load.ttft_target_s
            misses["later_ttft"] += r.turn > 0 and r.first_token_at - r.arrival > load.ttft_target_s
            misses["itl"] += (mean_itl_s(r) or 0.0) > load.itl_target_s
        classes[kind] = (sum(meets_slo(r, load.ttft_target_s, load.itl_target_s) for r in mine), len(mine), misses)
        print(f"{setup.label} {kind}: met {classes[kind][0]}/{len(mine)}, missed {misses}", file=sys.stderr)
    return {"summary": summary, "goodput": good, "classes": classes, "wall_s": time.perf_counter() - wall}


def setups(nodes: int) -> list[Setup]:
    quarter = max(nodes // 4, 1)
    splits = sorted({quarter, nodes // 2, nodes - quarter} - {0, nodes})
    return ([Setup(f"all tp=8 dcp=1 ({nodes})", nodes, 0), Setup(f"all tp=8 dcp=8 ({nodes})", 0, nodes)]
            + [Setup(f"pools: {k} dcp=1 + {nodes - k} dcp=8", k, nodes - k) for k in splits])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=64, help="nodes of 8 GPUs (default 64: 512 GPUs)")
    parser.add_argument("--requests-per-node", type=int, default=400)
    parser.add_argument("--chat-rate", type=float, default=1.0, help="chat sessions/s per node (default 1)")
    parser.add_argument("--agentic-rate", type=float, default=0.1, help="agentic sessions/s per node (default 0.1)")
    parser.add_argument("--ttft-target-s", type=float, default=5.0)
    parser.add_argument("--itl-target-s", type=float, default=0.05)
    parser.add_argument("--quick", action="store_true", help="100 requests per node")
    parser.add_argument("--rule", choices=("cheapest", "fastest"), default="cheapest",
                        help="the queue's pool choice (default cheapest, the app's; fastest: the earlier rule)")
    parser.add_argument("--jobs", type=int, default=2, help="simulations in parallel (default 2)")
    parser.add_argument("--admission-ttft-bound-s", type=float, default=SERVE.admission_ttft_bound_s,
                        help=f"the queue's TTFT bound (0: off; default {SERVE.admission_ttft_bound_s:g}, the app's)")
    parser.add_argument("--write-docs", action="store_true", help="write the section of docs/benchmarks.md")
    args = parser.parse_args(argv)
    docs = DocsSection(SCRIPT)
    if args.write_docs:
        if args.rule != "cheapest":
            parser.error("--write-docs records the app's own rule; drop --rule")
        docs.check()
    load = Load(args.nodes, 100 if args.quick else args.requests_per_node, args.chat_rate, args.agentic_rate,
                args.ttft_target_s, args.itl_target_s, args.rule, args.admission_ttft_bound_s)
    jobs = [(setup, load) for setup in setups(args.nodes)]
    with ProcessPoolExecutor(max_workers=args.jobs) as executor:
        results = dict(zip([setup for setup, _ in jobs], executor.map(run_setup, jobs), strict=True))
    section = format_section(results, load, sys.argv[1:] if argv is None else argv)
    print(section)
    if args.write_docs:
        docs.write(section)
    return 0


def format_section(results: dict[Setup, dict[str, Any]], load: Load, argv: list[str]) -> str:
    gpus = load.nodes * GPUS_PER_NODE
    command = bench_command("simulate_pools", argv)
    lines = [f"## Layout pools at {gpus} GPUs in the simulator (`bench/simulate_pools.py`)", "",
             f"`{command}`. Kimi K2 (4-bit weights, fp8 KV, 256k context) on {gpus} x H200, "
             f"replicas of tp=8; the `chat` + `agentic` presets mixed, open loop at {load.chat_rate_per_node:g} chat "
             f"and {load.agentic_rate_per_node:g} agentic sessions/s per node, {load.requests_per_node * load.nodes:,} "
             f"requests. SLO: TTFT <= {load.ttft_target_s:g} s and the request's mean ITL <= "
             f"{load.itl_target_s * 1e3:g} ms.", "",
             "| configuration | goodput req/s | SLO met | chat met | agentic met | TTFT p50 / p90 | ITL p50 / p90 | "
             "output tok/s/GPU | grants by pool | wall |", "|---|---|---|---|---|---|---|---|---|---|"]
    for setup, result in results.items():
        summary, good, classes = result["summary"], result["goodput"], result["classes"]
        met = {kind: f"{m / n:.0%}" if n else "-" for kind, (m, n, _) in classes.items()}
        grants: dict[str, int] = {}
        for key, count in summary["pool_grants"].items():
            pool = key.split("/")[0]
            grants[pool] = grants.get(pool, 0) + count
        lines.append(
            f"| {setup.label} | {good.requests_per_s:.2f} | {good.fraction_met:.0%} | {met['chat']} | "
            f"{met['agentic']} | {summary['ttft_s']['p50']:.2f} / {summary['ttft_s']['p90']:.2f} s | "
            f"{summary['itl_s']['p50'] * 1e3:.0f} / {summary['itl_s']['p90'] * 1e3:.0f} ms | "
            f"{summary['output_tokens_per_s_per_gpu']:.0f} | "
            f"{', '.join(f'{p} {n}' for p, n in sorted(grants.items()))} | {result['wall_s']:.0f} s |")
    singles = {s: r for s, r in results.items() if not (s.dcp1 and s.dcp8)}
    pooled = {s: r for s, r in results.items() if s.dcp1 and s.dcp8}
    best_single = max(singles.items(), key=lambda item: item[1]["goodput"].requests_per_s)
    if pooled:
        best_pool = max(pooled.items(), key=lambda item: item[1]["goodput"].requests_per_s)
        single_rate = best_single[1]["goodput"].requests_per_s
        ratio = best_pool[1]["goodput"].requests_per_s / single_rate if single_rate else float("inf")
        lines += ["", f"Best pooled split: {best_pool[0].label}, {ratio:.2f}x the goodput of the best single "
                  f"layout ({best_single[0].label})."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

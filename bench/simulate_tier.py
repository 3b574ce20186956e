"""The host KV tier in the simulator: prefix hits, goodput and TTFT of first and later turns with and without it.

Kimi K2 (nvfp4 weights, fp8 KV, 256k context, 64-token pages) on nodes of 8 x B200, every replica tp=8, the layouts
tp=8 dcp=1 (TP8) and tp=8 dcp=8 (TP8 + DCP8); the `agentic` preset (coding-agent sessions of ~20 turns, each turn
re-sending the whole history) closed loop at --concurrency clients per node, as bench/simulate_published.py runs it
on one node (where TP8's prefix hits fell from 95% to 17-18% past 192 clients, its KV full). Each layout runs twice
on the same trace: without a host tier, and with --host-kv (default 4x the device KV per node, each GPU's share for
its own pages; copies over the GPU's PCIe Gen5 x16 host link, dcpserve/simulator/host_tier.py).

Goodput: the requests that finished with TTFT <= --ttft-target-s and their own mean ITL <= --itl-target-s, per second
of the run (dcpserve/simulator/metrics.py `goodput`), also split by first and later turns.

    python -m bench simulate_tier --nodes 1                     # one node (minutes on 2 cores)
    python -m bench simulate_tier --nodes 4 --requests-per-client 20 --admission-ttft-bound-s 0 --write-docs
    python -m bench simulate_tier --nodes 64 --concurrency 512 --dcp 8   # 512 GPUs: hours, below

Cost (docs/benchmarks.md): one node at 512 clients x 40 requests (TP8 + DCP8) takes 107 s without the tier and 62-68 s
with it on this machine's CPU, 5 and 3 ms per request (1,957 and 580 s before the simulator's decode lane and the
ledger's remembered runs); the per-request cost grows with the nodes as the admission queue looks at more replicas
per grant. TP8 costs more per request: its 64-token blocks make every prompt ~1,000 blocks of per-block work (prefix
cache, block manager, reports), which the simulator runs unchanged.
At 64 nodes and 512 clients per node a case is 1.31 million requests (at 20 requests per client the trace has 25,436
sessions for 32,768 clients, and the loop runs below its concurrency: the simulation says so), and DCP8 with the tier
ran its first 160,000 at 210-250 requests per second of wall time: hours per case. Each case prints its progress every
--progress-s. --write-docs writes one section per node count (the one-node section is the bench's first).
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from bench.harness.docs_section import DocsSection, bench_command
from dcpserve.cluster.published_models import model_spec
from dcpserve.engine.config import SchedulerConfig
from dcpserve.simulator.gpus import gpu_spec
from dcpserve.simulator.host_tier import HostKvOption, host_tier_shape, parse_host_kv
from dcpserve.simulator.metrics import RequestRecord, goodput, goodput_by_turn, span_s
from dcpserve.simulator.replica import ReplicaShape
from dcpserve.simulator.run import ServeSettings, Simulation, SimulationConfig
from dcpserve.simulator.step_time import RooflineModel
from dcpserve.simulator.synth import PRESETS, generate

SCRIPT = "bench/simulate_tier.py"
GPUS_PER_NODE = 8
BLOCK_SIZE = 64
MAX_MODEL_LEN = 262144
# Queue bound and timeout past anything a run reaches, as bench/simulate_published.py: the clients wait.
PATIENT = ServeSettings(max_queued_requests=1_000_000, queue_timeout_s=1e9, request_timeout_s=1e9)


@dataclass(frozen=True)
class Case:
    """One run: a layout on `nodes` nodes, with or without the host tier, at a closed-loop concurrency."""

    dcp: int
    host_kv: HostKvOption | None
    nodes: int
    concurrency_per_node: int
    requests: int
    ttft_target_s: float
    itl_target_s: float
    admission_ttft_bound_s: float = PATIENT.admission_ttft_bound_s  # the queue's TTFT bound (0: off)
    prefix_hold: bool = PATIENT.admission_prefix_hold  # the queue's prefix hold (replica_choice.py)
    progress_s: float = 0.0  # a progress line on stderr every this many seconds of wall time (0: none)

    @property
    def label(self) -> str:
        layout = "TP8" if self.dcp == 1 else f"TP8 + DCP{self.dcp}"
        return f"{layout}, {'host tier ' + str(self.host_kv) if self.host_kv else 'no tier'}"


def shape_of(case: Case) -> tuple[ReplicaShape, RooflineModel]:
    gpu = gpu_spec("b200")
    step_model = RooflineModel(model_spec("kimi-k2"), gpu, 8, case.dcp, weight_dtype="nvfp4", kv_dtype="float8")
    num_blocks = step_model.kv_blocks_per_replica(BLOCK_SIZE)
    tier = None
    if case.host_kv is not None:
        tier = host_tier_shape(case.host_kv, num_blocks, BLOCK_SIZE * step_model.kv_bytes_per_token_per_rank,
                               GPUS_PER_NODE, gpu.host_link_bytes_per_s)
    scheduler = SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=1024, max_num_batched_tokens=8192)
    shape = ReplicaShape(tp=8, dcp=case.dcp, num_blocks=num_blocks, block_size=BLOCK_SIZE, scheduler=scheduler,
                         host_tier=tier)
    return shape, step_model


def run_case(case: Case) -> dict[str, Any]:
    shape, step_model = shape_of(case)
    replicas = case.nodes * GPUS_PER_NODE // shape.tp
    serve = replace(PATIENT, admission_ttft_bound_s=case.admission_ttft_bound_s,
                    admission_prefix_hold=case.prefix_hold)
    config = SimulationConfig(shape=shape, num_replicas=replicas, serve=serve,
                              concurrency=case.concurrency_per_node * case.nodes,
                              progress=sys.stderr if case.progress_s > 0 else None,
                              progress_wall_s=case.progress_s, progress_label=case.label)
    trace = generate(PRESETS["agentic"], case.requests, seed=0)
    wall = time.perf_counter()
    simulation = Simulation(config, step_model)
    summary = simulation.run(trace)
    records = list(simulation.recorder.records.values())
    duration = span_s(records)
    good = goodput(records, duration, summary["gpu_seconds"], case.ttft_target_s, case.itl_target_s)
    by_turn = goodput_by_turn(records, duration, summary["gpu_seconds"], case.ttft_target_s, case.itl_target_s)
    wall_s = time.perf_counter() - wall
    print(f"{case.label}: {wall_s:.0f} s wall, hits {summary['prefix_hit_rate']:.1%}, goodput "
          f"{good.requests_per_s:.3f}/s", file=sys.stderr, flush=True)
    return {"summary": summary, "goodput": good, "by_turn": by_turn, "wall_s": wall_s, "moved": moved_turns(records),
            "kv_tokens": shape.num_blocks * shape.tokens_per_block,
            "host_kv_tokens": shape.host_tier.num_blocks * shape.tokens_per_block if shape.host_tier else 0}


def moved_turns(records: list[RequestRecord]) -> tuple[int, int]:
    """Later turns served by another replica than their session's previous turn, and all later turns served."""
    served = sorted((r.session_id, r.turn, r.replica_id) for r in records
                    if r.session_id is not None and r.replica_id is not None and r.outcome == "finished")
    moved = later = 0
    for (session, _, replica), (previous_session, _, previous_replica) in zip(served[1:], served, strict=False):
        if session == previous_session:
            later += 1
            moved += replica != previous_replica
    return moved, later


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1, help="nodes of 8 B200 (default 1; 64: 512 GPUs)")
    parser.add_argument("--concurrency", type=int, default=256, help="closed-loop clients per node (default 256)")
    parser.add_argument("--requests-per-client", type=int, default=40,
                        help="requests per client (default 40: 1-2 agentic sessions each)")
    parser.add_argument("--host-kv", type=parse_host_kv, default=parse_host_kv("4x"),
                        help="the tier's host memory per node: a size or a multiple of the device KV (default 4x)")
    parser.add_argument("--dcp", default="1,8", help="the layouts' dcp, comma-separated (default 1,8)")
    parser.add_argument("--ttft-target-s", type=float, default=2.0)
    parser.add_argument("--itl-target-s", type=float, default=0.05)
    parser.add_argument("--admission-ttft-bound-s", type=float, default=PATIENT.admission_ttft_bound_s,
                        help="the admission queue's TTFT bound (item 4 of issue 51; 0: off; default "
                             f"{PATIENT.admission_ttft_bound_s:g}, dcpserve/simulator/run.py ServeSettings)")
    parser.add_argument("--tier", choices=("both", "off", "on"), default="both",
                        help="run each layout without the tier and with it (default), or only one of them")
    parser.add_argument("--no-prefix-hold", action="store_true",
                        help="the admission queue's prefix hold off (admission_prefix_hold: false): a request goes "
                             "to the first replica with room, not waiting for the one that caches its prompt")
    parser.add_argument("--jobs", type=int, default=2, help="simulations in parallel (default 2)")
    parser.add_argument("--progress-s", type=float, default=60.0,
                        help="a progress line per case on stderr every this many seconds of wall time (default 60; "
                             "0: none)")
    parser.add_argument("--write-docs", action="store_true", help="write the section of docs/benchmarks.md")
    args = parser.parse_args(argv)
    # One section per cluster size: a run at more nodes adds its own instead of replacing the one-node section.
    docs = DocsSection(SCRIPT if args.nodes == 1 else f"{SCRIPT} --nodes {args.nodes}")
    if args.write_docs:
        docs.check()
    requests = args.requests_per_client * args.concurrency * args.nodes
    tiers = {"both": (None, args.host_kv), "off": (None,), "on": (args.host_kv,)}[args.tier]
    cases = [Case(int(dcp), tier, args.nodes, args.concurrency, requests, args.ttft_target_s, args.itl_target_s,
                  args.admission_ttft_bound_s, not args.no_prefix_hold, args.progress_s)
             for dcp in args.dcp.split(",") for tier in tiers]
    with ProcessPoolExecutor(max_workers=args.jobs) as executor:
        results = dict(zip(cases, executor.map(run_case, cases), strict=True))
    section = format_section(results, args, sys.argv[1:] if argv is None else argv)
    print(section)
    if args.write_docs:
        docs.write(section)
    return 0


def _moved(moved: tuple[int, int]) -> str:
    count, later = moved
    return f"{count / later:.0%} of {later:,}" if later else "-"


def _pair(values: dict[str, float], fmt: str) -> str:
    return " / ".join(format(values[q], fmt) for q in ("p50", "p90"))


def format_section(results: dict[Case, dict[str, Any]], args: argparse.Namespace, argv: list[str]) -> str:
    gpus = args.nodes * GPUS_PER_NODE
    layouts = {case.label.split(",")[0]: result["kv_tokens"] for case, result in results.items()}  # tier or not
    kv = ", ".join(f"{layout} {tokens:,}" for layout, tokens in layouts.items()) or "-"
    lines = [f"## The host KV tier at {gpus} GPUs in the simulator (`{SCRIPT}`)", "",
             f"`{bench_command('simulate_tier', argv)}`. Kimi K2 (nvfp4 weights, fp8 KV, 256k context) on {gpus} x "
             f"B200, replicas of tp=8; the `agentic` preset closed loop at {args.concurrency} clients per node, "
             f"{next(iter(results)).requests:,} requests; host tier {args.host_kv} per node over PCIe Gen5 x16 "
             f"(51.2 GB/s per GPU each way). KV tokens per replica: {kv}. SLO: TTFT <= "
             f"{args.ttft_target_s:g} s and the request's mean ITL <= {args.itl_target_s * 1e3:g} ms. Admission TTFT "
             f"bound: {f'{args.admission_ttft_bound_s:g} s' if args.admission_ttft_bound_s else 'off'}; prefix hold: "
             f"{'off' if args.no_prefix_hold else 'on'}.", "",
             "| layout, tier | host KV tokens / replica | prefix hits (device + host) | later turns moved | goodput "
             "req/s | SLO met: first / later turns | TTFT p50 / p90 first turns | TTFT p50 / p90 later turns | "
             "ITL p50 | output tok/s/GPU | reloaded per rank (GB, s) | copy time past compute | wall |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for case, result in results.items():
        summary, good, by_turn = result["summary"], result["goodput"], result["by_turn"]
        tiers = summary["prefix_hit_rate_by_tier"]
        tier = summary["host_tier"]
        turns = summary["turns"]
        lines.append(
            f"| {case.label} | {result['host_kv_tokens']:,} | {summary['prefix_hit_rate']:.0%} "
            f"({tiers['device']:.0%} + {tiers['host']:.0%}) | {_moved(result['moved'])} | {good.requests_per_s:.3f} | "
            f"{by_turn['first'].fraction_met:.0%} / {by_turn['later'].fraction_met:.0%} | "
            f"{_pair(turns['first']['ttft_s'], '.2f')} s | {_pair(turns['later']['ttft_s'], '.2f')} s | "
            f"{summary['itl_s']['p50'] * 1e3:.0f} ms | {summary['output_tokens_per_s_per_gpu']:.0f} | "
            + (f"{tier['loaded_bytes_per_rank'] / 1e9:,.0f}, {tier['load_seconds']:.0f} s | "
               f"{tier['exposed_copy_seconds']:.1f} s |" if tier else "- | - |")
            + f" {result['wall_s']:.0f} s |")
    lines += [""] + targets(results)
    return "\n".join(lines)


def targets(results: dict[Case, dict[str, Any]]) -> list[str]:
    """Issue 51's simulator targets, each with its numbers."""
    by = {(case.dcp, case.host_kv is not None): result for case, result in results.items()}
    lines = []
    if (1, False) in by and (1, True) in by:
        without, with_tier = (by[1, tier]["summary"]["prefix_hit_rate"] for tier in (False, True))
        lines.append(f"- TP8's prefix hits: {without:.0%} without the tier, {with_tier:.0%} with it (target: at "
                     f"least 60%): {'met' if with_tier >= 0.6 else 'not met'}.")
    best: dict[bool, tuple[int, float]] = {}
    for (dcp, tier), result in by.items():
        rate = result["goodput"].requests_per_s
        if tier not in best or rate > best[tier][1]:
            best[tier] = (dcp, rate)
    if len(best) == 2:
        ratio = best[True][1] / best[False][1] if best[False][1] else float("inf")
        lines.append(f"- Best layout's goodput: dcp={best[False][0]} {best[False][1]:.3f} req/s without the tier, "
                     f"dcp={best[True][0]} {best[True][1]:.3f} with it, {ratio:.2f}x (target: at least 1.3x): "
                     f"{'met' if ratio >= 1.3 else 'not met'}.")
    return lines


if __name__ == "__main__":
    sys.exit(main())

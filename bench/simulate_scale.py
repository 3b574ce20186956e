"""How dcpserve simulate's cost grows with the cluster: wall time per simulated request from 1 to 64 nodes.

Each run is N nodes of 8 x B200, one Kimi K2 replica of tp=8 dcp=8 per node (nvfp4 weights, fp8 KV, 256k context),
replaying the `agentic` preset open loop with its session rate scaled by N, so every node sees the same load; the
requests grow with N too (REQUESTS_PER_NODE each). The simulator should cost about the same per request at any size:
the admission queue's choice looks at every replica, everything else is per replica.

    python -m bench simulate_scale                 # 1, 4, 16 and 64 nodes (64: 100,000 requests)
    python -m bench simulate_scale --nodes 1 4     # some sizes
    python -m bench simulate_scale --write-docs    # also writes its section of docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import sys
import time

from bench.harness.docs_section import DocsSection
from dcpserve.cluster.published_models import model_spec
from dcpserve.engine.config import SchedulerConfig
from dcpserve.simulator.gpus import gpu_spec
from dcpserve.simulator.replica import ReplicaShape
from dcpserve.simulator.run import ServeSettings, Simulation, SimulationConfig
from dcpserve.simulator.step_time import RooflineModel
from dcpserve.simulator.synth import PRESETS, generate

SCRIPT = "bench/simulate_scale.py"
REQUESTS_PER_NODE = 1563  # 100,032 requests at 64 nodes


def run(nodes: int) -> tuple[int, float, float, dict[str, object]]:
    """(requests, wall seconds, simulated seconds, summary) of one size."""
    step_model = RooflineModel(model_spec("kimi-k2"), gpu_spec("b200"), 8, 8, weight_dtype="nvfp4",
                               kv_dtype="float8")
    scheduler = SchedulerConfig(max_model_len=262144, max_num_seqs=1024, max_num_batched_tokens=8192)
    shape = ReplicaShape(tp=8, dcp=8, num_blocks=step_model.kv_blocks_per_replica(64), block_size=64,
                         scheduler=scheduler)
    config = SimulationConfig(shape=shape, num_replicas=nodes, progress=sys.stderr, progress_wall_s=30.0,
                              serve=ServeSettings(max_queued_requests=100_000, queue_timeout_s=600.0))
    agentic = PRESETS["agentic"]
    trace = generate(dataclasses.replace(agentic, rate_per_s=agentic.rate_per_s * nodes), REQUESTS_PER_NODE * nodes,
                     seed=0)
    wall = time.perf_counter()
    summary = Simulation(config, step_model).run(trace)
    return len(trace), time.perf_counter() - wall, float(summary["duration_s"]), summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 4, 16, 64], help="cluster sizes")
    parser.add_argument("--write-docs", action="store_true", help="write the section of docs/benchmarks.md")
    args = parser.parse_args(argv)
    docs = DocsSection(SCRIPT)
    if args.write_docs:
        docs.check()
    lines = ["## dcpserve simulate's cost by cluster size (`bench/simulate_scale.py`)", "",
             "Kimi K2 tp=8 dcp=8 on 8 x B200 per node, the `agentic` preset open loop at 0.1 sessions/s per node, "
             f"{REQUESTS_PER_NODE:,} requests per node; one process on this machine's CPU.", "",
             "| nodes | GPUs | requests | simulated s | wall s | us per request | finished | output tok/s/GPU | "
             "peak sequences | max RSS |", "|---|---|---|---|---|---|---|---|---|---|"]
    for nodes in args.nodes:
        requests, wall, simulated, summary = run(nodes)
        rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)
        lines.append(f"| {nodes} | {nodes * 8} | {requests:,} | {simulated:,.0f} | {wall:,.0f} | "
                     f"{wall / requests * 1e6:,.0f} | {summary['finished']:,} | "
                     f"{summary['output_tokens_per_s_per_gpu']:.0f} | {summary['peak_concurrent_sequences']} | "
                     f"{rss_gib:.1f} GiB |")
        print(lines[-1], file=sys.stderr, flush=True)
    section = "\n".join(lines)
    print(section)
    if args.write_docs:
        docs.write(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())

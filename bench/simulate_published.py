"""dcpserve simulate against published DCP results: the direction and size of each published effect, side by side.

Two published comparisons of plain TP against TP + DCP on one 8-GPU node, rerun in the simulator with the roofline
step model (dcpserve/simulator/step_time.py) and the app's own control plane:

- vLLM's DCP blog post (2026-07-27): Kimi K2.6 NVFP4 on 8 x B200, an agentic trace (median ~67k input, ~400
  output tokens). TP8 fills its KV at concurrency 64 and flattens at ~1,863 output tok/s per GPU; TP8 + DCP8 reaches
  ~6,091 at concurrency 512: ~3.3x at saturation. Here: the `agentic` preset, Kimi K2's config (the K2.6 shape) with
  nvfp4 weights and fp8 KV at 256k context, closed loop at each concurrency, each layout's best steady throughput.
- ROCm ATOM PR #847: DeepSeek (MLA) TP8 vs TP8 + DCP8 at fixed lengths: DCP -22% at 1k in / 1k out, +15% at 8k / 1k,
  +68% at 8k / 8k; median ITL 52 -> 69 ms. ATOM ran on AMD Instinct GPUs, which the simulator has no spec for: here
  8 x H200 (the closest memory size it has), DeepSeek-V3's config with fp8 weights and bf16 KV, closed loop at one
  concurrency. Only the direction of each effect is comparable, not its size.

    python -m bench simulate_published                 # everything (tens of minutes on 2 cores)
    python -m bench simulate_published --quick         # fewer requests and concurrencies
    python -m bench simulate_published --write-docs    # also writes its section of docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from bench.harness.docs_section import DocsSection
from dcpserve.cluster.published_models import model_spec
from dcpserve.engine.config import SchedulerConfig
from dcpserve.simulator.gpus import gpu_spec
from dcpserve.simulator.replica import ReplicaShape
from dcpserve.simulator.run import ServeSettings, Simulation, SimulationConfig
from dcpserve.simulator.step_time import RooflineModel
from dcpserve.simulator.synth import PRESETS, generate

SCRIPT = "bench/simulate_published.py"
# Queue bound and timeout past anything a run reaches: the published runs queue requests in the engine, unbounded.
PATIENT = ServeSettings(max_queued_requests=100_000, queue_timeout_s=1e9, request_timeout_s=1e9)


@dataclass(frozen=True)
class Case:
    """One simulated run: a model on a GPU at a layout, a trace preset at a closed-loop concurrency."""

    model: str
    gpu: str
    dcp: int
    preset: str
    concurrency: int
    requests: int
    weight_dtype: str
    kv_dtype: str
    max_model_len: int
    block_size: int = 64  # vLLM's MLA backends page in 64-token blocks


def run_case(case: Case) -> dict[str, Any]:
    spec = model_spec(case.model)
    step_model = RooflineModel(spec, gpu_spec(case.gpu), 8, case.dcp, weight_dtype=case.weight_dtype,
                               kv_dtype=case.kv_dtype)
    scheduler = SchedulerConfig(max_model_len=case.max_model_len, max_num_seqs=1024, max_num_batched_tokens=8192)
    shape = ReplicaShape(tp=8, dcp=case.dcp, num_blocks=step_model.kv_blocks_per_replica(case.block_size),
                         block_size=case.block_size, scheduler=scheduler)
    config = SimulationConfig(shape=shape, num_replicas=1, serve=PATIENT, concurrency=case.concurrency)
    trace = generate(PRESETS[case.preset], case.requests, seed=0)
    wall = time.perf_counter()
    summary = Simulation(config, step_model).run(trace)
    summary["wall_s"] = time.perf_counter() - wall
    summary["kv_tokens"] = shape.num_blocks * shape.tokens_per_block
    return summary


def steady_tps(summary: dict[str, Any]) -> float:
    steady = summary["steady"]
    return float(steady["output_tokens_per_s_per_gpu"]) if steady else float(summary["output_tokens_per_s_per_gpu"])


# Each layout's saturation point lies somewhere in this range; a sweep by doubling can step over it.
AGENTIC_CONCURRENCIES = (32, 64, 96, 128, 192, 256, 384, 512)


def agentic_cases(quick: bool) -> list[Case]:
    concurrencies = (32, 128) if quick else AGENTIC_CONCURRENCIES
    per_client = 30 if quick else 40  # requests per client: 1-2 sessions of the agentic preset each
    return [Case("kimi-k2", "b200", dcp, "agentic", c, per_client * c, "nvfp4", "float8", 262144)
            for dcp in (1, 8) for c in concurrencies]


def fixed_cases(quick: bool) -> list[Case]:
    concurrency = 128
    requests = 2 * concurrency if quick else 4 * concurrency
    return [Case("deepseek-v3", "h200", dcp, preset, concurrency, requests, "float8", "bfloat16", 32768)
            for preset in ("1k-1k", "8k-1k", "8k-8k") for dcp in (1, 8)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer requests and concurrencies")
    parser.add_argument("--jobs", type=int, default=2, help="simulations in parallel (default 2)")
    parser.add_argument("--write-docs", action="store_true", help="write the section of docs/benchmarks.md")
    args = parser.parse_args(argv)
    docs = DocsSection(SCRIPT)
    if args.write_docs:
        docs.check()
    cases = agentic_cases(args.quick) + fixed_cases(args.quick)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = dict(zip(cases, pool.map(run_case, cases), strict=True))
    for case, summary in results.items():
        print(f"{case.model} {case.preset} dcp={case.dcp} c={case.concurrency}: {steady_tps(summary):.1f} tok/s/GPU "
              f"steady, ITL p50 {summary['itl_s']['p50'] * 1e3:.1f} ms, mean seqs "
              f"{summary['mean_concurrent_sequences']:.1f}, prefix hits {summary['prefix_hit_rate']:.1%}, wall "
              f"{summary['wall_s']:.0f} s", file=sys.stderr)
    section = format_section(results, args.quick)
    print(section)
    if args.write_docs:
        docs.write(section)
    return 0


def format_section(results: dict[Case, dict[str, Any]], quick: bool) -> str:
    lines = ["## dcpserve simulate against published DCP results (`bench/simulate_published.py`"
             f"{' --quick' if quick else ''})", ""]
    agentic = {case: s for case, s in results.items() if case.preset == "agentic"}
    lines += ["Kimi K2 (nvfp4 weights, fp8 KV, 256k context) on 8 x B200, the `agentic` preset, closed loop; output "
              "tok/s per GPU over the steady window (every client had work):", "",
              "| concurrency | TP8 tok/s/GPU | TP8 + DCP8 tok/s/GPU | DCP / TP | TP8 ITL p50 | DCP8 ITL p50 | TP8 "
              "prefix hits | DCP8 prefix hits |", "|---|---|---|---|---|---|---|---|"]
    for concurrency in sorted({case.concurrency for case in agentic}):
        tp, dcp = (next(s for c, s in agentic.items() if c.concurrency == concurrency and c.dcp == d) for d in (1, 8))
        lines.append(f"| {concurrency} | {steady_tps(tp):.0f} | {steady_tps(dcp):.0f} | "
                     f"{steady_tps(dcp) / steady_tps(tp):.2f}x | {tp['itl_s']['p50'] * 1e3:.1f} ms | "
                     f"{dcp['itl_s']['p50'] * 1e3:.1f} ms | {tp['prefix_hit_rate']:.0%} | "
                     f"{dcp['prefix_hit_rate']:.0%} |")
    tp_at, best_tp = max(((c.concurrency, steady_tps(s)) for c, s in agentic.items() if c.dcp == 1),
                         key=lambda item: item[1])
    dcp_at, best_dcp = max(((c.concurrency, steady_tps(s)) for c, s in agentic.items() if c.dcp == 8),
                           key=lambda item: item[1])
    lines += ["", f"At saturation (each layout's best): TP8 {best_tp:.0f} tok/s/GPU at {tp_at} clients, TP8 + DCP8 "
              f"{best_dcp:.0f} at {dcp_at}, {best_dcp / best_tp:.2f}x; published ~1,863 at 64 and ~6,091 at 512, "
              "~3.3x.", ""]
    fixed = {case: s for case, s in results.items() if case.preset != "agentic"}
    published = {"1k-1k": "-22%", "8k-1k": "+15%", "8k-8k": "+68%"}
    lines += ["DeepSeek-V3 (fp8 weights, bf16 KV) on 8 x H200, fixed lengths, closed loop at concurrency "
              f"{next(iter(fixed)).concurrency}:", "",
              "| in / out | TP8 tok/s/GPU | TP8 + DCP8 tok/s/GPU | DCP vs TP | published (ATOM #847) | TP8 ITL p50 | "
              "DCP8 ITL p50 |", "|---|---|---|---|---|---|---|"]
    for preset in published:
        tp, dcp = (next(s for c, s in fixed.items() if c.preset == preset and c.dcp == d) for d in (1, 8))
        change = steady_tps(dcp) / steady_tps(tp) - 1
        lines.append(f"| {preset} | {steady_tps(tp):.0f} | {steady_tps(dcp):.0f} | {change:+.0%} | "
                     f"{published[preset]} | {tp['itl_s']['p50'] * 1e3:.1f} ms | {dcp['itl_s']['p50'] * 1e3:.1f} ms |")
    lines += ["", "Published ITL: 52 ms (TP8) -> 69 ms (TP8 + DCP8). ATOM ran on AMD Instinct GPUs: only the direction "
              "of each effect compares."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

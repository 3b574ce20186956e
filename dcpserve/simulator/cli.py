"""`dcpserve simulate`: replay a trace through the app's real control plane on simulated GPUs.

    dcpserve simulate --trace agentic|chat|1k-1k|8k-1k|8k-8k|FILE.jsonl --model kimi-k2|DIR|CONFIG_JSON --gpu b200 \\
        --nodes 1 --gpus-per-node 8 --layout tp=8,dcp=8 [--concurrency 512] [--requests 2000] [--seed 0] \\
        [--admission usage|full] [--autoscale --replicas 8 ...] [--step-model roofline|FIT.json] [--out DIR] \\
        [--sweep layouts | --sweep concurrency=64,128,256]
    dcpserve simulate ... --nodes 2 --gpus-per-node 8 --pool short:tp=8,dcp=1,replicas=1 \\
        --pool long:tp=8,dcp=8,replicas=1 [--autoscale --gpu-budget 16]

A `--pool` (repeatable) makes the app one of layout pools behind the one admission queue
(dcpserve/deployments/admission/pools.py): each pool its own layout and replicas, its KV pool and roofline step time its
layout's (a fitted --step-model is every pool's), and with --autoscale its own autoscaling (max_replicas = its replicas)
within --gpu-budget.

Progress goes to stderr, the result table to stdout, and with --out the summary.json (docs/simulate.md lists
its keys) and the plots: timeline.png, and a sweep's sweep.png. Bad input stops the run before anything is
simulated: a trace line that is not valid JSON or misses a field (its line number), a layout the model cannot take
(the planner's error), weights that do not fit the GPU (with the numbers).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dcpserve.cluster.planner import PlanRequest, plan_layouts
from dcpserve.cluster.published_models import PUBLISHED, model_spec
from dcpserve.deployments.config import AppArgs, AutoscalingArgs
from dcpserve.engine.args import cli_type
from dcpserve.simulator.build import SLO_OPTIONS, build, parse_pool
from dcpserve.simulator.gpus import GPUS, gpu_spec
from dcpserve.simulator.host_tier import parse_host_kv
from dcpserve.simulator.plots import Sample, SweepPoint, write_concurrency_sweep, write_layout_sweep, write_timeline
from dcpserve.simulator.run import ServeSettings, Simulation
from dcpserve.simulator.step_time import KV_DTYPES, WEIGHT_DTYPES
from dcpserve.simulator.synth import PRESETS, parse_preset_or_path
from dcpserve.simulator.trace import MOONCAKE_BLOCK_TOKENS, TraceError, TraceRequest

# The scheduler limits a simulated GPU replica runs with by default: vLLM's defaults for its OpenAI server on GPUs
# with 70 GiB or more (vllm/engine/arg_utils.py: max_num_seqs 1024, max_num_batched_tokens 8192).
DEFAULT_MAX_NUM_SEQS = 1024
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
# summary.json's "samples": the names of the fields of the Recorder's sample tuples (dcpserve/simulator/metrics.py), in
# order.
SAMPLE_KEYS = ("t_s", "replicas", "kv_utilization", "sequences", "queued")


def parse_layout(value: str) -> tuple[int, int]:
    """"tp=8,dcp=4" (or "tp=8": dcp 1) -> (8, 4)."""
    fields: dict[str, int] = {}
    for part in value.split(","):
        name, _, number = part.partition("=")
        name = name.strip()
        if name not in ("tp", "dcp") or not number.strip().isdigit() or name in fields:
            raise ValueError(f"layout {value!r}: write it as tp=T,dcp=D (for example tp=8,dcp=8)")
        fields[name] = int(number)
    if "tp" not in fields:
        raise ValueError(f"layout {value!r} names no tp: write it as tp=T,dcp=D (for example tp=8,dcp=8)")
    return fields["tp"], fields.get("dcp", 1)


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"must be a whole number >= 1, got {text}")
    return int(text)


def parse_sweep(value: str) -> tuple[str, list[int]]:
    """"layouts" -> ("layouts", []); "concurrency=64,128,256" -> ("concurrency", [64, 128, 256])."""
    if value == "layouts":
        return "layouts", []
    name, _, numbers = value.partition("=")
    if name == "concurrency" and numbers:
        parts = numbers.split(",")
        if all(part.strip().isdigit() and int(part) > 0 for part in parts):
            return "concurrency", [int(part) for part in parts]
    raise ValueError(f"sweep {value!r}: write `layouts` or `concurrency=64,128,256`")


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds simulate to the dcpserve command line."""
    sim = commands.add_parser(
        "simulate", help="replay a trace through the real admission queue, scheduler and autoscaler on simulated GPUs",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sim.add_argument("--trace", required=True,
                     help=f"a Mooncake JSONL trace file, or a generated preset: {', '.join(PRESETS)}")
    sim.add_argument("--trace-block-size", type=cli_type(_positive_int), default=MOONCAKE_BLOCK_TOKENS,
                     metavar="TOKENS",
                     help=f"tokens per hash id of a trace file (default {MOONCAKE_BLOCK_TOKENS}, Mooncake's; AIPerf's "
                          "converters and AgentX write 64)")
    sim.add_argument("--requests", type=int, default=1000, help="requests a preset generates (default 1000)")
    sim.add_argument("--rate", type=float, default=None,
                     help="sessions per second a preset's clients start (default: the preset's rate)")
    sim.add_argument("--seed", type=int, default=0, help="the preset's seed; the same seed, the same summary")
    sim.add_argument("--model", required=True,
                     help=f"a published config ({', '.join(PUBLISHED)}) or a model directory or config.json "
                          "(any config.json vLLM serves: GQA, MLA, MoE, sliding-window and hybrid layers)")
    sim.add_argument("--gpu", default="h200", choices=sorted(GPUS), help="simulated GPU (default h200)")
    sim.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    sim.add_argument("--gpus-per-node", type=int, default=8, help="GPUs in one node (default 8)")
    sim.add_argument("--layout", type=cli_type(parse_layout), default=None,
                     help="one replica's layout, tp=T,dcp=D (default tp=--gpus-per-node,dcp=1)")
    sim.add_argument("--replicas", type=int, default=None,
                     help="replicas (default: as many as the GPUs hold; with --autoscale, the most it may reach)")
    sim.add_argument("--pool", type=cli_type(parse_pool), action="append", default=None, metavar="NAME:tp=T,dcp=D",
                     help="a layout pool, repeated for each pool: NAME:tp=T,dcp=D[,replicas=N] (replicas default 1; "
                          "with --autoscale, the most the pool may reach); one app of several layouts behind one "
                          "admission queue, instead of --layout and --replicas")
    sim.add_argument("--concurrency", type=int, default=None,
                     help="closed loop: this many clients, each sending its next session when the last one ended "
                          "(default: open loop at the trace's timestamps)")
    engine = sim.add_argument_group("engine (each replica; EngineArgs' names)")
    engine.add_argument("--admission", default="usage", choices=("usage", "full"), help="KV admission (default usage)")
    engine.add_argument("--weight-dtype", default="auto", choices=WEIGHT_DTYPES,
                        help="weights: auto (default) as the checkpoint ships them (its quantization_config; "
                             "unquantized: bfloat16), or every parameter in one dtype")
    engine.add_argument("--kv-dtype", default="bfloat16", choices=KV_DTYPES, help="KV cache (default bfloat16)")
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV page on a rank (default 16)")
    engine.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS,
                        help=f"sequences per step (default {DEFAULT_MAX_NUM_SEQS}, vLLM's on large GPUs)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                        help=f"tokens per step (default {DEFAULT_MAX_NUM_BATCHED_TOKENS}, vLLM's on large GPUs)")
    engine.add_argument("--max-model-len", type=int, default=None,
                        help="longest sequence (default: the model's max_position_embeddings)")
    engine.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    engine.add_argument("--host-kv-per-node", type=cli_type(parse_host_kv), default=None, metavar="SIZE|Nx",
                        help="a host-memory KV tier under each replica's prefix cache: the node's host memory for it "
                             "(2TiB, 1.5TB, bytes), each GPU's share for its own pages, or a multiple of the device "
                             "KV (4x); default none")
    engine.add_argument("--host-link-gbps", type=float, default=None, metavar="GB/S",
                        help="each GPU's host link per direction in GB/s (default: the GPU's, PCIe Gen5 x16 64; "
                             "GB200's NVLink-C2C: 225); copies reach 80%% of it")
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="fraction of GPU memory for weights + KV (default 0.9)")
    engine.add_argument("--step-model", default="roofline",
                        help="roofline (from the GPU and model specs), or a fitted model's JSON file")
    serve = sim.add_argument_group("app (AppArgs' names and defaults)")
    defaults = ServeSettings()
    serve.add_argument("--max-queued-requests", type=int, default=defaults.max_queued_requests,
                       help=f"admission queue bound (default {defaults.max_queued_requests})")
    serve.add_argument("--queue-timeout-s", type=float, default=defaults.queue_timeout_s,
                       help=f"longest wait in the queue (default {defaults.queue_timeout_s:g})")
    serve.add_argument("--no-prefix-routing", action="store_true", help="grant by free KV alone")
    serve.add_argument("--admission-ttft-bound-s", type=float, default=defaults.admission_ttft_bound_s,
                       help="the app's admission_ttft_bound_s: a replica whose queued prefill would start a request "
                            "past it does not get the request while another, or a short wait, serves it sooner (0: "
                            f"off; default {AppArgs.model_fields['admission_ttft_bound_s'].default:g} s, the app's)")
    serve.add_argument("--no-admission-prefix-hold", action="store_true",
                       help="the app's admission_prefix_hold off: a request goes to the first replica with room, not "
                            "waiting for the one that caches more of its prompt")
    serve.add_argument("--request-latency-s", type=float, default=0.0,
                       help="from a request's arrival to its admission: HTTP, the ingress, the hop to the queue "
                            "(default 0)")
    scaling = sim.add_argument_group("autoscaling (AutoscalingArgs' names and defaults)")
    scaling.add_argument("--autoscale", action="store_true", help="run the app's autoscaling policy")
    scaling_defaults = AutoscalingArgs()
    scaling.add_argument("--min-replicas", type=int, default=scaling_defaults.min_replicas)
    scaling.add_argument("--target-sequences-per-replica", type=float,
                         default=scaling_defaults.target_sequences_per_replica)
    scaling.add_argument("--upscale-delay-s", type=float, default=scaling_defaults.upscale_delay_s)
    scaling.add_argument("--downscale-delay-s", type=float, default=scaling_defaults.downscale_delay_s)
    scaling.add_argument("--replica-start-s", type=float, default=60.0,
                         help="from the decision to a new replica taking requests (default 60)")
    # Service levels (SloAutoscalingPolicy): the rest below apply only with one of the two targets.
    for name in SLO_OPTIONS:
        field = AutoscalingArgs.model_fields[name]
        default = "none" if field.default is None else f"{field.default:g}"
        scaling.add_argument(f"--{name.replace('_', '-')}", type=float, default=None,
                             help=f"{field.description} (default {default})")
    scaling.add_argument("--gpu-budget", type=cli_type(_positive_int), default=None, metavar="GPUS",
                         help="GPUs the app's replicas may hold together (AppArgs' gpu_budget): the pools' "
                              "autoscaling shares it; at most the nodes' GPUs (default: none)")
    sim.add_argument("--sweep", type=cli_type(parse_sweep), default=None,
                     help="`layouts`: every valid tp x dcp of one node's GPUs (as many replicas as the GPUs hold); "
                          "`concurrency=64,128,256`: closed loop at each. Prints a row per point and marks the "
                          "frontier (no other point has more tok/s per GPU and a lower ITL p50)")
    sim.add_argument("--out", default=None,
                     help="a directory for summary.json and timeline.png (a sweep: those per point, sweep.json and "
                          "sweep.png)")
    sim.add_argument("--quiet", action="store_true", help="no progress on stderr")
    sim.set_defaults(func=_cmd_simulate)


def _setup_rows(facts: dict[str, Any]) -> list[tuple[str, str]]:
    """The table's rows of the setup: the layout and replicas, or a row per pool."""
    rows = [("model", facts["model"]), ("GPU", f"{facts['gpu']} x {facts['gpus']}")]
    if "pools" in facts:
        for pool in facts["pools"]:
            replicas = (f"{pool['min_replicas']}-{pool['replicas']} replicas, autoscaled" if "min_replicas" in pool
                        else f"{pool['replicas']} replica{'' if pool['replicas'] == 1 else 's'}")
            rows.append((f"pool {pool['name']}",
                         f"{pool['layout']}, {replicas}, {pool['kv_tokens_per_replica']:,} KV tokens per replica"))
    else:
        rows += [("layout", facts["layout"]), ("replicas", str(facts["replicas"])),
                 ("KV tokens per replica", f"{facts['kv_tokens_per_replica']:,}")]
        if "host_kv_tokens_per_replica" in facts:
            rows.append(("host KV tokens per replica", f"{facts['host_kv_tokens_per_replica']:,} (copies at "
                                                       f"{facts['host_link_gbps']:.1f} GB/s per GPU each way)"))
    if "gpu_budget" in facts:
        rows.append(("GPU budget", str(facts["gpu_budget"])))
    return [*rows, ("step model", facts["step_model"])]


def _tier_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The host KV tier's rows: copies each way per rank and their time, what they added to steps, its drops."""
    tier = summary.get("host_tier")
    if not tier:
        return []
    return [("host tier loads / offloads", f"{tier['loaded_bytes_per_rank'] / 1e9:,.1f} / "
                                           f"{tier['offloaded_bytes_per_rank'] / 1e9:,.1f} GB per rank, "
                                           f"{tier['load_seconds']:.1f} / {tier['offload_seconds']:.1f} s"),
            ("host tier: copy time past compute", f"{tier['exposed_copy_seconds']:.2f} s; "
                                                  f"{tier['host_evictions']} blocks dropped")]


def format_summary(summary: dict[str, Any], facts: dict[str, Any]) -> str:
    rows = [
        *_setup_rows(facts),
        ("requests (finished)", f"{summary['requests']} ({summary['finished']})"),
        ("simulated time", f"{summary['duration_s']:.1f} s"),
        ("output tok/s per GPU", f"{summary['output_tokens_per_s_per_gpu']:.1f}"),
        ("  while every client had work", f"{summary['steady']['output_tokens_per_s_per_gpu']:.1f} over "
         f"{summary['steady']['window_s']:.1f} s, {summary['steady']['mean_concurrent_sequences']:.1f} sequences"
         if summary["steady"] else "-"),
        ("requests/s", f"{summary['requests_per_s']:.3f}"),
        ("TTFT p50 / p90 / p99", " / ".join(f"{summary['ttft_s'][q]:.3f} s" for q in ("p50", "p90", "p99"))),
        ("ITL p50 / p90 / p99", " / ".join(f"{summary['itl_s'][q] * 1000:.1f} ms" for q in ("p50", "p90", "p99"))),
        ("concurrent sequences mean / peak",
         f"{summary['mean_concurrent_sequences']:.1f} / {summary['peak_concurrent_sequences']}"),
        ("KV utilization mean", f"{summary['kv_utilization_mean']:.1%}"),
        ("prefix hit rate", f"{summary['prefix_hit_rate']:.1%}"
         + (" (device {device:.1%}, host {host:.1%})".format(**summary["prefix_hit_rate_by_tier"])
            if summary.get("host_tier") else "")),
        *_tier_rows(summary),
        *(("TTFT p50 / p90, " + name + " turns", f"{part['ttft_s']['p50']:.3f} / {part['ttft_s']['p90']:.3f} s "
           f"({part['finished']} of {part['requests']} finished)")
          for name, part in summary["turns"].items() if part["requests"]),
        ("preemptions", str(summary["preemptions"])),
        ("refused", ", ".join(f"{k} {v}" for k, v in summary["refused"].items()) or "none"),
    ]
    if "pools" in facts:  # each grant's pool and the queue's reason for it (dcpserve/deployments/admission/pools.py)
        rows.append(("grants by pool/reason", ", ".join(f"{k} {v}" for k, v in summary["pool_grants"].items())
                     or "none"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def sweep_points(args: argparse.Namespace) -> list[tuple[str, argparse.Namespace]]:
    """The runs of a sweep: (label, the arguments of that run)."""
    kind, values = args.sweep
    if kind == "layouts" and args.pool:
        raise ValueError("--sweep layouts runs one layout at a time, --pool several at once: drop one of them "
                         "(dcpserve plan --trace --gpu-budget ranks layouts and two-pool splits together)")
    if kind == "concurrency":
        return [(f"concurrency {value}", argparse.Namespace(**{**vars(args), "concurrency": value}))
                for value in values]
    # The planner's enumeration of the layouts the model's rules accept on one node (dtypes do not change which).
    request = PlanRequest(gpus_per_node=args.gpus_per_node, gpu_memory_bytes=gpu_spec(args.gpu).memory_bytes,
                          context_len=1, block_size=args.block_size)
    return [(f"tp={row.tp} dcp={row.dcp}",
             argparse.Namespace(**{**vars(args), "layout": (row.tp, row.dcp), "replicas": None}))
            for row in plan_layouts(model_spec(args.model), request)]


def frontier(results: list[tuple[str, dict[str, Any]]]) -> set[str]:
    """The points no other point beats on both steady tok/s per GPU (more) and ITL p50 (less)."""
    scores = {label: (throughput(summary), summary["itl_s"]["p50"]) for label, summary in results}
    return {label for label, (tps, itl) in scores.items()
            if not any(other_tps >= tps and other_itl <= itl and (other_tps, other_itl) != (tps, itl)
                       for other_tps, other_itl in scores.values())}


def throughput(summary: dict[str, Any]) -> float:
    """Output tok/s per GPU while every client had work (the whole run's when there was no such window)."""
    steady = summary["steady"]
    return float(steady["output_tokens_per_s_per_gpu"] if steady else summary["output_tokens_per_s_per_gpu"])


def _simulate(simulation: Simulation, trace: list[TraceRequest], facts: dict[str, Any]) -> dict[str, Any]:
    """Runs the simulation: its summary, with the setup and the timeline's samples."""
    summary = simulation.run(trace)
    summary["setup"] = facts
    summary["samples"] = [dict(zip(SAMPLE_KEYS, sample, strict=True)) for sample in simulation.recorder.samples]
    return summary


def _write_run(out: Path, summary: dict[str, Any], samples: list[Sample], label: str | None = None) -> list[Path]:
    """A run's summary.json and timeline.png in `out`: the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    write_timeline(out / "timeline.png", samples, summary["setup"], label)
    return [out / "summary.json", out / "timeline.png"]


def _run_sweep(args: argparse.Namespace, trace: list[TraceRequest]) -> int:
    kind, _ = args.sweep
    results: list[tuple[str, dict[str, Any]]] = []
    concurrency: dict[str, int | None] = {}
    skipped: list[tuple[str, str]] = []
    out = Path(args.out) if args.out else None
    for label, point in sweep_points(args):
        try:
            simulation, facts = build(point)
        except ValueError as err:  # weights past the GPU, no replica fits: a row that says why
            skipped.append((label, str(err)))
            continue
        if not args.quiet:
            print(f"sweep: {label}", file=sys.stderr, flush=True)
        summary = _simulate(simulation, trace, facts)
        results.append((label, summary))
        concurrency[label] = point.concurrency
        if out is not None:
            _write_run(out / label.replace("=", "").replace(" ", "_"), summary, simulation.recorder.samples, label)
    best = frontier(results)
    lines = ["point              tok/s/GPU  requests/s  TTFT p50  ITL p50   mean seqs  KV used  refused  frontier"]
    for label, summary in results:
        lines.append(f"{label:<18} {throughput(summary):>9.1f} {summary['requests_per_s']:>11.3f} "
                     f"{summary['ttft_s']['p50']:>8.3f}s {summary['itl_s']['p50'] * 1e3:>7.1f}ms "
                     f"{summary['mean_concurrent_sequences']:>10.1f} {summary['kv_utilization_mean']:>7.1%} "
                     f"{sum(summary['refused'].values()):>8} {'*' if label in best else ''}")
    lines += [f"{label:<18} skipped: {why}" for label, why in skipped]
    print("\n".join(lines))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        sweep = {"points": [{"point": label, "frontier": label in best, "output_tokens_per_s_per_gpu":
                             throughput(summary), "itl_p50_s": summary["itl_s"]["p50"],
                             "ttft_p50_s": summary["ttft_s"]["p50"]} for label, summary in results],
                 "skipped": [{"point": label, "why": why} for label, why in skipped]}
        (out / "sweep.json").write_text(json.dumps(sweep, indent=2, sort_keys=True) + "\n")
        print(f"wrote {out / 'sweep.json'}", file=sys.stderr)
        if results:  # every point skipped: nothing to plot
            points = [SweepPoint(label, throughput(summary), summary["itl_s"]["p50"], label in best,
                                 concurrency[label]) for label, summary in results]
            write_plot = write_concurrency_sweep if kind == "concurrency" else write_layout_sweep
            write_plot(out / "sweep.png", points, results[0][1]["setup"])
            print(f"wrote {out / 'sweep.png'}", file=sys.stderr)
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    try:
        trace = parse_preset_or_path(args.trace, args.requests, args.seed, args.rate, args.trace_block_size)
        if args.sweep:
            return _run_sweep(args, trace)
        simulation, facts = build(args)
    except (TraceError, ValueError) as err:
        raise SystemExit(f"dcpserve simulate: {err}") from None
    summary = _simulate(simulation, trace, facts)
    print(format_summary(summary, facts))
    if args.out:
        for path in _write_run(Path(args.out), summary, simulation.recorder.samples):
            print(f"wrote {path}", file=sys.stderr)
    return 0

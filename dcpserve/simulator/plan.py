"""`dcpserve plan --trace`: the planner's capacity table, then the same layouts ranked by simulated goodput.

    dcpserve plan --model llama-3.1-70b --gpus-per-node 8 --context 128k --trace chat|FILE.jsonl --gpu h200 \\
        [--requests 500] [--concurrency 64 | --rate 2] [--seed 0] [--ttft-target-s 2] [--itl-target-s 0.05] \\
        [--step-model roofline|FIT.json] [--gpu-budget 16]

Every layout of `plan_layouts` (the rows of the capacity table) replays the trace through `dcpserve simulate`'s
own simulation (dcpserve/simulator/build.py `build`), with as many replicas as one node's GPUs hold. Goodput is the
requests that finished with TTFT <= --ttft-target-s and their own mean inter-token latency <= --itl-target-s
(dcpserve/simulator/metrics.py `goodput`), per second and per GPU-second; layouts rank by goodput per GPU.

What the table and the simulation share, so that they describe the same replicas: the GPU's memory (--gpu's, which
--gpu-memory may only repeat), --gpu-memory-utilization, the dtypes, --block-size, and --context as the engine's
max_model_len. A request of the trace longer than --context (prompt + max_tokens) is refused, as the app refuses it
(`rejected` by the engine, or `never_fits` by the queue when no replica's KV could hold it), and misses the SLO; the
command says how many, on stderr before it simulates and under the ranking. Goodput is a rate over the whole run,
from the first arrival to the last request's end, refusals included (dcpserve/simulator/metrics.py `span_s`).

With --gpu-budget G (a multiple of --gpus-per-node), each layout runs with as many replicas as G GPUs hold, and
then two-pool splits of G (dcpserve/simulator/pool_split.py: each pair of layouts at about 1/4, 1/2 and 3/4 of the
budget) run as apps of layout pools; layouts and splits are ranked together, and the best split is printed as the
serve_config args that deploy it.

Without --trace, `plan` is the capacity table alone, as before; the options of the trace group are refused there.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dcpserve.cluster.cli import plan_request
from dcpserve.cluster.planner import PlanRequest, PlanRow, format_bytes, plan_layouts
from dcpserve.cluster.published_models import model_spec
from dcpserve.engine.args import cli_type
from dcpserve.simulator.build import PoolOption, build
from dcpserve.simulator.cli import add_commands as add_simulate_command
from dcpserve.simulator.cli import throughput
from dcpserve.simulator.gpus import GPUS, gpu_spec
from dcpserve.simulator.metrics import Goodput, goodput, span_s
from dcpserve.simulator.pool_split import Split, serve_config_snippet, split_candidates
from dcpserve.simulator.run import Simulation
from dcpserve.simulator.step_fit import LinearStepModel
from dcpserve.simulator.synth import PRESETS, parse_preset_or_path
from dcpserve.simulator.trace import TraceError, TraceRequest

DEFAULT_REQUESTS = 500
DEFAULT_TTFT_TARGET_S = 2.0
DEFAULT_ITL_TARGET_S = 0.05

# The options of the group, by dest: each applies only with --trace (None: not given; the defaults above apply).
_TRACE_OPTIONS = {"gpu": "--gpu", "requests": "--requests", "concurrency": "--concurrency", "rate": "--rate",
                  "seed": "--seed", "ttft_target_s": "--ttft-target-s", "itl_target_s": "--itl-target-s",
                  "step_model": "--step-model", "gpu_budget": "--gpu-budget"}


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if not value > 0:
            raise ValueError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return cli_type(parse)


def extend_plan(plan: argparse.ArgumentParser) -> None:
    """Adds --trace and its options to the `plan` subparser, and wraps its command: without --trace it runs as
    before, with --trace it prints the capacity table and the layouts ranked by simulated goodput."""
    group = plan.add_argument_group(
        "simulated goodput (with --trace)",
        "replay a trace on every layout of the table (dcpserve/simulator/plan.py, docs/simulate.md) and rank the "
        "layouts by "
        "goodput per GPU; --gpu-memory then defaults to --gpu's memory")
    group.add_argument("--trace", default=None,
                       help=f"a Mooncake JSONL trace file, or a generated preset: {', '.join(PRESETS)}")
    group.add_argument("--gpu", default=None, choices=sorted(GPUS),
                       help="the simulated GPU, required with --trace (its memory is the plan's --gpu-memory)")
    group.add_argument("--requests", type=_positive(int), default=None,
                       help=f"requests a preset generates (default {DEFAULT_REQUESTS})")
    group.add_argument("--concurrency", type=_positive(int), default=None,
                       help="closed loop: this many clients (default: open loop at the trace's timestamps)")
    group.add_argument("--rate", type=_positive(float), default=None,
                       help="sessions per second a preset's clients start (default: the preset's rate)")
    group.add_argument("--seed", type=int, default=None, help="the preset's seed (default 0)")
    group.add_argument("--ttft-target-s", type=_positive(float), default=None,
                       help=f"time to first token a request must meet, queueing included (default "
                            f"{DEFAULT_TTFT_TARGET_S:g})")
    group.add_argument("--itl-target-s", type=_positive(float), default=None,
                       help=f"mean inter-token latency a request must meet (default {DEFAULT_ITL_TARGET_S:g})")
    group.add_argument("--step-model", default=None,
                       help="roofline (default: from the GPU and model specs), or a fitted model's JSON file")
    group.add_argument("--gpu-budget", type=_positive(int), default=None, metavar="GPUS",
                       help="GPUs to plan for, a multiple of --gpus-per-node: each layout with as many replicas as "
                            "they hold, then two-pool splits of them (layout pools), ranked together; the best "
                            "split printed as serve_config args (default: one node's GPUs, no splits)")
    # --gpu-memory is required without --trace only: _cmd_plan checks it. argparse has no public way to reach an
    # argument another module added, so the action is found by its dest.
    gpu_memory = next(action for action in plan._actions if action.dest == "gpu_memory")
    gpu_memory.required = False
    gpu_memory.help = f"{gpu_memory.help}; required without --trace (with it: --gpu's memory)"
    plan.set_defaults(func=functools.partial(_cmd_plan, plan, plan.get_default("func")))


def _cmd_plan(plan: argparse.ArgumentParser, capacity_table: Callable[[argparse.Namespace], int],
              args: argparse.Namespace) -> int:
    if args.trace is None:
        given = [flag for dest, flag in _TRACE_OPTIONS.items() if getattr(args, dest) is not None]
        if given:
            plan.error(f"{', '.join(given)} given without --trace: the simulated goodput options need --trace")
        if args.gpu_memory is None:
            plan.error("the following arguments are required: --gpu-memory")
        return capacity_table(args)
    if args.gpu is None:
        plan.error("--trace needs --gpu (h100, h200 or b200): the simulated GPU's memory, bandwidth and FLOP/s")
    if args.gpu_budget is not None and args.gpu_budget % args.gpus_per_node:
        nodes = max(1, round(args.gpu_budget / args.gpus_per_node))
        plan.error(f"--gpu-budget {args.gpu_budget} is not a multiple of --gpus-per-node {args.gpus_per_node}: plan "
                   f"for whole nodes, for example --gpu-budget {nodes * args.gpus_per_node}")
    if getattr(args, "pcp", 1) > 1:
        plan.error(f"--pcp {args.pcp} with --trace: the simulator's step model has no prefill context parallelism "
                   f"yet, so it cannot rank PCP layouts; drop --trace to see their KV capacity, or --pcp to simulate")
    gpu = gpu_spec(args.gpu)
    if args.gpu_memory is not None and args.gpu_memory != gpu.memory_bytes:
        raise SystemExit(f"dcpserve plan: --gpu-memory {format_bytes(args.gpu_memory)} is not the {gpu.name}'s "
                         f"{format_bytes(gpu.memory_bytes)}, which the simulation sizes the KV cache with; drop "
                         f"--gpu-memory (with --trace it is --gpu's memory)")
    args = with_trace_defaults(args, gpu.memory_bytes)
    try:
        model = model_spec(args.model)
        request = plan_request(args)
        if args.step_model != "roofline":  # every layout runs it: a bad file is one error, not a skipped row each
            LinearStepModel.from_json(Path(args.step_model).read_text())
        trace = parse_preset_or_path(args.trace, args.requests, args.seed, args.rate)
    except (OSError, TraceError, ValueError) as err:
        raise SystemExit(f"dcpserve plan: {err}") from None
    too_long = _longer_than(trace, request.context_len)
    if too_long:
        print(f"plan: {too_long}", file=sys.stderr, flush=True)
    status = capacity_table(args)
    if status:
        return status
    heading = _describe_run(args, gpu.name, request, len(trace))
    if args.gpu_budget is not None:
        results = _simulate_budget(args, plan_layouts(model, request), request, trace)
        print()
        print(format_ranking(results, heading, too_long, budget=args.gpu_budget))
        print(_best_split(results, args.gpu_budget, request.context_len))
        return 0
    results = _simulate_layouts(args, plan_layouts(model, request), request, trace)
    print()
    print(format_ranking(results, heading, too_long))
    return 0


def with_trace_defaults(args: argparse.Namespace, gpu_memory_bytes: int) -> argparse.Namespace:
    """The arguments with the trace options' defaults filled in (they are None when not given, so that _cmd_plan
    can tell them apart without --trace) and --gpu-memory the GPU's."""
    defaults = {"requests": DEFAULT_REQUESTS, "seed": 0, "ttft_target_s": DEFAULT_TTFT_TARGET_S,
                "itl_target_s": DEFAULT_ITL_TARGET_S, "step_model": "roofline"}
    resolved = {name: default if getattr(args, name) is None else getattr(args, name)
                for name, default in defaults.items()}
    return argparse.Namespace(**{**vars(args), **resolved, "gpu_memory": gpu_memory_bytes})


def _longer_than(trace: list[TraceRequest], context_len: int) -> str | None:
    """What to say when requests of the trace need more than context_len tokens (prompt + max_tokens)."""
    lengths = [r.input_length + (r.max_tokens or r.output_length) for r in trace]
    over = [length for length in lengths if length > context_len]
    if not over:
        return None
    return (f"{len(over)} of {len(trace)} requests need more than --context {context_len:,} tokens (the longest "
            f"{max(over):,}): they are refused and miss the SLO; raise --context to "
            f"{max(over):,} to serve them")


@dataclass(frozen=True)
class LayoutResult:
    """One layout's simulated run, or why it was not run."""

    label: str  # "tp=8 dcp=4"; a split: "tp=8 dcp=1 x1 + tp=8 dcp=8 x1"
    replicas: int = 0  # a split's: of both pools
    summary: dict[str, Any] | None = None  # None: skipped
    goodput: Goodput | None = None
    skipped: str | None = None
    split: Split | None = None  # a two-pool split's pools (--gpu-budget); None: one layout
    gpus: int = 0  # the replicas' GPUs


def simulate_args(args: argparse.Namespace, request: PlanRequest, layout: tuple[int, int] | None, nodes: int = 1,
                  pools: Sequence[PoolOption] = ()) -> argparse.Namespace:
    """`dcpserve simulate`'s arguments for one layout of the plan on `nodes` nodes, or for an app of layout pools
    (layout None; args: plan's, through with_trace_defaults): simulate's own defaults for everything plan does not
    set (parsed by simulate's parser, so they cannot drift), then the plan's values."""
    parser = argparse.ArgumentParser(prog="dcpserve")
    add_simulate_command(parser.add_subparsers(dest="command"))
    base = vars(parser.parse_args(["simulate", f"--trace={args.trace}", f"--model={args.model}"]))
    overrides = {
        "gpu": args.gpu, "nodes": nodes, "gpus_per_node": request.gpus_per_node, "layout": layout, "replicas": None,
        "pool": list(pools) or None,
        "concurrency": args.concurrency, "requests": args.requests, "seed": args.seed,
        "rate": args.rate, "weight_dtype": request.weight_dtype, "kv_dtype": request.kv_dtype,
        "block_size": request.block_size, "gpu_memory_utilization": request.gpu_memory_utilization,
        "max_model_len": request.context_len, "step_model": args.step_model, "quiet": False,
    }
    unknown = sorted(set(overrides) - set(base))
    if unknown:  # simulate renamed an argument: this module is behind dcpserve/simulator/cli.py
        raise RuntimeError(f"dcpserve simulate has no arguments {unknown}; update dcpserve/simulator/plan.py")
    return argparse.Namespace(**{**base, **overrides})


def _simulate_layouts(args: argparse.Namespace, rows: list[PlanRow], request: PlanRequest,
                      trace: list[TraceRequest]) -> list[LayoutResult]:
    """Each layout of the capacity table's rows replays the trace; one result per row, in the rows' order."""
    results = []
    for row in rows:
        label = f"tp={row.tp} dcp={row.dcp}"
        try:
            simulation, facts = build(simulate_args(args, request, (row.tp, row.dcp)))
        except ValueError as err:  # weights past the GPU: a row that says why
            results.append(LayoutResult(label, skipped=str(err)))
            continue
        print(f"plan: {label}", file=sys.stderr, flush=True)
        results.append(_run(args, label, simulation, facts, trace))
    return results


def _run(args: argparse.Namespace, label: str, simulation: Simulation, facts: dict[str, Any],
         trace: list[TraceRequest], split: Split | None = None) -> LayoutResult:
    """Runs one built simulation: its result, with its goodput under the plan's targets."""
    summary = simulation.run(trace)
    records = simulation.recorder.records.values()
    good = goodput(records, span_s(records), summary["gpu_seconds"], args.ttft_target_s, args.itl_target_s)
    gpus = split.gpus if split is not None else simulation.config.shape.tp * facts["replicas"]
    return LayoutResult(label, facts["replicas"], summary, good, split=split, gpus=gpus)


def _simulate_budget(args: argparse.Namespace, rows: list[PlanRow], request: PlanRequest,
                     trace: list[TraceRequest]) -> list[LayoutResult]:
    """--gpu-budget: each layout of the rows with as many replicas as the budget's nodes hold, then the two-pool
    splits of the layouts that fit (dcpserve/simulator/pool_split.py). Everything is built before anything runs, so that
    the progress lines can count the runs; one result per run, then one per skipped layout or split."""
    nodes = args.gpu_budget // request.gpus_per_node
    runs: list[tuple[str, Simulation, dict[str, Any], Split | None]] = []
    skipped: list[LayoutResult] = []
    layouts: list[tuple[int, int]] = []
    for row in rows:
        label = f"tp={row.tp} dcp={row.dcp}"
        try:
            runs.append((label, *build(simulate_args(args, request, (row.tp, row.dcp), nodes)), None))
            layouts.append((row.tp, row.dcp))
        except ValueError as err:  # weights past the GPU: a row that says why
            skipped.append(LayoutResult(label, skipped=str(err)))
    for candidate in split_candidates(layouts, args.gpu_budget):
        try:
            runs.append((candidate.label, *build(simulate_args(args, request, None, nodes, candidate.pools)),
                         candidate))
        except ValueError as err:  # the replicas do not fit the nodes (a TP size that does not divide them)
            skipped.append(LayoutResult(candidate.label, skipped=str(err), split=candidate))
    splits = len(runs) - len(layouts)
    print(f"plan: {len(layouts)} layout{'' if len(layouts) == 1 else 's'} and {splits} two-pool split"
          f"{'' if splits == 1 else 's'} of {args.gpu_budget} GPUs to simulate", file=sys.stderr, flush=True)
    results = []
    for index, (label, simulation, facts, split) in enumerate(runs, start=1):
        print(f"plan: [{index}/{len(runs)}] {label}", file=sys.stderr, flush=True)
        results.append(_run(args, label, simulation, facts, trace, split))
    return results + skipped


def rank(results: list[LayoutResult]) -> list[LayoutResult]:
    """The layouts that ran, best first: goodput per GPU, then the share that met the SLO, then ITL p90 and TTFT
    p90 (lower first), then the table's order."""

    def key(result: LayoutResult) -> tuple[float, float, float, float]:
        assert result.goodput is not None and result.summary is not None  # only results that ran
        return (-result.goodput.requests_per_s_per_gpu, -result.goodput.fraction_met,
                result.summary["itl_s"]["p90"], result.summary["ttft_s"]["p90"])

    return sorted((result for result in results if result.goodput is not None), key=key)


def _describe_run(args: argparse.Namespace, gpu_name: str, request: PlanRequest, num_requests: int) -> str:
    clients = (f"closed loop, {args.concurrency} clients" if args.concurrency
               else "open loop at the trace's times")
    where = (f"{request.gpus_per_node} x {gpu_name} per layout" if args.gpu_budget is None else
             f"{args.gpu_budget} x {gpu_name} per layout or two-pool split")
    return (f"simulated goodput: trace {args.trace} ({num_requests} requests, {clients}) on {where}, step model "
            f"{args.step_model}; SLO: TTFT <= {args.ttft_target_s:g} s and mean ITL <= {args.itl_target_s * 1e3:g} ms")


def _cells(result: LayoutResult) -> tuple[str, str]:
    """The layout and replicas cells of a row: a split's pools joined with " + ", in the same order."""
    if result.split is None:
        return result.label, str(result.replicas)
    return (" + ".join(pool.layout for pool in result.split.pools),
            " + ".join(str(pool.replicas) for pool in result.split.pools))


def _grant_shares(result: LayoutResult) -> str:
    """A split's grants by pool, as shares of all its grants in the pools' order ("30% + 70%"); "-" for a layout
    alone. A pool at 0% held its GPUs and served nothing: the queue's pool choice sent every request elsewhere."""
    if result.split is None or result.summary is None:
        return "-"
    grants = result.summary["pool_grants"]
    total = sum(grants.values())
    counts = [sum(n for key, n in grants.items() if key.split("/")[0] == pool.name) for pool in result.split.pools]
    return " + ".join(f"{count / total:.0%}" if total else "-" for count in counts)


def format_ranking(results: list[LayoutResult], heading: str, note: str | None = None,
                   budget: int | None = None) -> str:
    """The ranked table: a row per layout that ran, best first, then a row per skipped layout and the notes. With a
    budget (--gpu-budget) the two-pool splits rank among the layouts, each row says its GPUs, and the best row and
    the best split are marked."""
    header: tuple[str, ...] = ("rank", "layout", "replicas", "goodput req/s", "per GPU", "SLO met", "TTFT p50",
                               "TTFT p90", "ITL p50", "ITL p90", "tok/s/GPU", "refused")
    if budget is not None:
        header = (*header[:3], "GPUs", *header[3:], "grants", "")
    table = [header]
    ranked = rank(results)
    best_split = next((result for result in ranked if result.split is not None), None)
    for place, result in enumerate(ranked, start=1):
        summary, good = result.summary, result.goodput
        assert summary is not None and good is not None  # rank keeps the results that ran
        cells: tuple[str, ...] = (
            str(place), *_cells(result), f"{good.requests_per_s:.3f}",
            f"{good.requests_per_s_per_gpu:.4f}", f"{good.fraction_met:.1%}",
            f"{summary['ttft_s']['p50']:.3f} s", f"{summary['ttft_s']['p90']:.3f} s",
            f"{summary['itl_s']['p50'] * 1e3:.1f} ms", f"{summary['itl_s']['p90'] * 1e3:.1f} ms",
            f"{throughput(summary):.1f}", str(sum(summary["refused"].values())),
        )
        if budget is not None:
            marks = ["best"] if place == 1 else []
            marks += ["best split"] if result is best_split else []
            cells = (*cells[:3], str(result.gpus), *cells[3:], _grant_shares(result), ", ".join(marks))
        table.append(cells)
    widths = [max(len(cells[i]) for cells in table) for i in range(len(header))]
    left = {1} if budget is None else {1, len(header) - 1}  # the layout and the marks; the numbers right-aligned
    lines = [heading, ""]
    for cells in table:
        lines.append("  ".join(cell.ljust(width) if i in left else cell.rjust(width)
                               for i, (cell, width) in enumerate(zip(cells, widths, strict=True))).rstrip())
    for result in results:
        if result.skipped is not None:
            lines.append(f"{'-'.rjust(widths[0])}  {_cells(result)[0].ljust(widths[1])}  skipped: {result.skipped}")
    if not results:
        lines.append("no layout to simulate: the capacity table has none")
    elif len(table) == 1:
        lines.append("no layout ran: none of the table's layouts fits the weights")
    lines += [
        "",
        "Goodput: requests that finished with TTFT <= the target and their own mean inter-token latency <= the "
        "target, per second of the run and per GPU-second; SLO met: their share of every request sent (refused "
        "ones included). TTFT / ITL percentiles are the run's (ITL over every token gap); tok/s/GPU while every "
        "client had work. Ranked by goodput per GPU, then SLO met, then ITL p90 and TTFT p90.",
    ]
    if budget is not None:
        lines.append(f"A split (A + B) is one app of two layout pools behind one admission queue, each pool with the "
                     f"replicas given, within {budget} GPUs; grants: each pool's share of the queue's grants. A "
                     f"layout alone has as many replicas as {budget} GPUs hold.")
    if note is not None:
        lines.append(note)
    return "\n".join(lines)


def _best_split(results: list[LayoutResult], budget: int, max_model_len: int) -> str:
    """The best split against the best layout alone, and its serve config; or why there is no split."""
    ranked = rank(results)
    best = next((result for result in ranked if result.split is not None), None)
    if best is None:
        fitting = sum(result.split is None and result.skipped is None for result in results)
        why = ("fewer than two layouts fit the weights" if fitting < 2 else
               f"no two layouts fill {budget} GPUs with a replica each" if not any(r.split for r in results) else
               "none fits the nodes (the skipped rows say why)")
        return f"\nNo split ran: {why}."
    assert best.split is not None and best.goodput is not None  # a split that ran
    per_gpu = best.goodput.requests_per_s_per_gpu
    single = next((result for result in ranked if result.split is None), None)
    against = ""
    if single is not None and single.goodput is not None:
        theirs = single.goodput.requests_per_s_per_gpu
        against = (f", against {theirs:.4f} for the best layout alone ({single.label} x{single.replicas})"
                   + (f": {per_gpu / theirs - 1:+.1%}" if theirs > 0 else ""))
    return "\n".join([
        "",
        f"Best split: {best.split.label} on {best.gpus} of {budget} GPUs, {per_gpu:.4f} goodput req/s per GPU"
        f"{against}. To deploy it:",
        "",
        serve_config_snippet(best.split.pools, budget, max_model_len),
    ])

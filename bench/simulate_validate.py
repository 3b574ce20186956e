"""Validate `dcpserve simulate` against the real app on this machine: one small trace, both ways, side by side.

For each layout (default: the tiny model at tp=2 x dcp=2 and tp=2 x dcp=1, the same KV bytes per rank, so DCP has
twice the tokens):
1. calibration, on a trace of the same shape with another seed, through the real app: the app's engine records
   every step it takes (step_trace_path), and the simulator's step model is fitted to those steps, each with the
   host's gap before it (dcpserve.simulator.step_fit.read_step_trace): the served engine's own cycle, on 2 cores it
   shares with the ingress, the proxy, the queue and the client. The app's latency outside the steps (HTTP, the ingress,
   the hops to the queue and the replica: the simulator's request_latency_s) is fitted to the same run: the median
   over its requests of the real TTFT less the simulated one without that latency. A probe of the idle app
   (one-token answers to short prompts, one at a time) measures it without load, for comparison;
2. the real app on the validation trace: one engine replica of that layout deployed with `serve deploy` on a Ray
   head of this process's own (bench/harness/compare.py's, as `make serve`); the trace replayed open loop at its
   timestamps through the official `openai` client (streamed, greedy, ignore_eos, max_tokens = the trace's output
   length, prompts as token ids built from the trace's prefix ids so shared prefixes are shared tokens); /health
   polled for the granted sequences; afterwards the app's own Prometheus counters: admission decisions by
   outcome, grants that came back, preemptions, engine steps;
3. the simulator: the same trace, the same KV blocks (the replica's /health capacity), the same scheduler limits
   and app settings, the calibration run's step model and latency.

It prints, per layout and rate, the real and the simulated value of each metric and their ratio, with the issue's
bounds, for two simulations: the step model and latency fitted on the calibration run (a prediction), and fitted
on the validation run itself (the host's speed during that run taken as given: on a shared 2-core host it drifts
between runs more than the fit errs, and this column checks the control plane's side alone). The bounds:
output tok/s, TTFT p50 and peak concurrency within 20%; admission decisions (queued, refused by kind, preempted)
of the same kinds and counts within 10% (of the count; a count of at most 10 within 1).

    .venv/bin/python -m bench simulate_validate                       # ~16 minutes on 2 cores
    .venv/bin/python -m bench simulate_validate --write-docs          # also writes its docs/benchmarks.md section
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.harness import compare
from bench.harness.docs_section import DocsSection, bench_command
from bench.served_replay import HEALTH_PERIOD_S, RealRun, probe_latency, real_metrics, replay, scrape
from dcpserve.cluster.tiny_model import write_tiny_model
from dcpserve.engine.args import EngineArgs
from dcpserve.engine.config import ModelConfig
from dcpserve.simulator.metrics import RequestRecord, percentile
from dcpserve.simulator.replica import ReplicaShape
from dcpserve.simulator.run import ServeSettings, Simulation, SimulationConfig
from dcpserve.simulator.step_fit import LinearStepModel, read_step_trace
from dcpserve.simulator.synth import LengthDist, TraceShape, generate
from dcpserve.simulator.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest

DOCS = DocsSection("bench/simulate_validate.py")
BLOCK_SIZE = 16
MAX_MODEL_LEN = 4096
KV_TOKENS_PER_RANK = 3072  # per rank: tp=2 x dcp=1 holds 3,072 tokens, tp=2 x dcp=2 6,144
METRICS_WAIT_S = 15.0  # Ray exports custom metrics every 10 s (metrics_report_interval_ms)
THROUGHPUT_BOUND = 0.20
DECISION_BOUND = 0.10

# The trace: single requests over three shared 512-token system prompts, heavy-tailed lengths, Poisson arrivals
# past what one replica of the tiny model serves on 2 cores, so requests wait, a few are refused and the KV fills.
SHAPE = TraceShape(
    name="validate", arrival="poisson", rate_per_s=2.0,
    input_tokens=LengthDist(median=900, sigma=0.6, minimum=560, maximum=3000),
    output_tokens=LengthDist(median=48, sigma=0.8, minimum=4, maximum=256),
    shared_prefix_tokens=MOONCAKE_BLOCK_TOKENS, num_prefix_groups=3,
)


def say(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def prompt_ids(request: TraceRequest, seed: int) -> list[int]:
    """The prompt's token ids: each trace block id's 512 tokens drawn from its own seeded generator (byte tokens),
    so prompts with the same leading ids share those tokens, as the simulator assumes."""
    ids: list[int] = []
    for hash_id in request.hash_ids:
        rng = random.Random(hash_id * 1_000_003 + seed)
        ids.extend(rng.randrange(256) for _ in range(MOONCAKE_BLOCK_TOKENS))
    return ids[:request.input_length]


# ---- the real app ------------------------------------------------------------------------------------------------

def run_real(head: compare.ServeHead, model_dir: Path, tp: int, dcp: int, settings: dict[str, Any],
             trace: list[TraceRequest], prompts: list[list[int]], what: str, probe: bool = False) -> RealRun:
    """The trace through the deployed app, and the step model fitted to the engine's steps of it; with probe, then
    the app's own latency (probe_latency) on the app idle again."""
    label = f"tp{tp}_dcp{dcp}_{what}"
    config = compare.app_config(tp, dcp, BLOCK_SIZE, settings["budget_bytes"], MAX_MODEL_LEN, "usage",
                                settings["max_queued_requests"])
    args = config["applications"][0]["args"]
    steps_path = head.settings.state_dir / f"steps_{label}.jsonl"
    args["step_trace_path"] = str(steps_path)
    args["queue_timeout_s"] = settings["queue_timeout_s"]
    args["routing_stats_period_s"] = 1.0  # the app's defaults from here on
    args["kv_report_period_s"] = settings["kv_report_period_s"]
    say(f"{label}: deploying")
    head.deploy(model_dir, config, label)
    _, info = head.replica(label)
    run = RealRun(capacity_blocks=info["capacity"])
    before = scrape(head.settings.state_dir / "ray")
    say(f"{label}: KV {run.capacity_blocks} blocks; replaying {len(trace)} requests over "
        f"{(trace[-1].timestamp_ms or 0.0) / 1000:.0f} s")
    asyncio.run(replay(head.base_url, trace, prompts, run))
    say(f"{label}: waiting {METRICS_WAIT_S:.0f} s for Ray to export the app's counters")
    time.sleep(METRICS_WAIT_S)
    after = scrape(head.settings.state_dir / "ray")
    run.counters = {key: after[key] - before.get(key, 0.0) for key in after}
    run.fit, _ = LinearStepModel.fit(read_step_trace(steps_path))  # before the probe's steps
    say(f"{label}: step model {run.fit.describe()}")
    run.latency_s = loaded_latency(run, run_simulated(model_dir, tp, dcp, run.capacity_blocks, settings, run.fit,
                                                      trace, 0.0)[1])
    say(f"{label}: the app's latency outside the steps under this load: {run.latency_s * 1e3:.1f} ms")
    if probe:
        run.idle_latency_s = asyncio.run(probe_latency(head.base_url, run.fit, len(trace)))
        say(f"{label}: the idle app's latency outside the steps: {run.idle_latency_s * 1e3:.1f} ms")
    head.shutdown_serve()
    return run


# ---- the simulator -----------------------------------------------------------------------------------------------

def loaded_latency(run: RealRun, records: list[RequestRecord]) -> float:
    """The app's latency outside the engine's steps under the run's own load (HTTP, the ingress, the hops to the
    queue and the replica, on cores the engine also uses): the median of the real TTFT less the simulated one, over
    the requests that a simulation without that latency (records, in arrival order) admitted without a wait, so
    that a queue wait is not taken for latency."""
    real = sorted(run.requests, key=lambda r: r.sent)
    if len(real) != len(records):
        raise SystemExit(f"{len(real)} real requests against {len(records)} simulated ones")
    gaps = sorted(r.first_token - r.sent - (sim.first_token_at - sim.arrival)
                  for r, sim in zip(real, records, strict=True)
                  if r.first_token is not None and sim.first_token_at is not None and sim.admitted_at == sim.arrival)
    return max(0.0, percentile(gaps, 50)) if gaps else 0.0


def run_simulated(model_dir: Path, tp: int, dcp: int, capacity_blocks: int, settings: dict[str, Any],
                  fit: LinearStepModel, trace: list[TraceRequest],
                  latency_s: float) -> tuple[dict[str, Any], list[RequestRecord]]:
    """The simulation's summary, and its requests in arrival order."""
    engine = EngineArgs(str(model_dir), tensor_parallel_size=tp, decode_context_parallel_size=dcp,
                        block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, dtype="float32",
                        kv_cache_memory_bytes=settings["budget_bytes"], admission="usage").create_engine_config()
    shape = ReplicaShape(tp=tp, dcp=dcp, num_blocks=capacity_blocks, block_size=BLOCK_SIZE,
                         scheduler=engine.scheduler, enable_prefix_caching=engine.cache.enable_prefix_caching)
    serve = ServeSettings(max_queued_requests=settings["max_queued_requests"],
                          queue_timeout_s=settings["queue_timeout_s"],
                          kv_report_period_s=settings["kv_report_period_s"])
    config = SimulationConfig(shape=shape, num_replicas=1, serve=serve, sample_period_s=HEALTH_PERIOD_S,
                              request_latency_s=latency_s)
    simulation = Simulation(config, fit)
    summary = simulation.run(trace)
    return summary, sorted(simulation.recorder.records.values(), key=lambda r: r.arrival)


def sim_metrics(summary: dict[str, Any]) -> dict[str, float]:
    admission, refused = summary["admission"], summary["refused"]
    return {
        "output_tokens_per_s": summary["output_tokens_per_s"],
        "ttft_p50_s": summary["ttft_s"]["p50"],
        "peak_concurrency": summary["peak_granted_sequences"],
        "finished": summary["finished"],
        "queued": admission.get("queued", 0),
        "queue_full": refused.get("queue_full", 0),
        "queue_timeout": refused.get("queue_timeout", 0),
        "refused_by_replica": admission.get("refused_by_replica", 0),
        "preemptions": summary["preemptions"],
        "mean_step_s": summary["step_mean_s"],
        "steps": summary["steps"],
        "mean_queue_wait_s": summary["queue_wait_mean_s"],
        "ttft_p90_s": summary["ttft_s"]["p90"],
    }


# ---- the comparison ----------------------------------------------------------------------------------------------

ROWS = (  # (key, label, format, kind of bound)
    ("output_tokens_per_s", "output tok/s", "{:.1f}", "ratio"),
    ("ttft_p50_s", "TTFT p50 (s)", "{:.3f}", "ratio"),
    ("peak_concurrency", "peak granted sequences (sampled every 50 ms)", "{:.0f}", "ratio"),
    ("finished", "requests finished", "{:.0f}", "count"),
    ("queued", "requests that waited in the queue", "{:.0f}", "count"),
    ("queue_full", "refused: queue full (429)", "{:.0f}", "count"),
    ("queue_timeout", "refused: queue timeout (429)", "{:.0f}", "count"),
    ("refused_by_replica", "grants a replica refused", "{:.0f}", "count"),
    ("preemptions", "preemptions", "{:.0f}", "count"),
    ("ttft_p90_s", "TTFT p90 (s)", "{:.3f}", ""),
    ("mean_step_s", "engine step, mean (s)", "{:.4f}", ""),
    ("steps", "engine steps", "{:.0f}", ""),
    ("mean_queue_wait_s", "queue wait of those that waited, mean (s)", "{:.3f}", ""),
)


def within(kind: str, real: float, sim: float) -> bool:
    if kind == "ratio":
        return real > 0 and abs(sim - real) <= THROUGHPUT_BOUND * real
    return abs(sim - real) <= max(1.0, DECISION_BOUND * real)


def spread(values: list[float], fmt: str) -> str:
    """The median, and the range where there is more than one value."""
    middle = fmt.format(statistics.median(values))
    return middle if len(values) < 2 else f"{middle} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def table(layout: str, reals: list[dict[str, float]], predicted: dict[str, float],
          owns: list[dict[str, float]]) -> tuple[list[str], bool, bool, bool]:
    """The markdown rows: the real runs (median and range), the prediction with its ratio to the real median and
    whether it is within the bound, and the simulations of each run fitted on that run (median and range of their
    ratios to their own run); then whether every bounded row of the prediction is within its bound, whether every
    run's own simulation is, and whether the real runs themselves are within the bound of their median."""
    lines = [f"| {layout} | real app, median (range) | predicted | / real median | each run's own fit | / its run | "
             f"real runs within the bound of their median | bound |", "|---|---:|---:|---:|---:|---:|---|---|"]
    ok = own_ok = real_ok = True
    for key, label, fmt, kind in ROWS:
        real_values = [real[key] for real in reals]
        middle = statistics.median(real_values)
        ratio = f"{predicted[key] / middle:.2f}" if middle else "-"
        inside = not kind or within(kind, middle, predicted[key])
        own_ratios = [own[key] / real[key] for own, real in zip(owns, reals, strict=True) if real[key]]
        own_inside = not kind or all(within(kind, real[key], own[key]) for own, real in zip(owns, reals, strict=True))
        real_inside = not kind or all(within(kind, middle, value) for value in real_values)
        if kind:
            ok &= inside
            own_ok &= own_inside
            real_ok &= real_inside
        bound = {"ratio": "±20%", "count": "±10% (±1 at ≤10)"}.get(kind, "")
        lines.append(f"| {label} | {spread(real_values, fmt)} | {fmt.format(predicted[key])} | "
                     f"{ratio}{'' if inside else ' **out**'} | {spread([own[key] for own in owns], fmt)} | "
                     f"{spread(own_ratios, '{:.2f}') if own_ratios else '-'}{'' if own_inside else ' **out**'} | "
                     f"{('yes' if real_inside else '**no**') if kind else ''} | {bound} |")
    return lines, ok, own_ok, real_ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=80, help="requests of each trace (default 80)")
    parser.add_argument("--rates", default="2,4",
                        help="Poisson requests per second, one validation trace each, comma-separated (default 2,4: "
                             "tp=2 x dcp=1 near its KV's limit, then both layouts past it)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="real runs of each validation trace (default 3): the app's own spread on this host")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layouts", default="2x2,2x1", help="tp x dcp pairs, comma-separated (default 2x2,2x1)")
    parser.add_argument("--max-queued-requests", type=int, default=16)
    parser.add_argument("--queue-timeout-s", type=float, default=20.0)
    parser.add_argument("--write-docs", action="store_true", help="write the tables to docs/benchmarks.md")
    args = parser.parse_args(argv)
    if args.write_docs:
        DOCS.check()
    layouts = [tuple(int(x) for x in pair.split("x")) for pair in args.layouts.split(",")]
    rates = [float(rate) for rate in args.rates.split(",")]
    traces = [generate(replace(SHAPE, rate_per_s=rate), args.requests, args.seed) for rate in rates]
    prompts = [[prompt_ids(r, args.seed) for r in trace] for trace in traces]
    # The calibration trace: the first rate's shape, another seed (other lengths, arrivals and prefixes).
    calibration_trace = generate(replace(SHAPE, rate_per_s=rates[0]), args.requests, args.seed + 1)
    calibration_prompts = [prompt_ids(r, args.seed + 1) for r in calibration_trace]
    started = time.monotonic()
    sections: list[str] = []
    all_ok = all_own_ok = all_real_ok = True
    with compare.state_dir("dcpserve-validate-", say) as state:
        model_dir = state / "tiny"
        write_tiny_model(model_dir)
        model = ModelConfig.from_pretrained(model_dir)
        with compare.serve_head(state, deploy_timeout_s=600) as head:
            for tp, dcp in layouts:
                settings = {"budget_bytes": compare.kv_budget_bytes(model, tp, BLOCK_SIZE, KV_TOKENS_PER_RANK //
                                                                    BLOCK_SIZE),
                            "max_queued_requests": args.max_queued_requests,
                            "queue_timeout_s": args.queue_timeout_s, "kv_report_period_s": 0.5}
                calibration = run_real(head, model_dir, tp, dcp, settings, calibration_trace, calibration_prompts,
                                       "calibration", probe=True)
                for rate, trace, trace_prompts in zip(rates, traces, prompts, strict=True):
                    reals = [run_real(head, model_dir, tp, dcp, settings, trace, trace_prompts, f"rate{rate:g}_{n}")
                             for n in range(args.repeats)]
                    predicted = run_simulated(model_dir, tp, dcp, reals[0].capacity_blocks, settings,
                                              calibration.step_model, trace, calibration.latency_s)[0]
                    owns = [run_simulated(model_dir, tp, dcp, real.capacity_blocks, settings, real.step_model, trace,
                                          real.latency_s)[0] for real in reals]
                    lines, ok, own_ok, real_ok = table(f"tp={tp} dcp={dcp}, {rate:g}/s",
                                                       [real_metrics(real) for real in reals],
                                                       sim_metrics(predicted), [sim_metrics(own) for own in owns])
                    all_ok &= ok
                    all_own_ok &= own_ok
                    all_real_ok &= real_ok
                    latencies = spread([real.latency_s * 1e3 for real in reals], "{:.1f}")
                    sections.append("\n".join([
                        f"**tp={tp} x dcp={dcp}, {rate:g} requests/s**: KV {reals[0].capacity_blocks} blocks of "
                        f"{BLOCK_SIZE * dcp} tokens", "",
                        f"- calibration run: step model {calibration.step_model.describe()}; latency outside the steps "
                        f"{calibration.latency_s * 1e3:.1f} ms (idle app: "
                        f"{(calibration.idle_latency_s or 0) * 1e3:.1f} ms)",
                        f"- the {args.repeats} real runs' own latency outside the steps: {latencies} ms", "", *lines]))
                    print(sections[-1] + "\n", flush=True)
    stats = (f"{args.requests} requests, Poisson {' and '.join(f'{rate:g}' for rate in rates)}/s, prompts "
             f"{SHAPE.input_tokens.minimum}-{SHAPE.input_tokens.maximum} tokens (median {SHAPE.input_tokens.median}) "
             f"over {SHAPE.num_prefix_groups} shared 512-token prefixes, outputs {SHAPE.output_tokens.minimum}-"
             f"{SHAPE.output_tokens.maximum} (median {SHAPE.output_tokens.median}), seed {args.seed}; queue bound "
             f"{args.max_queued_requests}, queue timeout {args.queue_timeout_s:g} s; {args.repeats} real runs of "
             f"each trace")
    report = "\n\n".join(sections)
    verdict = (f"within the issue's bounds: predicted {'yes' if all_ok else 'no'}; each run's own fit "
               f"{'yes' if all_own_ok else 'no'}; the real runs of one trace, of their median "
               f"{'yes' if all_real_ok else 'no'}")
    print(f"{stats}\n\n{verdict}")
    say(f"done in {time.monotonic() - started:.0f} s")
    if args.write_docs:
        command = bench_command("simulate_validate", argv)
        DOCS.write("\n".join([
            "### The simulator against the real app (this machine)", "",
            f"`{command}`, {time.strftime('%Y-%m-%d')}; {compare.environment_line()}", "",
            f"The traces: {stats}. Real: one replica of the tiny model deployed with `serve deploy` on a Ray head of "
            f"the bench's own, each trace replayed open loop through the `openai` client. Simulated: the same trace, "
            f"KV blocks, scheduler limits and app settings, with a step model fitted to the served engine's own "
            f"steps (step_trace_path, each step with the host's gap before it) and the app's latency outside the "
            f"steps fitted to the same run's TTFTs.", "", report, "",
            f"All {verdict}. The predicted column's step model and latency were fitted on a calibration trace "
            f"(seed + 1) run before. Each run's own fit takes the host's speed during that run as given, so what it "
            f"checks is the control plane's side alone. The column before the bound says whether the app itself, "
            f"rerun on the same trace, stays within the bound of its own median.",
        ]))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())

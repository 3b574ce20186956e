"""Validate `dcpserve simulate` against the real app on this machine: one small trace, both ways, side by side.

For each layout (default: the tiny model at tp=2 x dcp=2 and tp=2 x dcp=1, the same KV bytes per rank, so DCP has
twice the tokens):
1. the step model: bench/step_fit.py fits `LinearStepModel` to this engine's measured steps at that layout (its
   own process, its own Ray for the worker group, a load of its own: not the traces below);
2. calibration, on a trace of the same shape with another seed, through the real app: the app's mean engine step
   (its dcpserve_engine_step_seconds histogram) against the fit's gives one scale for the fit (the engine alone
   has the 2 cores to itself; served, it shares them with the ingress, the proxy, the queue and the client), and
   a probe of the idle app (one-token answers to short prompts, one at a time) gives the app's latency outside
   the steps (HTTP, ingress, the hops to the queue and the replica), the simulator's request_latency_s;
3. the real app on the validation trace: one engine replica of that layout deployed with `serve deploy` on a Ray
   head of this process's own (bench/compare.py's, as `make serve`); the trace replayed open loop at its
   timestamps through the official `openai` client (streamed, greedy, ignore_eos, max_tokens = the trace's output
   length, prompts as token ids built from the trace's prefix ids so shared prefixes are shared tokens); /health
   polled for the granted sequences; afterwards the app's own Prometheus counters: admission decisions by
   outcome, grants that came back, preemptions, engine steps;
4. the simulator: the same trace, the same KV blocks (the replica's /health capacity), the same scheduler limits
   and app settings, the calibrated step model and latency.

It prints, per layout and rate, the real and the simulated value of each metric and their ratio, with the issue's
bounds, for two simulations: the step model scaled on the calibration trace (a prediction), and scaled to the
validation run's own mean engine step (the host's speed during that run taken as given: on a shared 2-core host it
drifts between runs more than the fit errs, and this column checks the control plane's side alone). The bounds:
output tok/s, TTFT p50 and peak concurrency within 20%; admission decisions (queued, refused by kind, preempted)
of the same kinds and counts within 10% (of the count; a count of at most 10 within 1).

    .venv/bin/python bench/simulate_validate.py                       # ~11 minutes on 2 cores
    .venv/bin/python bench/simulate_validate.py --write-docs          # also writes its docs/benchmarks.md section
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import httpx

from bench import compare
from bench.docs_section import DocsSection
from bench.prometheus import metric_lines
from cluster.tiny_model import write_tiny_model
from engine.args import EngineArgs
from engine.config import ModelConfig
from simulator.metrics import percentile
from simulator.replica import ReplicaShape
from simulator.run import ServeSettings, Simulation, SimulationConfig
from simulator.step_fit import LinearStepModel
from simulator.step_time import StepWork
from simulator.synth import LengthDist, TraceShape, generate
from simulator.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest

DOCS = DocsSection("bench/simulate_validate.py")
BLOCK_SIZE = 16
MAX_MODEL_LEN = 4096
KV_TOKENS_PER_RANK = 3072  # per rank: tp=2 x dcp=1 holds 3,072 tokens, tp=2 x dcp=2 6,144
HEALTH_PERIOD_S = 0.05
METRICS_WAIT_S = 15.0  # Ray exports custom metrics every 10 s (metrics_report_interval_ms)
CALIBRATION_ROUNDS = 4
PROBES = 9
PROBE_TOKENS = 32
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

@dataclass
class RealRequest:
    sent: float
    status: int | None = None
    kind: str = ""  # the refusal's error code
    first_token: float | None = None
    finished: float | None = None
    completion_tokens: int = 0


@dataclass
class RealRun:
    requests: list[RealRequest] = field(default_factory=list)
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (s, granted sequences)
    counters: dict[str, float] = field(default_factory=dict)
    capacity_blocks: int = 0
    latency_s: float = 0.0  # probe_latency's, where it ran


async def probe_latency(base_url: str, fit: LinearStepModel, seed: int) -> float:
    """The app's own latency, outside the engine's steps: PROBES requests one after another on the idle app, each a
    PROBE_TOKENS-token prompt and 1 output token; their median TTFT less the fit's time of that one prefill step."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
    rng = random.Random(seed)
    ttfts = []
    try:
        for _ in range(PROBES):
            prompt = [rng.randrange(256) for _ in range(PROBE_TOKENS)]
            start = time.perf_counter()
            stream = await client.completions.create(model=compare.MODEL_NAME, prompt=prompt, max_tokens=1,
                                                     temperature=0, stream=True)
            async with stream:
                first = None
                async for chunk in stream:
                    if chunk.choices and first is None:
                        first = time.perf_counter() - start
            ttfts.append(first if first is not None else time.perf_counter() - start)
    finally:
        await client.close()
    ttfts.sort()
    step = fit.step_seconds(StepWork.from_rows([(0, PROBE_TOKENS)]))
    return max(0.0, percentile(ttfts, 50) - step)


async def replay(base_url: str, trace: list[TraceRequest], prompts: list[list[int]], run: RealRun) -> None:
    """Each request at its timestamp (open loop), streamed; fills run.requests and run.timeline."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=900)
    start = time.perf_counter()
    done = asyncio.Event()

    async def one(request: TraceRequest, prompt: list[int]) -> RealRequest:
        assert request.timestamp_ms is not None  # single-turn trace
        await asyncio.sleep(max(0.0, request.timestamp_ms / 1000 - (time.perf_counter() - start)))
        record = RealRequest(sent=request.timestamp_ms / 1000)
        try:
            stream = await client.completions.create(
                model=compare.MODEL_NAME, prompt=prompt, max_tokens=request.output_length, temperature=0,
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async with stream:
                async for chunk in stream:
                    now = time.perf_counter() - start
                    if chunk.choices and record.first_token is None:
                        record.first_token = now
                    if chunk.usage is not None:
                        record.completion_tokens = chunk.usage.completion_tokens
            record.status, record.finished = 200, time.perf_counter() - start
        except openai.APIStatusError as err:
            body = err.body if isinstance(err.body, dict) else {}
            record.status, record.kind = err.status_code, str(body.get("code") or body.get("type") or "")
        return record

    async def watch() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
            while not done.is_set():
                granted = (await http.get("/health")).json().get("num_grants", 0)
                run.timeline.append((time.perf_counter() - start, granted))
                await asyncio.sleep(HEALTH_PERIOD_S)

    watcher = asyncio.create_task(watch())
    try:
        run.requests = list(await asyncio.gather(*(one(r, p) for r, p in zip(trace, prompts, strict=True))))
    finally:
        done.set()
        await watcher
        await client.close()


COUNTERS = ("dcpserve_admission_requests", "dcpserve_admission_replica_refusals", "dcpserve_preemptions")
HISTOGRAMS = ("dcpserve_engine_step_seconds", "dcpserve_admission_queue_wait_seconds")


def scrape(ray_temp: Path) -> dict[str, float]:
    """The app's counters summed over replicas, keyed "name" or "name{outcome|reason}", and its histograms' sums and
    counts ("name_sum", "name_count"), from every node's Prometheus endpoint (bench/prometheus.py)."""
    pattern = re.compile(r"^\w*?(" + "|".join(COUNTERS) + r"|(?:" + "|".join(HISTOGRAMS) + r")_(?:sum|count))"
                         r"(?:_total)?\{([^}]*)\}\s+(\S+)$")
    totals: dict[str, float] = {}
    for line in metric_lines(ray_temp):
        match = pattern.match(line)
        if not match:
            continue
        label = re.search(r'(?:outcome|reason)="([^"]*)"', match.group(2))
        key = match.group(1) + (f"{{{label.group(1)}}}" if label else "")
        totals[key] = totals.get(key, 0.0) + float(match.group(3))
    return totals


def run_real(head: compare.ServeHead, model_dir: Path, tp: int, dcp: int, settings: dict[str, Any],
             trace: list[TraceRequest], prompts: list[list[int]], what: str,
             probe_fit: LinearStepModel | None = None) -> RealRun:
    """The trace through the deployed app; with probe_fit, then the app's own latency (probe_latency) on the app
    idle again."""
    label = f"tp{tp}_dcp{dcp}_{what}"
    config = compare.app_config(tp, dcp, BLOCK_SIZE, settings["budget_bytes"], MAX_MODEL_LEN, "usage",
                                settings["max_queued_requests"])
    args = config["applications"][0]["args"]
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
    if probe_fit is not None:
        run.latency_s = asyncio.run(probe_latency(head.base_url, probe_fit, len(trace)))
        say(f"{label}: the app's latency outside the engine steps: {run.latency_s * 1e3:.1f} ms")
    head.shutdown_serve()
    return run


def real_metrics(run: RealRun) -> dict[str, float]:
    done = [r for r in run.requests if r.status == 200 and r.finished is not None]
    first_arrival = min(r.sent for r in run.requests)
    duration = max(r.finished for r in done if r.finished is not None) - first_arrival
    ttft = sorted(r.first_token - r.sent for r in done if r.first_token is not None)
    counters = run.counters
    return {
        "output_tokens_per_s": sum(r.completion_tokens for r in done) / duration,
        "ttft_p50_s": percentile(ttft, 50),
        "peak_concurrency": max((n for _, n in run.timeline), default=0),
        "finished": len(done),
        "queued": counters.get("dcpserve_admission_requests{queued}", 0.0),
        "queue_full": counters.get("dcpserve_admission_requests{rejected_queue_full}", 0.0),
        "queue_timeout": counters.get("dcpserve_admission_requests{rejected_timeout}", 0.0),
        "refused_by_replica": counters.get("dcpserve_admission_replica_refusals{no_kv}", 0.0),
        "preemptions": counters.get("dcpserve_preemptions", 0.0),
        "mean_step_s": _mean(counters, "dcpserve_engine_step_seconds"),
        "steps": counters.get("dcpserve_engine_step_seconds_count", 0.0),
        "mean_queue_wait_s": _mean(counters, "dcpserve_admission_queue_wait_seconds"),
        "ttft_p90_s": percentile(ttft, 90),
    }


def _mean(counters: dict[str, float], histogram: str) -> float:
    count = counters.get(f"{histogram}_count", 0.0)
    return counters.get(f"{histogram}_sum", 0.0) / count if count else 0.0


# ---- the simulator -----------------------------------------------------------------------------------------------

def run_simulated(model_dir: Path, tp: int, dcp: int, capacity_blocks: int, settings: dict[str, Any],
                  fit: LinearStepModel, trace: list[TraceRequest], latency_s: float) -> dict[str, Any]:
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
    return Simulation(config, fit).run(trace)


def calibrate(model_dir: Path, tp: int, dcp: int, settings: dict[str, Any], fit: LinearStepModel,
              run: RealRun, trace: list[TraceRequest], latency_s: float) -> tuple[LinearStepModel, float]:
    """The fit scaled so that the simulated app's mean step equals the real app's in `run` (of `trace`): the engine
    alone (step_fit) has the machine's cores to itself, the served engine shares them with the ingress, the proxy,
    the admission queue and the clients. The scale changes the batches the simulation forms, so it is found by
    fixed-point iteration (a few simulations of a few hundred milliseconds)."""
    target = real_metrics(run)["mean_step_s"]
    if target <= 0:
        raise SystemExit("the run exported no engine step times (dcpserve_engine_step_seconds)")
    factor = 1.0
    for _ in range(CALIBRATION_ROUNDS):
        summary = run_simulated(model_dir, tp, dcp, run.capacity_blocks, settings, fit.scaled(factor), trace,
                                latency_s)
        factor *= target / summary["step_mean_s"]
    return fit.scaled(factor), factor


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


def table(layout: str, real: dict[str, float], sim: dict[str, float],
          own: dict[str, float]) -> tuple[list[str], bool, bool]:
    """The markdown rows: real, then each simulation with its ratio and whether it is within the bound; and
    whether every bounded row of each simulation is."""
    lines = [f"| {layout} | real app | simulated, calibration trace | sim / real | simulated, this run's step | "
             f"sim / real | bound |", "|---|---:|---:|---:|---:|---:|---|"]
    ok = own_ok = True
    for key, label, fmt, kind in ROWS:
        cells = []
        for values in (sim, own):
            ratio = f"{values[key] / real[key]:.2f}" if real[key] else "-"
            inside = not kind or within(kind, real[key], values[key])
            cells.append(f"{fmt.format(values[key])} | {ratio}{'' if inside else ' **out**'}")
        if kind:
            ok &= within(kind, real[key], sim[key])
            own_ok &= within(kind, real[key], own[key])
        bound = {"ratio": "±20%", "count": "±10% (±1 at ≤10)"}.get(kind, "")
        lines.append(f"| {label} | {fmt.format(real[key])} | {cells[0]} | {cells[1]} | {bound} |")
    return lines, ok, own_ok


def fit_step_model(model_dir: Path, tp: int, dcp: int, out: Path, requests: int) -> tuple[LinearStepModel, str]:
    """bench/step_fit.py at that layout, in its own process; the fitted model and its error lines."""
    command = [sys.executable, str(REPO_ROOT / "bench" / "step_fit.py"), "--model", str(model_dir), "--tp", str(tp),
               "--dcp", str(dcp), "--requests", str(requests), "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"bench/step_fit.py failed:\n{result.stderr[-3000:]}")
    error = next((line for line in result.stdout.splitlines() if line.startswith("held-out")), "?")
    return LinearStepModel.from_json(out.read_text()), error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=80, help="requests of each trace (default 80)")
    parser.add_argument("--rates", default="2,4",
                        help="Poisson requests per second, one validation trace each, comma-separated (default 2,4: "
                             "tp=2 x dcp=1 near its KV's limit, then both layouts past it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layouts", default="2x2,2x1", help="tp x dcp pairs, comma-separated (default 2x2,2x1)")
    parser.add_argument("--fit-requests", type=int, default=200, help="requests of step_fit's load (default 200)")
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
    all_ok = all_own_ok = True
    with compare.state_dir("dcpserve-validate-", say) as state:
        model_dir = state / "tiny"
        write_tiny_model(model_dir)
        model = ModelConfig.from_pretrained(model_dir)
        fits: dict[tuple[int, int], tuple[LinearStepModel, str]] = {}
        for tp, dcp in layouts:
            say(f"tp={tp} dcp={dcp}: fitting the step model (bench/step_fit.py, {args.fit_requests} requests)")
            fits[tp, dcp] = fit_step_model(model_dir, tp, dcp, state / f"fit_tp{tp}_dcp{dcp}.json",
                                           args.fit_requests)
            say(f"tp={tp} dcp={dcp}: {fits[tp, dcp][1]}")
        results = []
        with compare.serve_head(state, deploy_timeout_s=600) as head:
            for tp, dcp in layouts:
                settings = {"budget_bytes": compare.kv_budget_bytes(model, tp, BLOCK_SIZE, KV_TOKENS_PER_RANK //
                                                                    BLOCK_SIZE),
                            "max_queued_requests": args.max_queued_requests,
                            "queue_timeout_s": args.queue_timeout_s, "kv_report_period_s": 0.5}
                calibration = run_real(head, model_dir, tp, dcp, settings, calibration_trace, calibration_prompts,
                                       "calibration", probe_fit=fits[tp, dcp][0])
                fit, factor = calibrate(model_dir, tp, dcp, settings, fits[tp, dcp][0], calibration,
                                        calibration_trace, calibration.latency_s)
                say(f"tp={tp} dcp={dcp}: the app's steps take {factor:.2f}x the fit's on the calibration trace")
                for rate, trace, trace_prompts in zip(rates, traces, prompts, strict=True):
                    real = run_real(head, model_dir, tp, dcp, settings, trace, trace_prompts, f"rate{rate:g}")
                    summary = run_simulated(model_dir, tp, dcp, real.capacity_blocks, settings, fit, trace,
                                            calibration.latency_s)
                    # The host's speed during this very run: the fit scaled to this run's own mean step.
                    own_fit, own_factor = calibrate(model_dir, tp, dcp, settings, fits[tp, dcp][0], real, trace,
                                                    calibration.latency_s)
                    own = run_simulated(model_dir, tp, dcp, real.capacity_blocks, settings, own_fit, trace,
                                        calibration.latency_s)
                    results.append(((tp, dcp), rate, real, summary, factor, own, own_factor, calibration.latency_s))
        for (tp, dcp), rate, real, summary, factor, own, own_factor, latency_s in results:
            lines, ok, own_ok = table(f"tp={tp} dcp={dcp}, {rate:g}/s", real_metrics(real), sim_metrics(summary),
                                      sim_metrics(own))
            all_ok &= ok
            all_own_ok &= own_ok
            fit, error = fits[tp, dcp]
            sections.append("\n".join([f"**tp={tp} x dcp={dcp}, {rate:g} requests/s**: KV {real.capacity_blocks} "
                                       f"blocks of {BLOCK_SIZE * dcp} tokens; step model {fit.describe()} ({error}), "
                                       f"scaled by {factor:.2f} (calibration trace) and by {own_factor:.2f} (this "
                                       f"run's mean step); the app's latency outside the steps "
                                       f"{latency_s * 1e3:.1f} ms (idle probe)", "", *lines]))
    stats = (f"{args.requests} requests, Poisson {' and '.join(f'{rate:g}' for rate in rates)}/s, prompts "
             f"{SHAPE.input_tokens.minimum}-{SHAPE.input_tokens.maximum} tokens (median {SHAPE.input_tokens.median}) "
             f"over {SHAPE.num_prefix_groups} shared 512-token prefixes, outputs {SHAPE.output_tokens.minimum}-"
             f"{SHAPE.output_tokens.maximum} (median {SHAPE.output_tokens.median}), seed {args.seed}; queue bound "
             f"{args.max_queued_requests}, queue timeout {args.queue_timeout_s:g} s")
    report = "\n\n".join(sections)
    verdict = (f"within the issue's bounds: calibrated on another trace {'yes' if all_ok else 'no'}; on the run's "
               f"own mean step {'yes' if all_own_ok else 'no'}")
    print(f"{stats}\n\n{report}\n\n{verdict}")
    say(f"done in {time.monotonic() - started:.0f} s")
    if args.write_docs:
        command = "python bench/simulate_validate.py " + " ".join(argv if argv is not None else sys.argv[1:])
        DOCS.write("\n".join([
            "### The simulator against the real app (this machine)", "",
            f"`{command.strip()}`, {time.strftime('%Y-%m-%d')}; {compare.environment_line()}", "",
            f"The traces: {stats}. Real: one replica of the tiny model deployed with `serve deploy` on a Ray head of "
            f"the bench's own, each trace replayed open loop through the `openai` client. Simulated: the same trace, "
            f"KV blocks, scheduler limits and app settings, with the step model bench/step_fit.py fitted at that "
            f"layout on a load of its own, scaled to the app's mean step on a calibration trace (seed + 1), and "
            f"the app's latency outside the steps measured on the idle app.", "", report, "",
            f"All {verdict}. The first simulated column predicts: its step model was scaled on a calibration "
            f"trace run before. The second takes the host's speed during the run itself as given (the fit scaled "
            f"to that run's mean engine step, one number), so what it checks is the control plane's side alone.",
        ]))
    return 0 if all_ok else 1

if __name__ == "__main__":
    sys.exit(main())

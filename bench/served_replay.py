"""The served app's side of bench/simulate_validate.py: a trace replayed open loop through the `openai` client, the
granted sequences polled from /health, the app's own Prometheus counters, and a probe of the idle app's latency."""

from __future__ import annotations

import asyncio
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.harness import compare
from bench.harness.prometheus import metric_lines
from dcpserve.simulator.metrics import percentile
from dcpserve.simulator.step_fit import LinearStepModel
from dcpserve.simulator.step_time import StepWork
from dcpserve.simulator.trace import TraceRequest

HEALTH_PERIOD_S = 0.05
PROBES = 9
PROBE_TOKENS = 32


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
    fit: LinearStepModel | None = None  # fitted to the engine's own steps of this run (run_real)
    latency_s: float = 0.0  # fitted to this run's TTFTs (bench/simulate_validate.py's loaded_latency)
    idle_latency_s: float | None = None  # probe_latency's, where it ran

    @property
    def step_model(self) -> LinearStepModel:
        if self.fit is None:
            raise ValueError("this run has no step model: run_real fits one after the replay")
        return self.fit


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
    counts ("name_sum", "name_count"), from every node's Prometheus endpoint (bench/harness/prometheus.py)."""
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

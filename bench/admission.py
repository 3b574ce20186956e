"""Admission policies measured through the deployed app: "full" (reserve prompt + max_tokens) vs "usage".

One replica of tp=2 x dcp=2 (4 logical GPUs on a Ray head of this script's own, deployments/local_cluster.py, as
`make serve` and bench/capacity.py), the tiny model, the same per-rank KV budget for both policies, sized so that
"full" holds only a few of the burst's requests. The burst asks for a large max_tokens, but every request stops
much earlier on a stop string (greedy, so the stop position is known beforehand): "full" reserves KV for 1024
output tokens that are never written, "usage" admits by the prompt plus a headroom and preempts (recomputing, so
greedy outputs do not change) when decode runs out of blocks.

Before the runs it generates the same prompts offline (engine.llm.LLM, tp=1, in process, greedy, ignore_eos) and
picks, for request i, a 2-4 character stop string whose first occurrence in the greedy text lies at a token
position spread over the workload's range; the app then cuts the output there. For each policy it `serve deploy`s
the app, sends the burst at once through the official `openai` async client (streaming), polls /health for the
sequences the admission queue has granted, reads the replica's preemption counter from the Ray node's metrics
endpoint, then shuts Serve down before the next policy.

    python bench/admission.py                 # full run (console only)
    python bench/admission.py --write-docs    # also writes docs/img/admission.png and its section of docs/benchmarks.md
    python bench/admission.py --quick         # a smaller workload
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
# Running `python bench/admission.py` puts bench/ first on sys.path, where bench/engine.py would shadow the
# `engine` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.capacity import deploy, shutdown_serve  # noqa: E402
from bench.docs_section import DocsSection  # noqa: E402
import httpx  # noqa: E402

from deployments import local_cluster  # noqa: E402
from engine.block_manager import blocks_needed  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.tiny_model import write_tiny_model  # noqa: E402

TP, DCP, BLOCK_SIZE, NUM_GPUS, MAX_MODEL_LEN = 2, 2, 16, 4, 2048
TOKENS_PER_BLOCK = BLOCK_SIZE * DCP  # a logical block
POLICIES = ("full", "usage")
MODEL_NAME = "dcpserve-tiny"
HEALTH_PERIOD_S = 0.2
CANDIDATES_PER_REQUEST = 2  # random prompts generated offline per request, to find texts that do not loop early
METRICS_WAIT_S = 15.0  # Ray exports custom metrics every 10 s (metrics_report_interval_ms)
PLOT_PATH = REPO_ROOT / "docs" / "img" / "admission.png"
DOCS = DocsSection("bench/admission.py")


@dataclass(frozen=True)
class Workload:
    """A burst of `num_requests` random-id prompts, greedy, max_tokens large, each cut early by a stop string."""

    prompt_tokens: int
    max_tokens: int
    num_requests: int
    full_sequences: int  # the per-rank budget is sized so "full" holds this many requests at once
    stop_first: int  # stop positions (output tokens) spread evenly over [stop_first, stop_last]
    stop_last: int
    seed: int = 0

    @property
    def reserved_blocks(self) -> int:
        """What "full" reserves per request (logical blocks)."""
        return blocks_needed(self.prompt_tokens + self.max_tokens, TOKENS_PER_BLOCK)

    def prompts(self, vocab_size: int, per_request: int = 1) -> list[list[int]]:
        rng = random.Random(self.seed)
        return [[rng.randrange(5, vocab_size) for _ in range(self.prompt_tokens)]
                for _ in range(self.num_requests * per_request)]

    def stop_positions(self) -> list[int]:
        """Target stop positions, spread evenly, then shuffled so long and short requests interleave in the FIFO."""
        n = self.num_requests
        positions = [round(self.stop_first + (self.stop_last - self.stop_first) * i / max(n - 1, 1)) for i in range(n)]
        random.Random(self.seed + 1).shuffle(positions)
        return positions


# quick -> workload
WORKLOADS = {
    False: Workload(prompt_tokens=64, max_tokens=1024, num_requests=24, full_sequences=3, stop_first=30, stop_last=400),
    True: Workload(prompt_tokens=64, max_tokens=512, num_requests=12, full_sequences=3, stop_first=20, stop_last=160),
}


@dataclass(frozen=True)
class StopPlan:
    """Request i: its stop string, and what the offline greedy run says the app should return."""

    stop: str
    char_pos: int  # first occurrence of `stop` in the offline greedy text
    expected_text: str  # the offline greedy text cut at char_pos
    expected_tokens: int  # output tokens up to and including the one that completes the stop string


@dataclass
class RequestRecord:
    sent: float
    first_token: float | None = None
    last_token: float | None = None
    completion_tokens: int = 0
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class PolicyResult:
    policy: str
    capacity_blocks: int
    deploy_s: float
    records: list[RequestRecord] = field(default_factory=list)
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (s, sequences granted)
    makespan_s: float = 0.0
    preemptions: int | None = None
    recomputed_tokens: int | None = None
    metrics_note: str = ""

    @property
    def errors(self) -> int:
        return sum(r.error is not None for r in self.records)

    @property
    def peak_sequences(self) -> int:
        return max((n for _, n in self.timeline), default=0)

    @property
    def mean_sequences(self) -> float:
        """Time-weighted mean of the granted sequences from the burst to its last token."""
        points = [(t, n) for t, n in self.timeline if t <= self.makespan_s]
        if len(points) < 2:
            return float(self.peak_sequences)
        area = sum((t1 - t0) * n0 for (t0, n0), (t1, _) in zip(points, points[1:]))
        return area / (points[-1][0] - points[0][0])

    @property
    def output_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.records)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.makespan_s

    @property
    def ttft_median_s(self) -> float:
        return statistics.median(r.first_token - r.sent for r in self.records if r.first_token is not None)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller workload")
    parser.add_argument("--write-docs", action="store_true",
                        help=f"write {PLOT_PATH.relative_to(REPO_ROOT)} and this script's section of "
                             f"{DOCS.path.relative_to(REPO_ROOT)}")
    parser.add_argument("--deploy-timeout", type=float, default=300.0, help="seconds to wait for each deploy")
    return parser.parse_args(argv)


def say(line: str) -> None:
    print(f"[admission] {line}", flush=True)


# ---- stop strings from an offline greedy run -----------------------------------------------------------------------

def plan_stops(model_dir: Path, candidates: list[list[int]],
               workload: Workload) -> tuple[list[list[int]], list[StopPlan]]:
    """Greedy text of every candidate prompt (offline, tp=1); then, per target stop position, a prompt whose text
    is still new there (the random-weight model's greedy text often falls into a loop, after which every substring
    has occurred before) and a stop string at that position. Returns the burst's prompts and their plans."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from engine.tokenizer import IncrementalDetokenizer

    horizon = workload.stop_last + 64
    say(f"offline greedy run (engine.llm.LLM, tp=1): {len(candidates)} candidate prompts x {horizon} tokens, to "
        f"pick stop strings")
    start = time.monotonic()
    with LLM(model_dir, dtype="float32", block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN) as llm:
        outputs = llm.generate(prompt_token_ids=candidates,
                               sampling_params=SamplingParams(temperature=0, max_tokens=horizon, ignore_eos=True))
        tokenizer = llm.tokenizer
    say(f"offline run done in {time.monotonic() - start:.0f}s")

    def stop_at(prompt: list[int], token_ids: list[int], target: int) -> StopPlan | None:
        detok = IncrementalDetokenizer(tokenizer, prompt)
        lengths = []  # text length after each output token
        for token in token_ids:
            detok.push(token)
            lengths.append(len(detok.text))
        text = detok.text
        for pos in range(lengths[target - 1], len(text)):  # from the text the target-th token completes
            for k in (3, 4, 2):
                stop = text[pos:pos + k]
                if len(stop) == k and stop.strip() and "\ufffd" not in stop and text.find(stop) == pos:
                    tokens = next(t + 1 for t, n in enumerate(lengths) if n >= pos + k)
                    if tokens > target + 16:
                        return None  # the text is no longer new there
                    return StopPlan(stop, pos, text[:pos], tokens)
        return None

    targets = workload.stop_positions()
    chosen: dict[int, tuple[list[int], StopPlan]] = {}
    unused = list(range(len(candidates)))
    for i in sorted(range(len(targets)), key=lambda i: -targets[i]):  # the longest first: they are the hardest
        for c in unused:
            plan = stop_at(candidates[c], list(outputs[c].outputs[0].token_ids), targets[i])
            if plan is not None:
                chosen[i] = (candidates[c], plan)
                unused.remove(c)
                break
        else:
            raise SystemExit(f"no candidate prompt's greedy text is still new after {targets[i]} tokens: "
                             f"raise the number of candidates")
    return [chosen[i][0] for i in range(len(targets))], [chosen[i][1] for i in range(len(targets))]


# ---- the cluster ----------------------------------------------------------------------------------------------------

def kv_budget_bytes(model: ModelConfig, workload: Workload) -> int:
    """Per-rank KV bytes in which "full" holds exactly `full_sequences` requests (one page per rank = one logical
    block of BLOCK_SIZE * DCP tokens)."""
    import torch

    pages = workload.full_sequences * workload.reserved_blocks
    return pages * BLOCK_SIZE * model.kv_bytes_per_token_per_rank(TP, torch.float32)


def app_config(policy: str, budget_bytes: int, workload: Workload) -> dict[str, Any]:
    args = {
        "model": "filled in by local_cluster.write_config",
        "served_model_name": MODEL_NAME,
        "tensor_parallel_size": TP,
        "decode_context_parallel_size": DCP,
        "dtype": "float32",
        "block_size": BLOCK_SIZE,
        "kv_cache_memory_bytes": budget_bytes,
        "max_model_len": MAX_MODEL_LEN,
        "admission": policy,  # kv_headroom: the default (0.05)
        "max_queued_requests": workload.num_requests,  # the whole burst may wait: nothing is refused
        "queue_timeout_s": 900,
        "routing_stats_period_s": 0.5,
        "kv_report_period_s": 0.25,
        "autoscaling": {"min_replicas": 1, "max_replicas": 1},  # one replica = the 4 logical GPUs
    }
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": 8000},
        "applications": [{"name": "dcpserve", "route_prefix": "/", "import_path": "deployments.app:build_app",
                          "args": args}],
    }


def scrape_counters(ray_temp: Path, replica_id: str) -> dict[str, float] | None:
    """dcpserve_preemptions and dcpserve_recomputed_tokens of this replica, from the Ray node's Prometheus
    endpoint (found through the service-discovery file Ray writes); None if it cannot be read."""
    files = sorted(ray_temp.glob("**/prom_metrics_service_discovery.json"))
    if not files:
        return None
    totals: dict[str, float] = {}
    found = False
    for entry in json.loads(files[-1].read_text()):
        for target in entry.get("targets", []):
            try:
                body = urllib.request.urlopen(f"http://{target}/metrics", timeout=10).read().decode()
            except OSError:
                continue
            for line in body.splitlines():
                match = re.match(r"^\w*(dcpserve_preemptions|dcpserve_recomputed_tokens)\w*\{([^}]*)\}\s+(\S+)$",
                                 line)
                if match and f'replica="{replica_id}"' in match.group(2):
                    found = True
                    totals[match.group(1)] = totals.get(match.group(1), 0.0) + float(match.group(3))
    return totals if found else None


# ---- the workload ---------------------------------------------------------------------------------------------------

async def run_burst(base_url: str, prompts: list[list[int]], plans: list[StopPlan], workload: Workload,
                    result: PolicyResult) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=900)
    start = time.perf_counter()
    done = asyncio.Event()
    finished = 0

    async def one(prompt: list[int], plan: StopPlan) -> RequestRecord:
        nonlocal finished
        record = RequestRecord(sent=time.perf_counter() - start)
        parts = []
        try:
            stream = await client.completions.create(
                model=MODEL_NAME, prompt=prompt, max_tokens=workload.max_tokens, temperature=0, stop=[plan.stop],
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )
            async with stream:
                async for chunk in stream:
                    now = time.perf_counter() - start
                    if chunk.choices:
                        choice = chunk.choices[0]
                        parts.append(choice.text or "")
                        record.finish_reason = choice.finish_reason or record.finish_reason
                        record.first_token = record.first_token if record.first_token is not None else now
                        record.last_token = now
                    if chunk.usage is not None:
                        record.completion_tokens = chunk.usage.completion_tokens
        except Exception as err:  # noqa: BLE001 - counted and reported
            record.error = repr(err)
        record.text = "".join(parts)
        finished += 1
        return record

    async def watch() -> None:
        last_said = 0.0
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
            while not done.is_set():
                health = (await http.get("/health")).json()
                granted = sum(r["num_grants"] for r in health.get("replicas", {}).values())
                now = time.perf_counter() - start
                result.timeline.append((now, granted))
                if now - last_said >= 15:
                    say(f"{result.policy}: {now:.0f}s, {finished}/{len(prompts)} done, {granted} granted, "
                        f"{health.get('queued', '?')} queued")
                    last_said = now
                await asyncio.sleep(HEALTH_PERIOD_S)

    watcher = asyncio.create_task(watch())
    try:
        result.records = list(await asyncio.gather(*(one(p, s) for p, s in zip(prompts, plans))))
        result.makespan_s = time.perf_counter() - start
    finally:
        done.set()
        await watcher
        await client.close()


def measure_policy(policy: str, settings: local_cluster.LocalSettings, env: dict[str, str],
                   head: subprocess.Popen[bytes], model_dir: Path, budget_bytes: int, workload: Workload,
                   prompts: list[list[int]], plans: list[StopPlan]) -> PolicyResult:
    say(f"{policy}: deploying one replica of tp={TP} x dcp={DCP}, admission={policy}")
    config = app_config(policy, budget_bytes, workload)
    deploy_s = deploy(settings, env, head, model_dir, config, f"-{policy}")  # type: ignore[arg-type]
    base_url = f"http://127.0.0.1:{settings.http_port}"
    replicas = httpx.get(f"{base_url}/health", timeout=30).json()["replicas"]
    if len(replicas) != 1:
        raise SystemExit(f"{policy}: expected one engine replica, /health lists {replicas}")
    replica_id, info = next(iter(replicas.items()))
    result = PolicyResult(policy, info["capacity"], deploy_s)
    fits = result.capacity_blocks // workload.reserved_blocks
    if fits != workload.full_sequences:
        raise SystemExit(f"{policy}: the replica holds {fits} reservations of {workload.reserved_blocks} blocks, "
                         f"the budget was sized for {workload.full_sequences}")
    say(f"{policy}: KV {result.capacity_blocks} blocks = {result.capacity_blocks * TOKENS_PER_BLOCK} tokens "
        f"({fits} full reservations); sending {workload.num_requests} requests at once")
    asyncio.run(run_burst(base_url, prompts, plans, workload, result))
    say(f"{policy}: {result.output_tokens_per_s:.1f} output tok/s, peak {result.peak_sequences} granted, "
        f"makespan {result.makespan_s:.1f}s, {result.errors} errors")
    say(f"{policy}: waiting {METRICS_WAIT_S:.0f}s for Ray to export the replica's preemption counter")
    time.sleep(METRICS_WAIT_S)
    try:
        counters = scrape_counters(settings.state_dir / "ray", replica_id)
    except Exception as err:  # noqa: BLE001 - reported, not invented
        counters, result.metrics_note = None, f"metrics endpoint unreadable: {err!r}"
    if counters is not None:
        result.preemptions = int(counters.get("dcpserve_preemptions", 0))
        result.recomputed_tokens = int(counters.get("dcpserve_recomputed_tokens", 0))
    elif not result.metrics_note:
        result.metrics_note = f"no dcpserve_preemptions series for replica {replica_id} on the node's metrics endpoint"
    shutdown_serve(settings, env)
    return result


# ---- output ---------------------------------------------------------------------------------------------------------

def written_fraction(result: PolicyResult, workload: Workload) -> float:
    """Mean over requests of (prompt + output tokens actually written) / (prompt + max_tokens) = what "full"
    reserves (token count; its block-rounded reservation is slightly larger still)."""
    promised = workload.prompt_tokens + workload.max_tokens
    return statistics.mean((workload.prompt_tokens + r.completion_tokens) / promised for r in result.records)


def table_rows(results: list[PolicyResult], workload: Workload,
               plans: list[StopPlan]) -> list[tuple[str, str, str, str]]:
    """(metric, full, usage, usage / full) rows; concurrency and output tokens/s in bold."""
    full, usage = results

    def row(metric: str, value: Any, fmt: str, ratio: bool = True) -> tuple[str, str, str, str]:
        a, b = value(full), value(usage)
        cells = [format(v, fmt) if isinstance(v, (int, float)) else str(v) for v in (a, b)]
        return metric, cells[0], cells[1], (f"{b / a:.2f}x" if ratio and isinstance(a, (int, float)) and a else "-")

    same = sum(a.text == b.text and a.completion_tokens == b.completion_tokens
               for a, b in zip(full.records, usage.records))

    def preemptions(r: PolicyResult) -> str:
        return "n/a" if r.preemptions is None else f"{r.preemptions} ({r.recomputed_tokens:,} tokens recomputed)"

    rows = [
        row("peak concurrent sequences (admission grants)", lambda r: r.peak_sequences, "d"),
        row("mean concurrent sequences over the burst", lambda r: r.mean_sequences, ".1f"),
        row("output tokens/s", lambda r: r.output_tokens_per_s, ".1f"),
        row("burst wall time (s)", lambda r: r.makespan_s, ".1f"),
        row("TTFT median (s, admission wait included)", lambda r: r.ttft_median_s, ".2f"),
        row("output tokens", lambda r: r.output_tokens, ",", ratio=False),
        row("errors", lambda r: r.errors, "d", ratio=False),
        row("KV written / reserved by full (mean per request)", lambda r: written_fraction(r, workload), ".1%",
            ratio=False),
        row("preemptions (replica counter)", preemptions, "", ratio=False),
        row("outputs equal to the offline greedy text", lambda r: sum(
            rec.text == p.expected_text for rec, p in zip(r.records, plans)), "d", ratio=False),
        ("greedy outputs identical, full vs usage (text and tokens)", "", "", f"{same}/{len(full.records)}"),
    ]
    for i in (0, 2):
        rows[i] = tuple(f"**{cell}**" for cell in rows[i])  # type: ignore[assignment]
    return rows


def console_table(rows: list[tuple[str, str, str, str]]) -> str:
    header = ("metric", "full", "usage", "usage / full")
    lines = [header] + [tuple(cell.replace("**", "") for cell in row) for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in
                               enumerate(zip(line, widths))) for line in lines)


def write_plot(results: list[PolicyResult], workload: Workload, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"full": "tab:gray", "usage": "tab:blue"}
    fig, (timeline, bars) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    for result in results:
        timeline.step([t for t, _ in result.timeline], [n for _, n in result.timeline], where="post",
                      color=colors[result.policy], label=f"admission={result.policy} "
                      f"({result.makespan_s:.0f}s, peak {result.peak_sequences})")
    timeline.axhline(workload.full_sequences, color=colors["full"], linestyle=":", linewidth=1)
    timeline.set_xlabel("seconds since the burst")
    timeline.set_ylabel("sequences granted (in the engine)")
    timeline.set_title(f"{workload.num_requests} requests: {workload.prompt_tokens}-token prompts, max_tokens "
                       f"{workload.max_tokens}, stop after {workload.stop_first}-{workload.stop_last} tokens",
                       fontsize=9)
    timeline.legend(loc="upper right")
    labels = [r.policy for r in results]
    values = [r.output_tokens_per_s for r in results]
    bars.bar(labels, values, color=[colors[r.policy] for r in results])
    for x, value in enumerate(values):
        bars.annotate(f"{value:.0f}", (x, value), ha="center", va="bottom")
    bars.set_ylabel("output tokens/s")
    bars.set_title(f"throughput: {values[1] / values[0]:.2f}x")
    fig.suptitle(f"Same KV budget, admission full vs usage, tp={TP} x dcp={DCP} (CPU, 4 logical GPUs)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def header_lines(workload: Workload, model: ModelConfig, budget_bytes: int, results: list[PolicyResult]) -> list[str]:
    import openai
    import ray
    import torch

    cores = len(os.sched_getaffinity(0))
    capacity = results[0].capacity_blocks
    notes = [r.metrics_note for r in results if r.metrics_note]
    return [
        f"CPU RUN on {cores} cores with {NUM_GPUS} logical GPUs: the tp={TP} ranks are CPU actors sharing those cores "
        f"(with the Ray head, Serve and this client). Per-step cost is dominated by fixed gloo / Ray overhead, so "
        f"throughput tracks how many sequences each step batches; the admission and concurrency numbers are exact",
        f"model: the tiny model (engine.tiny_model), float32, {model.kv_bytes_per_token_per_rank(TP, torch.float32)} "
        f"KV bytes per token per rank before DCP sharding",
        f"layout: one replica (autoscaling min = max = 1) of tp={TP} x dcp={DCP}, block_size {BLOCK_SIZE} (a logical "
        f"block is {TOKENS_PER_BLOCK} tokens), max_model_len {MAX_MODEL_LEN}; per-rank KV budget {budget_bytes:,} "
        f"bytes = {capacity} logical blocks = {capacity * TOKENS_PER_BLOCK:,} tokens, sized so \"full\" holds "
        f"{workload.full_sequences} reservations of {workload.reserved_blocks} blocks (prompt + max_tokens); "
        f"\"usage\" with the default kv_headroom 0.05",
        f"workload: a burst of {workload.num_requests} requests at once, random prompt ids (seed {workload.seed}) of "
        f"{workload.prompt_tokens} tokens (chosen among {CANDIDATES_PER_REQUEST}x as many random prompts: those "
        f"whose greedy text has not fallen into a loop by the request's stop position), max_tokens {workload.max_tokens}, greedy (temperature 0), ignore_eos, "
        f"streamed through the deployed app with the openai client; request i stops on a 2-4 character stop string "
        f"chosen from an offline greedy run (engine.llm.LLM, tp=1) so that it ends after "
        f"{workload.stop_first}-{workload.stop_last} output tokens (spread evenly, shuffled)",
        "concurrent sequences: the admission queue's grants (num_grants in /health) every "
        f"{HEALTH_PERIOD_S}s; under \"usage\" a granted request may be preempted inside the engine (waiting to be "
        "recomputed), so grants are an upper bound on the running sequences there; output tokens/s = all output "
        "tokens / time from the burst to the last token",
        "KV written / reserved: per request (prompt + output tokens it actually produced) / (prompt + max_tokens), "
        "the tokens \"full\" reserves for it, averaged; the same for both policies since outputs are identical",
        "preemptions: the replica's dcpserve_preemptions and dcpserve_recomputed_tokens counters, read from the Ray "
        f"node's Prometheus endpoint {METRICS_WAIT_S:.0f}s after the burst (Ray exports every 10s)"
        + (f"; not available: {'; '.join(notes)}" if notes else ""),
        "deploy time (not measured above): " + ", ".join(f"{r.policy} {r.deploy_s:.0f}s" for r in results),
        f"torch {torch.__version__}, ray {ray.__version__}, openai {openai.__version__}, python "
        f"{platform.python_version()}, date {datetime.datetime.now().isoformat(timespec='seconds')}",
    ]


def markdown_section(command: str, info: list[str], rows: list[tuple[str, str, str, str]], headline: str) -> str:
    plot = PLOT_PATH.relative_to(DOCS.path.parent).as_posix()
    table = ["| metric | full | usage | usage / full |", "|:---|---:|---:|---:|"]
    table += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join([
        "## Admission policies: full reservation vs usage-based admission with preemption", "",
        f"Command: `{command}`", "", headline, "", *table, "", f"![admission full vs usage]({plot})", "",
        *[f"- {line}" for line in info],
    ])


# ---- main -----------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    DOCS.check()  # unpaired markers fail now, not after the run
    workload = WORKLOADS[args.quick]
    if workload.num_requests <= workload.full_sequences:
        raise SystemExit("the burst must exceed what \"full\" holds, or nothing queues")
    started = time.monotonic()
    # Ray's socket paths must stay short: the state (model, token, logs) in a directory directly under /tmp.
    state = Path(tempfile.mkdtemp(prefix="dcpadm-", dir="/tmp"))
    say(f"state and Ray logs under {state}")
    head = None
    try:
        model_dir = write_tiny_model(state / "tiny-model")
        model = ModelConfig.from_pretrained(model_dir)
        budget_bytes = kv_budget_bytes(model, workload)
        prompts, plans = plan_stops(model_dir, workload.prompts(model.vocab_size, CANDIDATES_PER_REQUEST), workload)
        say("stop positions (output tokens): " + ", ".join(str(p.expected_tokens) for p in plans))
        settings = local_cluster.LocalSettings(
            http_port=local_cluster.free_port(), ray_port=local_cluster.free_port(),
            dashboard_port=local_cluster.free_port(), num_gpus=NUM_GPUS, state_dir=state,
            config=state / "unused.yaml", deploy_timeout_s=args.deploy_timeout,
        )
        env = local_cluster.ray_env(state)
        head = local_cluster.start_head(settings, env, state / "ray")
        local_cluster.wait_for_dashboard(settings, head)
        results = [measure_policy(policy, settings, env, head, model_dir, budget_bytes, workload, prompts, plans)
                   for policy in POLICIES]
    finally:
        if head is not None:
            local_cluster.stop_head(head)
        if os.environ.get("DCPSERVE_BENCH_KEEP_STATE"):
            say(f"kept {state}")
        else:
            shutil.rmtree(state, ignore_errors=True)

    for result in results:
        for i, record in enumerate(result.records):
            if record.error is not None:
                say(f"{result.policy}: request {i} failed: {record.error}")
    for i, (a, b) in enumerate(zip(*(r.records for r in results))):
        if a.text != b.text or a.completion_tokens != b.completion_tokens:
            say(f"request {i}: outputs differ: full {a.completion_tokens} tokens {a.text[-40:]!r}, usage "
                f"{b.completion_tokens} tokens {b.text[-40:]!r}")

    rows = table_rows(results, workload, plans)
    full, usage = results
    headline = (f"**With the same KV budget, admission=usage runs {usage.peak_sequences / full.peak_sequences:.1f}x the "
                f"concurrent sequences of admission=full ({usage.peak_sequences} vs {full.peak_sequences}) and "
                f"serves {usage.output_tokens_per_s / full.output_tokens_per_s:.2f}x the output tokens/s**, with "
                f"{full.errors + usage.errors} errors; requests wrote on average "
                f"{written_fraction(full, workload):.0%} of the KV \"full\" reserved for them.")
    print()
    print(console_table(rows))
    print()
    print(headline.replace("**", ""))
    print(f"total {time.monotonic() - started:.0f}s")
    if args.write_docs:
        command = "python bench/admission.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                                     else sys.argv[1:]))
        write_plot(results, workload, PLOT_PATH)
        section = markdown_section(command.strip(), header_lines(workload, model, budget_bytes, results), rows,
                                   headline)
        # Read-modify-write in one go: other benchmarks write their own sections of the same file.
        DOCS.write(section)
        say(f"updated {DOCS.path.relative_to(REPO_ROOT)} and {PLOT_PATH.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

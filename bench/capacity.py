"""The claim DCP exists for, measured through the deployed app: KV capacity and throughput of dcp=1 vs dcp=4.

Same machine, same per-rank KV memory, the tiny model (1 KV head) at tp=4 on a Ray head of this script's own with
4 logical GPUs (deployments/local_cluster.py, as `make serve`). For each of dcp=1 and dcp=4 it `serve deploy`s
one replica, sends the same long-context burst through the OpenAI API (official `openai` async client,
streaming), polls /health for the sequences the admission queue has granted (= sequences in the engine, which
reserves prompt + max_tokens up front), then shuts Serve down before the next layout. The per-rank KV budget is
sized so that dcp=1 holds only a few of the sequences: the burst queues in the admission FIFO, and dcp=4, which
keeps each token on one rank instead of on all four, holds 4x as many.

    python bench/capacity.py                 # full run (console only)
    python bench/capacity.py --write-docs    # also writes docs/img/capacity.png and its section of docs/benchmarks.md
    python bench/capacity.py --quick         # a shorter workload
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import os
import platform
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
# Running `python bench/capacity.py` puts bench/ first on sys.path, where bench/engine.py would shadow the
# `engine` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.docs_section import DocsSection  # noqa: E402
import httpx  # noqa: E402
import yaml  # noqa: E402

from deployments import local_cluster  # noqa: E402
from engine.block_manager import blocks_needed  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.tiny_model import write_tiny_model  # noqa: E402

TP, DCPS, BLOCK_SIZE, NUM_GPUS = 4, (1, 4), 16, 4
MODEL_NAME = "dcpserve-tiny"
# quick -> (prompt tokens, max_tokens, requests in the burst, sequences dcp=1 holds)
WORKLOADS = {False: (1536, 128, 16, 2), True: (960, 64, 8, 2)}
HEALTH_PERIOD_S = 0.2
PLOT_PATH = REPO_ROOT / "docs" / "img" / "capacity.png"
DOCS = DocsSection("bench/capacity.py")


@dataclass(frozen=True)
class Workload:
    """The burst both layouts serve: `num_requests` distinct random prompts, greedy, ignore_eos."""

    prompt_tokens: int
    max_tokens: int
    num_requests: int
    dcp1_sequences: int  # what the per-rank budget is sized for: dcp=1 holds this many sequences at once
    seed: int = 0

    @property
    def sequence_tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens

    def prompts(self, vocab_size: int) -> list[list[int]]:
        rng = random.Random(self.seed)
        return [[rng.randrange(5, vocab_size) for _ in range(self.prompt_tokens)] for _ in range(self.num_requests)]


@dataclass
class RequestRecord:
    """One streamed request, times in seconds from the start of the burst."""

    sent: float
    first_token: float | None = None
    last_token: float | None = None
    completion_tokens: int = 0


@dataclass
class LayoutResult:
    """Everything measured for one layout."""

    dcp: int
    capacity_blocks: int
    tokens_per_block: int
    deploy_s: float
    records: list[RequestRecord] = field(default_factory=list)
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (s, sequences granted)
    makespan_s: float = 0.0

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_blocks * self.tokens_per_block

    def sequences_fit(self, workload: Workload) -> int:
        return self.capacity_blocks // blocks_needed(workload.sequence_tokens, self.tokens_per_block)

    @property
    def peak_sequences(self) -> int:
        return max((n for _, n in self.timeline), default=0)

    @property
    def output_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.records)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.makespan_s

    @property
    def ttft_median_s(self) -> float:
        return statistics.median(r.first_token - r.sent for r in self.records)

    @property
    def itl_median_s(self) -> float:
        # Per request: (last token - first token) / (tokens - 1), from stream arrival times. Chunks, not tokens,
        # arrive: the detokenizer holds back partial UTF-8, so a gap between chunks may span two tokens.
        return statistics.median((r.last_token - r.first_token) / (r.completion_tokens - 1) for r in self.records)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a shorter workload (about 2 minutes in all)")
    parser.add_argument("--write-docs", action="store_true",
                        help=f"write {PLOT_PATH.relative_to(REPO_ROOT)} and this script's section of "
                             f"{DOCS.path.relative_to(REPO_ROOT)}")
    parser.add_argument("--deploy-timeout", type=float, default=300.0, help="seconds to wait for each deploy")
    return parser.parse_args(argv)


def say(line: str) -> None:
    print(f"[capacity] {line}", flush=True)


# ---- the cluster ---------------------------------------------------------------------------------------------

def kv_budget_bytes(model: ModelConfig, workload: Workload) -> int:
    """Per-rank KV bytes in which dcp=1 holds exactly `dcp1_sequences` sequences (each rank keeps every token)."""
    import torch

    pages = workload.dcp1_sequences * blocks_needed(workload.sequence_tokens, BLOCK_SIZE)
    return pages * BLOCK_SIZE * model.kv_bytes_per_token_per_rank(TP, torch.float32)


def app_config(dcp: int, budget_bytes: int, workload: Workload) -> dict[str, Any]:
    args = {
        "model": "filled in by local_cluster.write_config",
        "served_model_name": MODEL_NAME,
        "tensor_parallel_size": TP,
        "decode_context_parallel_size": dcp,
        "dtype": "float32",
        "block_size": BLOCK_SIZE,
        "kv_cache_memory_bytes": budget_bytes,
        "max_model_len": workload.sequence_tokens,
        "admission": "full",  # concurrency = sequences whose whole prompt + max_tokens fits: the capacity claim
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


def deploy(settings: local_cluster.LocalSettings, env: dict[str, str], head: subprocess.Popen[bytes],
           model_dir: Path, config: dict[str, Any], dcp: int) -> float:
    path = settings.state_dir / f"serve_config.dcp{dcp}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    start = time.monotonic()
    layout = dataclasses.replace(settings, config=path)
    local_cluster.deploy_and_wait(layout, env, local_cluster.write_config(layout, model_dir), head)
    return time.monotonic() - start


def shutdown_serve(settings: local_cluster.LocalSettings, env: dict[str, str], timeout_s: float = 120) -> None:
    """`serve shutdown`, then waits until no application is left (its replicas' GPUs are free again)."""
    address = f"http://127.0.0.1:{settings.dashboard_port}"
    subprocess.run([local_cluster.ray_bin("serve"), "shutdown", "-y", "--address", address], env=env, check=True,
                   capture_output=True, timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while local_cluster.serve_status(settings, env).get("applications"):
        if time.monotonic() > deadline:
            raise SystemExit(f"Serve still lists applications {timeout_s:.0f}s after `serve shutdown`")
        time.sleep(1)


# ---- the workload ----------------------------------------------------------------------------------------------

async def run_burst(base_url: str, prompts: list[list[int]], workload: Workload,
                    result: LayoutResult) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=900)
    start = time.perf_counter()
    done = asyncio.Event()

    async def one(prompt: list[int]) -> RequestRecord:
        record = RequestRecord(sent=time.perf_counter() - start)
        stream = await client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=workload.max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        async with stream:
            async for chunk in stream:
                now = time.perf_counter() - start
                if chunk.choices:
                    record.first_token = record.first_token if record.first_token is not None else now
                    record.last_token = now
                if chunk.usage is not None:
                    record.completion_tokens = chunk.usage.completion_tokens
        return record

    async def watch() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
            while not done.is_set():
                health = (await http.get("/health")).json()
                granted = sum(r["num_grants"] for r in health.get("replicas", {}).values())
                result.timeline.append((time.perf_counter() - start, granted))
                await asyncio.sleep(HEALTH_PERIOD_S)

    watcher = asyncio.create_task(watch())
    try:
        result.records = list(await asyncio.gather(*(one(p) for p in prompts)))
        result.makespan_s = time.perf_counter() - start
    finally:
        done.set()
        await watcher
        await client.close()
    short = [r for r in result.records if r.completion_tokens != workload.max_tokens or r.first_token is None]
    if short:
        raise SystemExit(f"dcp={result.dcp}: {len(short)} requests did not stream {workload.max_tokens} tokens")


def measure_layout(dcp: int, settings: local_cluster.LocalSettings, env: dict[str, str],
                   head: subprocess.Popen[bytes], model_dir: Path, budget_bytes: int, workload: Workload,
                   prompts: list[list[int]]) -> LayoutResult:
    say(f"dcp={dcp}: deploying tp={TP} x dcp={dcp}")
    deploy_s = deploy(settings, env, head, model_dir, app_config(dcp, budget_bytes, workload), dcp)
    base_url = f"http://127.0.0.1:{settings.http_port}"
    replicas = httpx.get(f"{base_url}/health", timeout=30).json()["replicas"]
    if len(replicas) != 1:
        raise SystemExit(f"dcp={dcp}: expected one engine replica, /health lists {replicas}")
    capacity_blocks = next(iter(replicas.values()))["capacity"]
    result = LayoutResult(dcp, capacity_blocks, BLOCK_SIZE * dcp, deploy_s)
    expected = workload.dcp1_sequences * dcp
    if result.sequences_fit(workload) != expected:
        raise SystemExit(f"dcp={dcp}: the replica holds {result.sequences_fit(workload)} sequences of "
                         f"{workload.sequence_tokens} tokens, the budget was sized for {expected}")
    say(f"dcp={dcp}: KV {result.capacity_tokens} tokens = {result.sequences_fit(workload)} sequences of "
        f"{workload.sequence_tokens}; sending {workload.num_requests} requests")
    asyncio.run(run_burst(base_url, prompts, workload, result))
    say(f"dcp={dcp}: {result.output_tokens_per_s:.1f} output tok/s, peak {result.peak_sequences} sequences, "
        f"makespan {result.makespan_s:.1f}s")
    shutdown_serve(settings, env)
    return result


# ---- output ------------------------------------------------------------------------------------------------------

def table_rows(results: list[LayoutResult], workload: Workload) -> list[tuple[str, str, str, str]]:
    """(metric, dcp=1, dcp=4, dcp=4 / dcp=1) rows; the output tokens/s row is the headline, in bold."""
    base, sharded = results

    def row(metric: str, value: Any, fmt: str) -> tuple[str, str, str, str]:
        a, b = value(base), value(sharded)
        return metric, format(a, fmt), format(b, fmt), f"{b / a:.2f}x" if a else "-"

    rows = [
        row("KV capacity (tokens per replica)", lambda r: r.capacity_tokens, ","),
        row(f"sequences that fit ({workload.sequence_tokens} tokens each)", lambda r: r.sequences_fit(workload), "d"),
        row("peak concurrent sequences", lambda r: r.peak_sequences, "d"),
        row("output tokens/s", lambda r: r.output_tokens_per_s, ".1f"),
        row("TTFT median (s, admission wait included)", lambda r: r.ttft_median_s, ".2f"),
        row("ITL median (ms)", lambda r: r.itl_median_s * 1e3, ".1f"),
        row("burst makespan (s)", lambda r: r.makespan_s, ".1f"),
    ]
    rows[3] = tuple(f"**{cell}**" for cell in rows[3])  # type: ignore[assignment]
    return rows


def console_table(rows: list[tuple[str, str, str, str]]) -> str:
    header = ("metric", "dcp=1", "dcp=4", "dcp=4 / dcp=1")
    lines = [header] + [tuple(cell.replace("**", "") for cell in row) for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in
                               enumerate(zip(line, widths))) for line in lines)


def write_plot(results: list[LayoutResult], workload: Workload, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {1: "tab:gray", 4: "tab:blue"}
    fig, (timeline, bars) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    for result in results:
        times = [t for t, _ in result.timeline]
        counts = [n for _, n in result.timeline]
        timeline.step(times, counts, where="post", color=colors[result.dcp],
                      label=f"dcp={result.dcp} ({result.capacity_tokens:,} KV tokens)")
        timeline.axhline(result.sequences_fit(workload), color=colors[result.dcp], linestyle=":", linewidth=1)
    timeline.set_xlabel("seconds since the burst")
    timeline.set_ylabel("sequences in the engine")
    timeline.set_title(f"{workload.num_requests} requests of {workload.prompt_tokens} + {workload.max_tokens} tokens, "
                       f"tp={TP}")
    timeline.legend(loc="upper right")
    labels = [f"dcp={r.dcp}" for r in results]
    values = [r.output_tokens_per_s for r in results]
    bars.bar(labels, values, color=[colors[r.dcp] for r in results])
    for x, value in enumerate(values):
        bars.annotate(f"{value:.0f}", (x, value), ha="center", va="bottom")
    bars.set_ylabel("output tokens/s")
    bars.set_title(f"throughput: {values[1] / values[0]:.2f}x")
    fig.suptitle("Same per-rank KV memory, 1 KV head, tp=4 (CPU, 4 logical GPUs)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def header_lines(workload: Workload, model: ModelConfig, budget_bytes: int, results: list[LayoutResult]) -> list[str]:
    import openai
    import ray
    import torch

    cores = len(os.sched_getaffinity(0))
    return [
        f"CPU RUN on {cores} cores with {NUM_GPUS} logical GPUs: the tp={TP} ranks are CPU actors sharing those cores "
        f"(and, on this machine, shared with other jobs), so all ranks compete for the same compute. The throughput "
        f"ratio here mostly reflects admission and batching (how many sequences are in flight per step, since the "
        f"per-step cost is dominated by fixed gloo / Ray overhead), not GPU memory bandwidth; the KV capacity and "
        f"sequence counts are exact and hold on GPUs too. vLLM reports up to ~3x output tokens/s with DCP on GPUs",
        f"model: the tiny model (engine.tiny_model): {model.num_hidden_layers} layers, {model.num_attention_heads} "
        f"query heads, {model.num_key_value_heads} KV head, head_dim {model.head_dim}, float32; "
        f"{model.kv_bytes_per_token_per_rank(TP, torch.float32)} KV bytes per token on a rank",
        f"layout: one replica of tp={TP} (the 4 logical GPUs), dcp=1 vs dcp=4, block_size {BLOCK_SIZE}; the same "
        f"per-rank KV budget {budget_bytes:,} bytes (kv_cache_memory_bytes), sized so dcp=1 holds "
        f"{workload.dcp1_sequences} sequences: with dcp=1 each of the 4 ranks keeps a copy of the one KV head, with "
        f"dcp=4 each keeps a quarter of the tokens",
        f"workload: a burst of {workload.num_requests} requests at once, random prompt ids (seed {workload.seed}) of "
        f"{workload.prompt_tokens} tokens, {workload.max_tokens} output tokens each (greedy, ignore_eos), streamed "
        f"through the deployed app with the openai client; requests that do not fit wait in the admission FIFO",
        "peak concurrent sequences: the admission queue's grants (sequences in the engine: it reserves prompt + "
        f"max_tokens up front) from /health every {HEALTH_PERIOD_S}s; output tokens/s = all output tokens / time "
        "from the burst to the last token; TTFT from sending (admission wait included); ITL per request = (last "
        "token - first token) / (tokens - 1), median over requests",
        "noise: the two layouts run one after the other on a machine shared with other jobs, so load changes hit "
        "them differently; runs during development gave throughput ratios from 2.35x to 3.15x (the capacity and "
        "concurrency rows do not vary)",
        "deploy time (not measured above): " + ", ".join(f"dcp={r.dcp} {r.deploy_s:.0f}s" for r in results),
        f"torch {torch.__version__}, ray {ray.__version__}, openai {openai.__version__}, python "
        f"{platform.python_version()}, date {datetime.datetime.now().isoformat(timespec='seconds')}",
    ]


def markdown_section(command: str, info: list[str], rows: list[tuple[str, str, str, str]], headline: str) -> str:
    plot = PLOT_PATH.relative_to(DOCS.path.parent).as_posix()
    table = ["| metric | dcp=1 | dcp=4 | dcp=4 / dcp=1 |", "|:---|---:|---:|---:|"]
    table += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join([
        "## KV capacity and throughput: dcp=1 vs dcp=4 through the deployed app", "",
        f"Command: `{command}`", "", headline, "", *table, "", f"![dcp=1 vs dcp=4]({plot})", "",
        *[f"- {line}" for line in info],
    ])




# ---- main --------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    DOCS.check()  # unpaired markers fail now, not after the run
    workload = Workload(*WORKLOADS[args.quick])
    if workload.num_requests <= workload.dcp1_sequences:
        raise SystemExit("the burst must exceed what dcp=1 holds, or nothing queues")
    started = time.monotonic()
    # Ray's socket paths must stay short: the state (model, token, logs) in a directory directly under /tmp.
    state = Path(tempfile.mkdtemp(prefix="dcpcap-", dir="/tmp"))
    head = None
    try:
        model_dir = write_tiny_model(state / "tiny-model")
        model = ModelConfig.from_pretrained(model_dir)
        budget_bytes = kv_budget_bytes(model, workload)
        prompts = workload.prompts(model.vocab_size)
        settings = local_cluster.LocalSettings(
            http_port=local_cluster.free_port(), ray_port=local_cluster.free_port(),
            dashboard_port=local_cluster.free_port(), num_gpus=NUM_GPUS, state_dir=state,
            config=state / "unused.yaml", deploy_timeout_s=args.deploy_timeout,
        )
        env = local_cluster.ray_env(state)
        head = local_cluster.start_head(settings, env, state / "ray")
        local_cluster.wait_for_dashboard(settings, head)
        results = [measure_layout(dcp, settings, env, head, model_dir, budget_bytes, workload, prompts)
                   for dcp in DCPS]
    finally:
        if head is not None:
            local_cluster.stop_head(head)
        shutil.rmtree(state, ignore_errors=True)

    rows = table_rows(results, workload)
    ratio = results[1].output_tokens_per_s / results[0].output_tokens_per_s
    headline = (f"**dcp=4 serves {ratio:.2f}x the output tokens/s of dcp=1** with the same per-rank KV memory: "
                f"{results[1].capacity_tokens // results[0].capacity_tokens}x the KV tokens, so "
                f"{results[1].peak_sequences} sequences in flight instead of {results[0].peak_sequences}.")
    print()
    print(console_table(rows))
    print()
    print(headline.replace("**", ""))
    print(f"total {time.monotonic() - started:.0f}s")
    if args.write_docs:
        command = "python bench/capacity.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None
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

"""Two app configurations measured side by side through the deployed app: what the capacity and admission
benchmarks (bench/capacity.py, bench/admission.py) share.

Each of those benchmarks starts a Ray head of its own with 4 logical GPUs (dcpserve/local/serve.py, as `make
serve`), then for each of its two configurations `serve deploy`s one replica of the tiny model, sends the same burst
at once through the OpenAI API (official `openai` async client, streaming), polls /health for the sequences the
admission queue has granted, and shuts Serve down before the next configuration. This module holds that machinery,
the per-request records and the metrics derived from them, and the output: the two-column metric table (console and
markdown), the docs section and the plot's two panels (concurrency timeline, throughput bars). The benchmarks keep
their workload, their app settings and the metrics only their experiment has.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import yaml

from bench.harness.docs_section import DocsSection, bench_command
from dcpserve.engine.config import ModelConfig
from dcpserve.local import serve as local_serve
from dcpserve.local.tls import cluster_tls, tls_setting

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "dcpserve-tiny"
NUM_GPUS = 4  # logical GPUs on the Ray head: one replica takes them all
HEALTH_PERIOD_S = 0.2
PROGRESS_PERIOD_S = 15.0
COLORS = ("tab:gray", "tab:blue")  # the first configuration, the second

Row = tuple[str, str, str, str]  # (metric, first, second, second / first)


# ---- the records -----------------------------------------------------------------------------------------------

@dataclass
class RequestRecord:
    """One streamed request, times in seconds from the start of the burst."""

    sent: float
    first_token: float | None = None
    last_token: float | None = None
    completion_tokens: int = 0
    chunks: int = 0  # content chunks (those with choices): one per replica stream item that carried text or finished
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None

    @property
    def tokens_per_chunk(self) -> float | None:
        """Output tokens per content chunk: how many engine steps each SSE chunk (= each replica -> ingress stream
        item, bar the few that carried no text) spans."""
        return self.completion_tokens / self.chunks if self.chunks else None


@dataclass
class BurstResult:
    """One configuration's burst: its requests, the granted-sequences timeline, and what is derived from them."""

    label: str  # the configuration's column label, e.g. "dcp=4" or "usage"
    capacity_blocks: int  # the replica's KV capacity from /health
    deploy_s: float
    records: list[RequestRecord] = field(default_factory=list)
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (s, sequences granted)
    makespan_s: float = 0.0

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
        area = sum((t1 - t0) * n0 for (t0, n0), (t1, _) in itertools.pairwise(points))
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

    @property
    def itl_median_s(self) -> float:
        # Per request: (last token - first token) / (tokens - 1), from stream arrival times. Chunks, not tokens,
        # arrive: the detokenizer holds back partial UTF-8, so a gap between chunks may span two tokens.
        return statistics.median((r.last_token - r.first_token) / (r.completion_tokens - 1) for r in self.records
                                 if r.first_token is not None and r.last_token is not None and r.completion_tokens > 1)

    @property
    def tokens_per_chunk_median(self) -> float:
        """Median over requests of completion_tokens / content chunks."""
        return statistics.median(r.tokens_per_chunk for r in self.records if r.tokens_per_chunk is not None)


R = TypeVar("R", bound=BurstResult)


# ---- the cluster -------------------------------------------------------------------------------------------------

def kv_budget_bytes(model: ModelConfig, tp: int, block_size: int, pages: int) -> int:
    """Per-rank KV bytes (float32) that hold `pages` pages of `block_size` tokens."""
    import torch

    return pages * block_size * model.kv_bytes_per_token_per_rank(tp, torch.float32)


def app_config(tp: int, dcp: int, block_size: int, budget_bytes: int, max_model_len: int, admission: str,
               max_queued_requests: int, backend: str = "native",
               stream_interval_s: float | None = None) -> dict[str, Any]:
    """The Serve config of one replica (the 4 logical GPUs) of the tiny model, float32, with `budget_bytes` of KV
    per rank; requests wait in the admission FIFO up to `max_queued_requests`, and for up to 900 s. A
    `stream_interval_s` given sets the replica's (None: the app's default)."""
    args = {
        "model": "filled in by local_serve.write_config",
        "served_model_name": MODEL_NAME,
        "backend": backend,
        "tensor_parallel_size": tp,
        "decode_context_parallel_size": dcp,
        "dtype": "float32",
        "block_size": block_size,
        "kv_cache_memory_bytes": budget_bytes,
        "max_model_len": max_model_len,
        "admission": admission,
        "max_queued_requests": max_queued_requests,
        "queue_timeout_s": 900,
        "routing_stats_period_s": 0.5,
        "kv_report_period_s": 0.25,
        "autoscaling": {"min_replicas": 1, "max_replicas": 1},  # one replica = the 4 logical GPUs
    }
    if stream_interval_s is not None:
        args["stream_interval_s"] = stream_interval_s
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": 8000},
        "applications": [{"name": "dcpserve", "route_prefix": "/", "import_path": "dcpserve.deployments.app:build_app",
                          "args": args}],
    }


@contextlib.contextmanager
def state_dir(prefix: str, say: Callable[[str], None]) -> Iterator[Path]:
    """A fresh directory directly under /tmp (Ray's socket paths must stay short) for the model, token and logs;
    removed afterwards unless DCPSERVE_BENCH_KEEP_STATE is set."""
    state = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    say(f"state and Ray logs under {state}")
    try:
        yield state
    finally:
        if os.environ.get("DCPSERVE_BENCH_KEEP_STATE"):
            say(f"kept {state}")
        else:
            shutil.rmtree(state, ignore_errors=True)


@dataclass(frozen=True)
class ServeHead:
    """A Ray head of this process's own with NUM_GPUS logical GPUs, on which one app at a time is deployed."""

    settings: local_serve.LocalSettings
    env: dict[str, str]
    head: subprocess.Popen[bytes]

    @property
    def api(self) -> local_serve.ServeApi:
        return local_serve.ServeApi(self.settings.dashboard_port, Path(self.env["RAY_AUTH_TOKEN_PATH"]))

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.http_port}"

    def deploy(self, model_dir: Path, config: dict[str, Any], label: str) -> float:
        """`serve deploy`s `config` (written as serve_config.{label}.yaml) and waits until it runs; seconds taken."""
        path = self.settings.state_dir / f"serve_config.{label}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        start = time.monotonic()
        settings = dataclasses.replace(self.settings, config=path)
        local_serve.deploy_and_wait(settings, self.env, local_serve.write_config(settings, model_dir), self.head)
        return time.monotonic() - start

    def replica(self, label: str) -> tuple[str, dict[str, Any]]:
        """The one engine replica's id (Serve's REST API) and its KV counts from /health (capacity, num_grants):
        /health itself names no replica."""
        counts = httpx.get(f"{self.base_url}/health", timeout=30).json()
        app = self.api.application("dcpserve")
        replicas = [r for r in app["deployments"]["EngineReplica"]["replicas"] if r["state"] == "RUNNING"]
        if len(replicas) != 1 or counts.get("replicas") != 1:
            raise SystemExit(f"{label}: expected one engine replica; Serve lists {len(replicas)}, /health {counts}")
        return replicas[0]["replica_id"], {"capacity": counts["kv_capacity_blocks"], "num_grants": counts["num_grants"]}

    def serve_stats(self, deployment: str, method: str, calls: int) -> list[dict[str, Any]]:
        """`method`'s answers (typed messages, dcpserve/deployments/messages.py) from the deployment through Serve
        handles, in a driver of its own (this process never joins the cluster), as plain data (dataclasses.asdict);
        calls > 1: that many calls, e.g. until every replica answered (told apart by replica_id)."""
        script = (
            "import dataclasses, json, ray; from ray import serve; "
            f"ray.init(address='127.0.0.1:{self.settings.ray_port}', log_to_driver=False); "
            f"h = serve.get_deployment_handle({deployment!r}, app_name='dcpserve'); "
            f"print('STATS' + json.dumps([dataclasses.asdict(getattr(h, {method!r}).remote().result(timeout_s=60)) "
            f"for _ in range({calls})]))"
        )
        result = subprocess.run([sys.executable, "-c", script], env=self.env, capture_output=True, text=True,
                                timeout=300, cwd=REPO_ROOT)
        line = next((x for x in result.stdout.splitlines() if x.startswith("STATS")), None)
        if line is None:
            raise SystemExit(f"could not read {deployment}.{method}: {result.stderr[-2000:]}")
        return json.loads(line[len("STATS"):])

    def shutdown_serve(self, timeout_s: float = 120) -> None:
        """`serve shutdown`, then waits until no application is left (its replicas' GPUs are free again)."""
        address = f"http://127.0.0.1:{self.settings.dashboard_port}"
        subprocess.run([local_serve.ray_bin("serve"), "shutdown", "-y", "--address", address], env=self.env,
                       check=True, capture_output=True, timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        while self.api.details().get("applications"):
            if time.monotonic() > deadline:
                raise SystemExit(f"Serve still lists applications {timeout_s:.0f}s after `serve shutdown`")
            time.sleep(1)


@contextlib.contextmanager
def serve_head(state: Path, deploy_timeout_s: float, tls: bool | None = None) -> Iterator[ServeHead]:
    """Starts a Ray head on free ports with its state under `state`, and stops it afterwards. tls: Ray's mutual TLS
    with a CA of its own (None: as DCPSERVE_TLS says). This process never joins it, so one run can start heads with
    and without TLS (bench/tls.py)."""
    http_port, ray_port, dashboard_port = local_serve.free_ports(3)
    settings = local_serve.LocalSettings(
        http_port=http_port, ray_port=ray_port, dashboard_port=dashboard_port, num_gpus=NUM_GPUS, state_dir=state,
        config=state / "unused.yaml", deploy_timeout_s=deploy_timeout_s,
        tls=tls_setting() if tls is None else tls,
    )
    env = local_serve.ray_env(state, cluster_tls(state, settings.tls, local_serve.say))
    head = local_serve.start_head(settings, env, state / "ray")
    try:
        local_serve.wait_for_dashboard(settings, head)
        yield ServeHead(settings, env, head)
    finally:
        local_serve.stop_head(head)


# ---- the burst ---------------------------------------------------------------------------------------------------

async def run_burst(base_url: str, prompts: list[list[int]], max_tokens: int, result: BurstResult,
                    stops: list[str] | None = None, progress: Callable[[str], None] | None = None,
                    seeds: list[int] | None = None) -> None:
    """Sends every prompt at once (greedy, ignore_eos, streamed; request i cut at `stops[i]` if given; with `seeds`,
    request i sampled at temperature 1 with seeds[i] and ended by EOS or max_tokens) and fills `result`'s records,
    makespan and the /health timeline of granted sequences. A request that fails is recorded with its error.
    `progress`, if given, hears how the burst goes every PROGRESS_PERIOD_S."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=900)
    start = time.perf_counter()
    done = asyncio.Event()
    finished = 0

    async def one(prompt: list[int], stop: str | None, seed: int | None) -> RequestRecord:
        nonlocal finished
        record = RequestRecord(sent=time.perf_counter() - start)
        parts = []
        sampling: dict[str, Any] = ({"temperature": 0, "extra_body": {"ignore_eos": True}} if seed is None
                                    else {"temperature": 1.0, "seed": seed})
        try:
            stream = await client.completions.create(
                model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, stop=[stop] if stop is not None else None,
                stream=True, stream_options={"include_usage": True}, **sampling,
            )
            async with stream:
                async for chunk in stream:
                    now = time.perf_counter() - start
                    if chunk.choices:
                        record.chunks += 1
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
                granted = health.get("num_grants", 0)
                now = time.perf_counter() - start
                result.timeline.append((now, granted))
                if progress is not None and now - last_said >= PROGRESS_PERIOD_S:
                    progress(f"{result.label}: {now:.0f}s, {finished}/{len(prompts)} done, {granted} granted, "
                             f"{health.get('queued', '?')} queued")
                    last_said = now
                await asyncio.sleep(HEALTH_PERIOD_S)

    watcher = asyncio.create_task(watch())
    per_request: list[str | None] = list(stops) if stops is not None else [None] * len(prompts)
    per_seed: list[int | None] = list(seeds) if seeds is not None else [None] * len(prompts)
    try:
        result.records = list(await asyncio.gather(*(one(p, s, seed) for p, s, seed
                                                     in zip(prompts, per_request, per_seed, strict=True))))
        result.makespan_s = time.perf_counter() - start
    finally:
        done.set()
        await watcher
        await client.close()


# ---- output ------------------------------------------------------------------------------------------------------

def metric_row(metric: str, results: Sequence[R], value: Callable[[R], Any], fmt: str, ratio: bool = True) -> Row:
    """(metric, first, second, second / first): numbers formatted with `fmt`, anything else as is; the ratio is "-"
    where `ratio` is off, the values are not numbers or the first is 0."""
    a, b = value(results[0]), value(results[1])
    cells = [format(v, fmt) if isinstance(v, (int, float)) else str(v) for v in (a, b)]
    return metric, cells[0], cells[1], (f"{b / a:.2f}x" if ratio and isinstance(a, (int, float)) and a else "-")


def bold(row: Row) -> Row:
    """The row in bold (markdown; the console table drops the stars)."""
    metric, first, second, ratio = row
    return f"**{metric}**", f"**{first}**", f"**{second}**", f"**{ratio}**"


def table_header(labels: tuple[str, str]) -> Row:
    return "metric", labels[0], labels[1], f"{labels[1]} / {labels[0]}"


def console_table(rows: list[Row], labels: tuple[str, str]) -> str:
    lines = [table_header(labels)] + [tuple(cell.replace("**", "") for cell in row) for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in
                               enumerate(zip(line, widths, strict=True))) for line in lines)


@dataclass(frozen=True)
class Comparison:
    """One benchmark's experiment as the outside sees it: options, column labels, docs section and plot."""

    section: str  # the docs section's key, e.g. "bench/capacity.py --model tiny-mla"
    command: tuple[str, ...]  # the benchmark and the options that pick this experiment, e.g. ("capacity", "--model",
    # "tiny-mla"): the start of the command the section quotes
    labels: tuple[str, str]  # the two configurations' columns, e.g. ("dcp=1", "dcp=4")
    title: str  # the docs section's heading
    plot_path: Path
    plot_alt: str

    @property
    def docs(self) -> DocsSection:
        return DocsSection(self.section)

    def parse_args(self, description: str, quick_help: str, argv: list[str] | None,
                   extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
        """--quick, --write-docs, --deploy-timeout, and whatever `extra(parser)` adds."""
        parser = argparse.ArgumentParser(description=description)
        parser.add_argument("--quick", action="store_true", help=quick_help)
        parser.add_argument("--write-docs", action="store_true",
                            help=f"write {self.plot_path.relative_to(REPO_ROOT)} and this benchmark's section of "
                                 f"{self.docs.path.relative_to(REPO_ROOT)}")
        parser.add_argument("--deploy-timeout", type=float, default=300.0, help="seconds to wait for each deploy")
        if extra is not None:
            extra(parser)
        return parser.parse_args(argv)

    def markdown_section(self, command: str, headline: str, rows: list[Row], info: list[str]) -> str:
        plot = self.plot_path.relative_to(self.docs.path.parent).as_posix()
        table = ["| " + " | ".join(table_header(self.labels)) + " |", "|:---|---:|---:|---:|"]
        table += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join([
            f"## {self.title}", "",
            f"Command: `{command}`", "", headline, "", *table, "", f"![{self.plot_alt}]({plot})", "",
            *[f"- {line}" for line in info],
        ])

    def report(self, rows: list[Row], headline: str, started: float) -> None:
        """The console's table, headline and total time."""
        print()
        print(console_table(rows, self.labels))
        print()
        print(headline.replace("**", ""))
        print(f"total {time.monotonic() - started:.0f}s")

    def write_docs(self, argv: list[str] | None, headline: str, rows: list[Row], info: list[str],
                   plot: Callable[[Path], None], say: Callable[[str], None]) -> None:
        """Writes the plot (`plot(path)`), then replaces this benchmark's section of docs/benchmarks.md; `argv`: the
        arguments after the experiment's own options (None: this process's arguments)."""
        plot(self.plot_path)
        name, *options = self.command
        command = bench_command(name, [*options, *(sys.argv[1:] if argv is None else argv)])
        # Read-modify-write in one go: other benchmarks write their own sections of the same file.
        self.docs.write(self.markdown_section(command, headline, rows, info))
        say(f"updated {self.docs.path.relative_to(REPO_ROOT)} and {self.plot_path.relative_to(REPO_ROOT)}")


def cpu_run_line(tp: int) -> str:
    """The start of the docs' first note: what a CPU run shares."""
    cores = len(os.sched_getaffinity(0))
    return (f"CPU RUN on {cores} cores with {NUM_GPUS} logical GPUs: the tp={tp} ranks are CPU actors sharing those "
            f"cores")


def deploy_line(results: Sequence[BurstResult]) -> str:
    return "deploy time (not measured above): " + ", ".join(f"{r.label} {r.deploy_s:.0f}s" for r in results)


def environment_line() -> str:
    import openai
    import ray
    import torch

    return (f"torch {torch.__version__}, ray {ray.__version__}, openai {openai.__version__}, python "
            f"{platform.python_version()}, date {datetime.datetime.now().isoformat(timespec='seconds')}")


def write_plot(path: Path, results: Sequence[BurstResult], legends: list[str], limits: list[tuple[int, float]],
               title: str, ylabel: str, suptitle: str, title_size: float | None = None) -> None:
    """Left: each configuration's granted sequences over the burst (`legends[i]` for results[i]), a dotted line at
    y for each (i, y) in `limits` in results[i]'s color; right: output tokens/s bars and their ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (timeline, bars) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    for result, legend, color in zip(results, legends, COLORS, strict=False):
        timeline.step([t for t, _ in result.timeline], [n for _, n in result.timeline], where="post", color=color,
                      label=legend)
    for i, y in limits:
        timeline.axhline(y, color=COLORS[i], linestyle=":", linewidth=1)
    timeline.set_xlabel("seconds since the burst")
    timeline.set_ylabel(ylabel)
    timeline.set_title(title, fontsize=title_size)
    timeline.legend(loc="upper right")
    values = [r.output_tokens_per_s for r in results]
    bars.bar([r.label for r in results], values, color=COLORS[:len(results)])
    for x, value in enumerate(values):
        bars.annotate(f"{value:.0f}", (x, value), ha="center", va="bottom")
    bars.set_ylabel("output tokens/s")
    bars.set_title(f"throughput: {values[1] / values[0]:.2f}x")
    fig.suptitle(suptitle)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

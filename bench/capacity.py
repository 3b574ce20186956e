"""The claim DCP exists for, measured through the deployed app: KV capacity and throughput of dcp=1 vs dcp=4.

Same machine, same per-rank KV memory, the tiny model (1 KV head) at tp=4 on a Ray head of this script's own with
4 logical GPUs (dcpserve/local/serve.py, as `make serve`). For each of dcp=1 and dcp=4 it `serve deploy`s
one replica, sends the same long-context burst through the OpenAI API (official `openai` async client,
streaming), polls /health for the sequences the admission queue has granted (= sequences in the engine, which
reserves prompt + max_tokens up front), then shuts Serve down before the next layout. The per-rank KV budget is
sized so that dcp=1 holds only a few of the sequences: the burst queues in the admission FIFO, and dcp=4, which
keeps each token on one rank instead of on all four, holds 4x as many.

    python bench/capacity.py                 # full run (console only)
    python bench/capacity.py --write-docs    # also writes docs/img/capacity.png and its section of docs/benchmarks.md
    python bench/capacity.py --quick         # a shorter workload
    python bench/capacity.py --model tiny-mla --write-docs   # the same with the tiny DeepSeek-V2 (MLA: one latent
                                                              # KV head, whole on every TP rank)
    python bench/capacity.py --stream-intervals 0,0.05 --write-docs   # dcp=1 and dcp=4 at each stream_interval_s

With `--stream-intervals` it deploys dcp=1 and dcp=4 once for each replica stream_interval_s given (the app arg: a
replica sends an ingress one Ray stream item per engine step carrying the tokens of all of its requests, at most one
per interval when steps are faster; 0 = one per engine step), all on one head with one workload, and reports per
layout and interval the capacity, concurrency, throughput and latency rows plus the tokens each stream item carried:
per replica from its stream_tokens / stream_items counters, and per request the SSE chunks the client got (one per
delta of the request the ingress received). Its
workload is sized so that dcp=4 decodes ~32 sequences at once (dcp=1 holds 8, the burst is 32 requests); the default
workload's dcp=4 holds 8. --requests, --prompt-tokens, --max-tokens and --dcp1-sequences override either workload.

With `--backend both` (run with .venv-vllm/bin/python: it needs vLLM) it compares the two engine backends instead:
the same app at tp=2 x dcp=1 (vLLM's CPU attention cannot shard KV) with the native engine and with vLLM, the same
per-rank KV memory (one page more than the sequences need: vLLM keeps a null page), the same burst.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
# Running `python bench/capacity.py` puts bench/ first on sys.path, where bench/engine.py would shadow the
# `engine` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import compare
from bench.compare import BurstResult, Row, ServeHead, metric_row
from bench.docs_section import DocsSection
from dcpserve.cluster.tiny_model import write_tiny_mla_model, write_tiny_model
from dcpserve.engine.config import ModelConfig
from dcpserve.engine.core.block_manager import blocks_needed

TP, DCPS, BLOCK_SIZE = 4, (1, 4), 16
BACKENDS_TP, BACKENDS_BLOCK_SIZE = 2, 32  # --backend both: vLLM's CPU attention pages in multiples of 32 tokens
# quick -> (prompt tokens, max_tokens, requests in the burst, sequences dcp=1 holds)
WORKLOADS = {False: (1536, 128, 16, 2), True: (960, 64, 8, 2)}
# --stream-intervals: dcp=1 holds 8 sequences, dcp=4 32, and the burst is 32, so dcp=4 decodes at batch ~32
STREAM_WORKLOADS = {False: (1536, 128, 32, 8), True: (512, 64, 32, 8)}
STREAM_SECTION = "bench/capacity.py --stream-intervals"  # its section of docs/benchmarks.md (no plot)
TARGET_TOKENS_PER_ITEM = 4.0  # the target at batch 32: at most one stream item per 4 tokens
COMPARISON = compare.Comparison("bench/capacity.py", ("dcp=1", "dcp=4"),
                                "KV capacity and throughput: dcp=1 vs dcp=4 through the deployed app",
                                REPO_ROOT / "docs" / "img" / "capacity.png", "dcp=1 vs dcp=4")
MLA_COMPARISON = compare.Comparison("bench/capacity.py --model tiny-mla", ("dcp=1", "dcp=4"),
                                    "KV capacity of an MLA model: dcp=1 vs dcp=4 through the deployed app",
                                    REPO_ROOT / "docs" / "img" / "capacity_mla.png", "dcp=1 vs dcp=4, MLA")
# --model -> (how the checkpoint is written, what the docs call it, its comparison)
MODELS: dict[str, tuple[Callable[[Path], Path], str, compare.Comparison]] = {
    "tiny": (write_tiny_model, "the tiny model (dcpserve.cluster.tiny_model)", COMPARISON),
    "tiny-mla": (write_tiny_mla_model,
                 "the tiny DeepSeek-V2 (dcpserve.cluster.tiny_model.write_tiny_mla_model: MLA + MoE)",
                 MLA_COMPARISON),
}
BACKENDS_COMPARISON = compare.Comparison(
    "bench/capacity.py --backend both", ("native", "vllm"),
    "Engine backends through the deployed app: native vs vLLM (tp=2, dcp=1, CPU)",
    REPO_ROOT / "docs" / "img" / "capacity_backends.png", "native vs vLLM")


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


@dataclass(kw_only=True)
class LayoutResult(BurstResult):
    """Everything measured for one layout."""

    dcp: int
    tokens_per_block: int
    # --stream-intervals only: the replica's stream_interval_s, and its counters after the burst (EngineReplica.stats())
    stream_interval_s: float | None = None
    stream_items: int | None = None
    stream_tokens: int | None = None

    @property
    def tokens_per_item(self) -> float | None:
        """Generated tokens per replica -> ingress stream item, from the replica's own counters."""
        return (self.stream_tokens or 0) / self.stream_items if self.stream_items else None

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_blocks * self.tokens_per_block

    def sequences_fit(self, workload: Workload) -> int:
        return self.capacity_blocks // blocks_needed(workload.sequence_tokens, self.tokens_per_block)


def say(line: str) -> None:
    print(f"[capacity] {line}", flush=True)


# ---- the cluster ---------------------------------------------------------------------------------------------

def kv_budget_bytes(model: ModelConfig, workload: Workload) -> int:
    """Per-rank KV bytes in which dcp=1 holds exactly `dcp1_sequences` sequences (each rank keeps every token)."""
    pages = workload.dcp1_sequences * blocks_needed(workload.sequence_tokens, BLOCK_SIZE)
    return compare.kv_budget_bytes(model, TP, BLOCK_SIZE, pages)


# ---- the workload ----------------------------------------------------------------------------------------------

def measure_layout(dcp: int, head: ServeHead, model_dir: Path, budget_bytes: int, workload: Workload,
                   prompts: list[list[int]], backend: str | None = None,
                   stream_interval_s: float | None = None) -> LayoutResult:
    """One layout: tp=4 x dcp (the DCP comparison), or (backend given) tp=2 x dcp=1 on that engine backend; with
    `stream_interval_s` that replica stream interval, and the replica's stream counters read after the burst."""
    tp, block_size = (TP, BLOCK_SIZE) if backend is None else (BACKENDS_TP, BACKENDS_BLOCK_SIZE)
    label = f"dcp={dcp}" if backend is None else backend
    if stream_interval_s is not None:
        label += f"@{stream_interval_s:g}s"
    say(f"{label}: deploying tp={tp} x dcp={dcp} ({backend or 'native'} engine)"
        + (f", stream_interval_s {stream_interval_s:g}" if stream_interval_s is not None else ""))
    # admission "full": concurrency = sequences whose whole prompt + max_tokens fits, the capacity claim; the whole
    # burst may wait in the admission FIFO: nothing is refused
    config = compare.app_config(tp, dcp, block_size, budget_bytes, workload.sequence_tokens, "full",
                                workload.num_requests, backend=backend or "native",
                                stream_interval_s=stream_interval_s)
    deploy_s = head.deploy(model_dir, config, label)
    replica_id, info = head.replica(label)
    result = LayoutResult(label, info["capacity"], deploy_s, dcp=dcp, tokens_per_block=block_size * dcp,
                          stream_interval_s=stream_interval_s)
    expected = workload.dcp1_sequences * dcp
    if result.sequences_fit(workload) != expected:
        raise SystemExit(f"{label}: the replica holds {result.sequences_fit(workload)} sequences of "
                         f"{workload.sequence_tokens} tokens, the budget was sized for {expected}")
    say(f"{label}: KV {result.capacity_tokens} tokens = {result.sequences_fit(workload)} sequences of "
        f"{workload.sequence_tokens}; sending {workload.num_requests} requests")
    asyncio.run(compare.run_burst(head.base_url, prompts, workload.max_tokens, result))
    short = [r for r in result.records if r.completion_tokens != workload.max_tokens or r.first_token is None]
    if short:
        errors = [r.error for r in short if r.error is not None]
        raise SystemExit(f"{label}: {len(short)} requests did not stream {workload.max_tokens} tokens"
                         + (f" ({len(errors)} failed, the first: {errors[0]})" if errors else ""))
    say(f"{label}: {result.output_tokens_per_s:.1f} output tok/s, peak {result.peak_sequences} sequences, "
        f"makespan {result.makespan_s:.1f}s")
    if stream_interval_s is not None:
        read_stream_counters(head, replica_id, result)
        say(f"{label}: {result.tokens_per_chunk_median:.2f} tokens per SSE chunk (median over requests), replica "
            f"{result.stream_tokens} tokens in {result.stream_items} stream items = {result.tokens_per_item:.2f} "
            f"per item")
    head.shutdown_serve()
    return result


def read_stream_counters(head: ServeHead, replica_id: str, result: LayoutResult) -> None:
    """The replica's stream_items / stream_tokens (EngineReplica.stats() through a Serve handle). The replica is
    fresh for each run, so they count this burst only: its tokens must equal what the client got."""
    stats = head.serve_stats("EngineReplica", "stats", 1)[0]
    if stats["replica_id"] != replica_id:
        raise SystemExit(f"{result.label}: stats came from replica {stats['replica_id']}, not {replica_id}")
    result.stream_items, result.stream_tokens = stats["stream_items"], stats["stream_tokens"]
    if result.stream_tokens != result.output_tokens:
        raise SystemExit(f"{result.label}: the replica counted {result.stream_tokens} streamed tokens, the client "
                         f"got {result.output_tokens}: its counters do not cover exactly this burst")


# ---- output ------------------------------------------------------------------------------------------------------

def table_rows(results: list[LayoutResult], workload: Workload) -> list[Row]:
    """(metric, dcp=1, dcp=4, dcp=4 / dcp=1) rows; the output tokens/s row is the headline, in bold."""
    return [
        metric_row("KV capacity (tokens per replica)", results, lambda r: r.capacity_tokens, ","),
        metric_row(f"sequences that fit ({workload.sequence_tokens} tokens each)", results,
                   lambda r: r.sequences_fit(workload), "d"),
        metric_row("peak concurrent sequences", results, lambda r: r.peak_sequences, "d"),
        compare.bold(metric_row("output tokens/s", results, lambda r: r.output_tokens_per_s, ".1f")),
        metric_row("TTFT median (s, admission wait included)", results, lambda r: r.ttft_median_s, ".2f"),
        metric_row("ITL median (ms)", results, lambda r: r.itl_median_s * 1e3, ".1f"),
        metric_row("burst makespan (s)", results, lambda r: r.makespan_s, ".1f"),
    ]


def write_plot(results: list[LayoutResult], workload: Workload, path: Path, model: ModelConfig) -> None:
    heads = "1 latent KV head (MLA)" if model.mla is not None else f"{model.num_key_value_heads} KV head"
    compare.write_plot(
        path, results, [f"{r.label} ({r.capacity_tokens:,} KV tokens)" for r in results],
        [(i, r.sequences_fit(workload)) for i, r in enumerate(results)],
        title=f"{workload.num_requests} requests of {workload.prompt_tokens} + {workload.max_tokens} tokens, tp={TP}",
        ylabel="sequences in the engine",
        suptitle=f"Same per-rank KV memory, {heads}, tp=4 (CPU, 4 logical GPUs)",
    )


def header_lines(workload: Workload, model: ModelConfig, budget_bytes: int, results: list[LayoutResult],
                 model_label: str) -> list[str]:
    import torch

    if model.mla is not None:
        shape = (f"{model.num_hidden_layers} layers, {model.num_attention_heads} query heads, one latent KV head of "
                 f"{model.head_dim} values (kv_lora_rank {model.mla.kv_lora_rank} + rope {model.mla.qk_rope_head_dim})")
    else:
        shape = (f"{model.num_hidden_layers} layers, {model.num_attention_heads} query heads, "
                 f"{model.num_key_value_heads} KV head, head_dim {model.head_dim}")

    return [
        f"{compare.cpu_run_line(TP)} (and, on this machine, shared with other jobs), so all ranks compete for the "
        f"same compute. The throughput ratio here mostly reflects admission and batching (how many sequences are in "
        f"flight per step, since the per-step cost is dominated by fixed gloo / Ray overhead), not GPU memory "
        f"bandwidth; the KV capacity and sequence counts are exact and hold on GPUs too. vLLM reports up to ~3x "
        f"output tokens/s with DCP on GPUs",
        f"model: {model_label}: {shape}, float32; {model.kv_bytes_per_token_per_rank(TP, torch.float32)} KV bytes per "
        f"token on a rank",
        f"layout: one replica of tp={TP} (the 4 logical GPUs), dcp=1 vs dcp=4, block_size {BLOCK_SIZE}; the same "
        f"per-rank KV budget {budget_bytes:,} bytes (kv_cache_memory_bytes), sized so dcp=1 holds "
        f"{workload.dcp1_sequences} sequences: with dcp=1 each of the 4 ranks keeps a copy of the one KV head, with "
        f"dcp=4 each keeps a quarter of the tokens",
        f"workload: a burst of {workload.num_requests} requests at once, random prompt ids (seed {workload.seed}) of "
        f"{workload.prompt_tokens} tokens, {workload.max_tokens} output tokens each (greedy, ignore_eos), streamed "
        f"through the deployed app with the openai client; requests that do not fit wait in the admission FIFO",
        "peak concurrent sequences: the admission queue's grants (sequences in the engine: it reserves prompt + "
        f"max_tokens up front) from /health every {compare.HEALTH_PERIOD_S}s; output tokens/s = all output tokens / "
        "time from the burst to the last token; TTFT from sending (admission wait included); ITL per request = "
        "(last token - first token) / (tokens - 1), median over requests",
        "noise: the two layouts run one after the other on a machine shared with other jobs, so load changes hit "
        "them differently; runs during development gave throughput ratios from 2.35x to 3.15x (the capacity and "
        "concurrency rows do not vary)",
        compare.deploy_line(results),
        compare.environment_line(),
    ]


# ---- --stream-intervals ------------------------------------------------------------------------------------------

Table = tuple[tuple[str, ...], list[tuple[str, ...]]]


def stream_table(results: list[LayoutResult], workload: Workload) -> Table:
    """(header, one row per layout and interval, in run order)."""
    header = ("layout", "stream_interval_s", "KV capacity (tokens)", "peak sequences", "mean sequences",
              "output tok/s", "TTFT median (s)", "ITL median (ms)", "tokens per SSE chunk (median)",
              "replica tokens per stream item", "stream items per request", "makespan (s)")
    rows = [(f"dcp={r.dcp}", f"{r.stream_interval_s:g}", f"{r.capacity_tokens:,}", str(r.peak_sequences),
             f"{r.mean_sequences:.1f}", f"{r.output_tokens_per_s:.1f}", f"{r.ttft_median_s:.2f}",
             f"{r.itl_median_s * 1e3:.1f}", f"{r.tokens_per_chunk_median:.2f}", f"{r.tokens_per_item or 0:.2f}",
             f"{(r.stream_items or 0) / workload.num_requests:.1f}", f"{r.makespan_s:.1f}") for r in results]
    return tuple(header), [tuple(row) for row in rows]


def ratio_table(results: list[LayoutResult], intervals: list[float]) -> Table:
    """Per interval: dcp=4 / dcp=1 for capacity, peak sequences and output tokens/s."""
    header = ("stream_interval_s", "capacity dcp=4 / dcp=1", "peak sequences dcp=4 / dcp=1",
              "output tok/s dcp=4 / dcp=1")
    rows = []
    for interval in intervals:
        one, four = (next(r for r in results if r.stream_interval_s == interval and r.dcp == d) for d in DCPS)
        rows.append((f"{interval:g}", f"{four.capacity_tokens / one.capacity_tokens:.2f}x",
                     f"{four.peak_sequences / one.peak_sequences:.2f}x",
                     f"{four.output_tokens_per_s / one.output_tokens_per_s:.2f}x"))
    return tuple(header), [tuple(row) for row in rows]


def console_lines(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                      for i, (cell, w) in enumerate(zip(line, widths, strict=True)))
            for line in [header, *rows]]


def markdown_lines(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|:---|" + "---:|" * (len(header) - 1)]
            + ["| " + " | ".join(row) + " |" for row in rows])


def stream_verdict(results: list[LayoutResult], intervals: list[float]) -> list[str]:
    """The stream batching target, line by line: at each interval > 0, dcp=4 (the ~32-sequence batch) at most one stream
    item per TARGET_TOKENS_PER_ITEM tokens; the dcp=4 / dcp=1 capacity and tokens/s ratios not lower than at 0."""
    def of(interval: float, dcp: int) -> LayoutResult:
        return next(r for r in results if r.stream_interval_s == interval and r.dcp == dcp)

    lines = []
    for interval in intervals:
        four = of(interval, 4)
        if interval > 0:
            held = (four.tokens_per_item or 0) >= TARGET_TOKENS_PER_ITEM
            lines.append(f"stream_interval_s {interval:g}, dcp=4 (peak {four.peak_sequences} sequences): "
                         f"{four.tokens_per_item:.2f} tokens per stream item (median {four.tokens_per_chunk_median:.2f}"
                         f" per SSE chunk), target >= {TARGET_TOKENS_PER_ITEM:g}: "
                         f"{'met' if held else 'NOT met'} (ITL {four.itl_median_s * 1e3:.0f} ms; an item "
                         f"carries a step's tokens of every request of the ingress, more when steps are faster than "
                         f"the interval)")
    if 0 in intervals:
        base1, base4 = of(0, 1), of(0, 4)
        for interval in (i for i in intervals if i > 0):
            one, four = of(interval, 1), of(interval, 4)
            capacity = (four.capacity_tokens / one.capacity_tokens, base4.capacity_tokens / base1.capacity_tokens)
            speed = (four.output_tokens_per_s / one.output_tokens_per_s,
                     base4.output_tokens_per_s / base1.output_tokens_per_s)
            lines.append(f"stream_interval_s {interval:g} vs 0: dcp=4 / dcp=1 capacity {capacity[0]:.2f}x vs "
                         f"{capacity[1]:.2f}x, output tok/s {speed[0]:.2f}x vs {speed[1]:.2f}x "
                         f"({'not lower' if speed[0] >= speed[1] and capacity[0] >= capacity[1] else 'LOWER'}); "
                         f"dcp=4 tok/s {four.output_tokens_per_s:.1f} vs {base4.output_tokens_per_s:.1f}, dcp=1 "
                         f"{one.output_tokens_per_s:.1f} vs {base1.output_tokens_per_s:.1f}")
    return lines


def main_stream_intervals(args: argparse.Namespace, command: str, write_model: Any, model_label: str,
                          workload: Workload) -> int:
    """--stream-intervals: dcp=1 and dcp=4 at each interval, one head, one workload, one after the other."""
    intervals: list[float] = args.stream_intervals
    docs = DocsSection(STREAM_SECTION + ("" if args.model == "tiny" else f" --model {args.model}"))
    if args.write_docs:
        docs.check()
    started = time.monotonic()
    with compare.state_dir("dcpcaps-", say) as state:
        model_dir = write_model(state / "tiny-model")
        model = ModelConfig.from_pretrained(model_dir)
        budget_bytes = kv_budget_bytes(model, workload)
        prompts = workload.prompts(model.vocab_size)
        with compare.serve_head(state, args.deploy_timeout) as head:
            results = [measure_layout(dcp, head, model_dir, budget_bytes, workload, prompts, stream_interval_s=interval)
                       for interval in intervals for dcp in DCPS]
    elapsed = time.monotonic() - started
    header, rows = stream_table(results, workload)
    ratio_header, ratio_rows = ratio_table(results, intervals)
    verdict = stream_verdict(results, intervals)
    peak4 = max(r.peak_sequences for r in results if r.dcp == 4)
    print()
    print("\n".join(console_lines(header, rows)))
    print()
    print("\n".join(console_lines(ratio_header, ratio_rows)))
    print()
    for line in verdict:
        print(line)
    if peak4 < 0.75 * workload.dcp1_sequences * 4:
        print(f"note: dcp=4 peaked at {peak4} sequences, short of the {workload.dcp1_sequences * 4} it holds")
    print(f"total {elapsed:.0f}s")
    if args.write_docs:
        section = [
            f"## Replica -> ingress stream items: stream_interval_s {', '.join(f'{i:g}' for i in intervals)} at "
            f"dcp=1 and dcp=4 (dcp=4 at ~{workload.dcp1_sequences * 4} sequences)", "",
            f"Command: `{command}` ({elapsed / 60:.0f} minutes)", "",
            *[f"- {line}" for line in verdict], "",
            *markdown_lines(header, rows), "",
            *markdown_lines(ratio_header, ratio_rows), "",
            *[f"- {line}" for line in stream_header_lines(workload, model, budget_bytes, results, model_label)],
        ]
        docs.write("\n".join(section))
        say(f"updated its section of {docs.path}")
    return 0


def stream_header_lines(workload: Workload, model: ModelConfig, budget_bytes: int, results: list[LayoutResult],
                        model_label: str) -> list[str]:
    import torch

    return [
        f"{compare.cpu_run_line(TP)} (and, on this machine, shared with other jobs): an engine step at these batches "
        f"takes tens of ms or more, where a GPU's takes a few",
        f"model: {model_label}, float32; {model.kv_bytes_per_token_per_rank(TP, torch.float32)} KV bytes per token "
        f"on a rank",
        f"layout: one replica of tp={TP}, dcp=1 vs dcp=4, block_size {BLOCK_SIZE}; the same per-rank KV budget "
        f"{budget_bytes:,} bytes, sized so dcp=1 holds {workload.dcp1_sequences} sequences and dcp=4 "
        f"{workload.dcp1_sequences * 4}; admission full; stream_interval_s (dcpserve/deployments/config.py AppArgs) "
        f"set in the "
        f"app config of each run, everything else the same",
        f"workload: a burst of {workload.num_requests} requests at once, random prompt ids (seed {workload.seed}) of "
        f"{workload.prompt_tokens} tokens, {workload.max_tokens} output tokens each (greedy, ignore_eos), streamed "
        f"through the deployed app with the openai client; the runs go interval by interval, dcp=1 then dcp=4, on "
        f"one Ray head",
        "tokens per SSE chunk: per request, completion_tokens / the chunks with choices the client got (the ingress "
        "turns each delta of the request into one chunk, skipping only deltas with no text: held-back UTF-8), median "
        "over requests; replica tokens per stream item (one item carries the deltas of every request of the "
        "ingress): EngineReplica.stats() stream_tokens / stream_items after the "
        "burst (a fresh replica per run; its token count equals the client's), through a Serve handle",
        "peak / mean sequences: the admission queue's grants from /health every "
        f"{compare.HEALTH_PERIOD_S}s (mean: time-weighted from the burst to its last token); output tokens/s = all "
        "output tokens / time from the burst to the last token; TTFT from sending (admission wait included); ITL per "
        "request = (last token - first token) / (tokens - 1), median over requests",
        compare.deploy_line(results),
        compare.environment_line(),
    ]


# ---- main --------------------------------------------------------------------------------------------------------

def intervals_arg(text: str) -> list[float]:
    """"0,0.05" -> [0.0, 0.05]: distinct, each >= 0."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of seconds: {text!r}") from None
    if not values or any(v < 0 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"give distinct intervals >= 0, e.g. 0,0.05: {text!r}")
    return values


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stream-intervals", type=intervals_arg, default=None, metavar="S[,S...]",
                        help="deploy dcp=1 and dcp=4 once per replica stream_interval_s given (e.g. 0,0.05) on a "
                             "workload where dcp=4 decodes ~32 sequences, and report the tokens per stream item; "
                             f"with --write-docs: the section '{STREAM_SECTION}' of docs/benchmarks.md (no plot)")
    parser.add_argument("--requests", type=int, help="requests in the burst (overrides the workload's)")
    parser.add_argument("--prompt-tokens", type=int, help="prompt tokens per request (overrides the workload's)")
    parser.add_argument("--max-tokens", type=int, help="output tokens per request (overrides the workload's)")
    parser.add_argument("--dcp1-sequences", type=int,
                        help="sequences dcp=1 holds (dcp=4 holds 4x; overrides the workload's)")


def chosen_workload(args: argparse.Namespace) -> Workload:
    workload = Workload(*(STREAM_WORKLOADS if args.stream_intervals else WORKLOADS)[args.quick])
    overrides = {"num_requests": args.requests, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                 "dcp1_sequences": args.dcp1_sequences}
    workload = dataclasses.replace(workload, **{k: v for k, v in overrides.items() if v is not None})
    if min(workload.num_requests, workload.prompt_tokens, workload.max_tokens, workload.dcp1_sequences) < 1:
        raise SystemExit(f"the workload's counts must be positive: {workload}")
    return workload


def main(argv: list[str] | None = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--backend", choices=["native", "both"], default="native")
    pre.add_argument("--model", choices=sorted(MODELS), default="tiny",
                     help="tiny (1-KV-head Llama, default) or tiny-mla (DeepSeek-V2: MLA + MoE)")
    known, rest = pre.parse_known_args(argv)
    if known.backend == "both":
        if known.model != "tiny":
            raise SystemExit("--backend both compares the engines on the tiny Llama only (vLLM's CPU attention "
                             "cannot shard KV, and the comparison is dcp=1)")
        return main_backends(rest)
    write_model, model_label, comparison = MODELS[known.model]
    args = comparison.parse_args(__doc__.split("\n\n")[0], "a shorter workload (about 2 minutes in all)", rest,
                                 extra=add_options)
    workload = chosen_workload(args)
    if args.stream_intervals is not None:
        args.model = known.model
        command = " ".join(["python bench/capacity.py"] + ([] if known.model == "tiny" else ["--model", known.model])
                           + [shlex.quote(a) for a in rest])
        if workload.num_requests <= workload.dcp1_sequences:
            raise SystemExit("the burst must exceed what dcp=1 holds, or nothing queues")
        return main_stream_intervals(args, command, write_model, model_label, workload)
    comparison.docs.check()  # unpaired markers fail now, not after the run
    if workload.num_requests <= workload.dcp1_sequences:
        raise SystemExit("the burst must exceed what dcp=1 holds, or nothing queues")
    started = time.monotonic()
    with compare.state_dir("dcpcap-", say) as state:
        model_dir = write_model(state / "tiny-model")
        model = ModelConfig.from_pretrained(model_dir)
        budget_bytes = kv_budget_bytes(model, workload)
        prompts = workload.prompts(model.vocab_size)
        with compare.serve_head(state, args.deploy_timeout) as head:
            results = [measure_layout(dcp, head, model_dir, budget_bytes, workload, prompts) for dcp in DCPS]

    rows = table_rows(results, workload)
    ratio = results[1].output_tokens_per_s / results[0].output_tokens_per_s
    headline = (f"**dcp=4 serves {ratio:.2f}x the output tokens/s of dcp=1** with the same per-rank KV memory: "
                f"{results[1].capacity_tokens // results[0].capacity_tokens}x the KV tokens, so "
                f"{results[1].peak_sequences} sequences in flight instead of {results[0].peak_sequences}.")
    comparison.report(rows, headline, started)
    if args.write_docs:
        # `rest`: the comparison's script already names --model
        comparison.write_docs(rest, headline, rows, header_lines(workload, model, budget_bytes, results, model_label),
                              lambda path: write_plot(results, workload, path, model), say)
    return 0


def main_backends(argv: list[str]) -> int:
    """--backend both: the native engine and vLLM behind the same app, tp=2 x dcp=1, one after the other."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("--backend both needs vLLM: run it with .venv-vllm/bin/python (make test-vllm builds it)")
    args = BACKENDS_COMPARISON.parse_args(__doc__.split("\n\n")[0], "a shorter workload", argv, extra=add_options)
    if args.stream_intervals is not None:
        raise SystemExit("--stream-intervals compares dcp=1 and dcp=4 on the native engine, not with --backend both")
    BACKENDS_COMPARISON.docs.check()
    workload = chosen_workload(args)
    started = time.monotonic()
    with compare.state_dir("dcpcapb-", say) as state:
        model_dir = write_tiny_model(state / "tiny-model")
        model = ModelConfig.from_pretrained(model_dir)
        pages = workload.dcp1_sequences * blocks_needed(workload.sequence_tokens, BACKENDS_BLOCK_SIZE) + 1
        budget_bytes = compare.kv_budget_bytes(model, BACKENDS_TP, BACKENDS_BLOCK_SIZE, pages)
        prompts = workload.prompts(model.vocab_size)
        with compare.serve_head(state, args.deploy_timeout) as head:
            results = [measure_layout(1, head, model_dir, budget_bytes, workload, prompts, backend=backend)
                       for backend in ("native", "vllm")]
    rows = table_rows(results, workload)
    ratio = results[1].output_tokens_per_s / results[0].output_tokens_per_s
    headline = (f"**vLLM serves {ratio:.2f}x the output tokens/s of the native engine** behind the same app (tp=2, "
                f"dcp=1, CPU), with {results[1].peak_sequences} sequences in flight against "
                f"{results[0].peak_sequences}: the same admission, {results[0].capacity_tokens:,} vs "
                f"{results[1].capacity_tokens:,} KV tokens from the same per-rank memory.")
    BACKENDS_COMPARISON.report(rows, headline, started)
    if args.write_docs:
        info = [
            f"{compare.cpu_run_line(BACKENDS_TP)}; vLLM's CPU build runs the model in processes of its own (one core "
            f"per rank), the native engine in Ray rank actors over gloo",
            f"model: the tiny model (dcpserve.cluster.tiny_model), float32; per-rank KV budget {budget_bytes:,} bytes "
            f"(kv_cache_memory_bytes) = {pages} pages of {BACKENDS_BLOCK_SIZE} tokens: {pages - 1} for the sequences "
            f"and the one vLLM keeps as its null page (the native engine keeps no null page, so it has one more)",
            f"workload: a burst of {workload.num_requests} requests, random prompt ids (seed {workload.seed}) of "
            f"{workload.prompt_tokens} tokens, {workload.max_tokens} output tokens each (greedy, ignore_eos), "
            f"admission full, through the openai client; both backends run one after the other on one Ray head",
            "ITL: on these 2 shared cores vLLM's engine core runs ahead of the replica's event loop, so its tokens "
            "reach the client in bursts (median ITL near 0, the gaps show in TTFT and makespan); the native engine's "
            "tokens arrive one per step",
            compare.deploy_line(results),
            compare.environment_line(),
        ]
        def plot(path: Path) -> None:
            compare.write_plot(
                path, results, [f"{r.label} ({r.capacity_tokens:,} KV tokens)" for r in results],
                [(i, r.sequences_fit(workload)) for i, r in enumerate(results)],
                title=f"{workload.num_requests} requests of {workload.prompt_tokens} + {workload.max_tokens} tokens",
                ylabel="sequences in the engine", suptitle="Same app, tp=2 dcp=1: native engine vs vLLM (CPU)")

        BACKENDS_COMPARISON.write_docs(argv, headline, rows, info, plot, say)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The capacity benchmark's building blocks (bench/capacity.py): its workloads and options, and one layout deployed,
sent the burst and measured, which the DCP comparison, --stream-intervals (bench/capacity_stream.py) and --backend both
(bench/capacity_backends.py) all run."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path

from bench.harness import compare
from bench.harness.compare import BurstResult, Row, ServeHead, metric_row
from dcpserve.engine.config import ModelConfig
from dcpserve.engine.core.block_manager import blocks_needed

TP, DCPS, BLOCK_SIZE = 4, (1, 4), 16
BACKENDS_TP, BACKENDS_BLOCK_SIZE = 2, 32  # --backend both: vLLM's CPU attention pages in multiples of 32 tokens
# quick -> (prompt tokens, max_tokens, requests in the burst, sequences dcp=1 holds)
WORKLOADS = {False: (1536, 128, 16, 2), True: (960, 64, 8, 2)}
# --stream-intervals: dcp=1 holds 8 sequences, dcp=4 32, and the burst is 32, so dcp=4 decodes at batch ~32
STREAM_WORKLOADS = {False: (1536, 128, 32, 8), True: (512, 64, 32, 8)}
STREAM_SECTION = "bench/capacity.py --stream-intervals"  # its section of docs/benchmarks.md (no plot)


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


def kv_budget_bytes(model: ModelConfig, workload: Workload) -> int:
    """Per-rank KV bytes in which dcp=1 holds exactly `dcp1_sequences` sequences (each rank keeps every token)."""
    pages = workload.dcp1_sequences * blocks_needed(workload.sequence_tokens, BLOCK_SIZE)
    return compare.kv_budget_bytes(model, TP, BLOCK_SIZE, pages)


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

"""capacity --stream-intervals (bench/capacity.py): dcp=1 and dcp=4 deployed once per replica stream_interval_s, on
one head and one workload where dcp=4 decodes ~32 sequences; per layout and interval the capacity, concurrency,
throughput and latency rows plus the tokens each replica -> ingress stream item carried, the dcp=4 / dcp=1 ratios,
and the batching target's verdict, in a docs section of its own (no plot)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench.capacity_layouts import (
    BLOCK_SIZE,
    DCPS,
    STREAM_SECTION,
    TP,
    LayoutResult,
    Workload,
    kv_budget_bytes,
    measure_layout,
    say,
)
from bench.harness import compare
from bench.harness.docs_section import DocsSection
from dcpserve.engine.config import ModelConfig

TARGET_TOKENS_PER_ITEM = 4.0  # the target at batch 32: at most one stream item per 4 tokens

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

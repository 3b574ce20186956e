"""The claim DCP exists for, measured through the deployed app: KV capacity and throughput of dcp=1 vs dcp=4.

Same machine, same per-rank KV memory, the tiny model (1 KV head) at tp=4 on a Ray head of this benchmark's own with
4 logical GPUs (dcpserve/local/serve.py, as `make serve`). For each of dcp=1 and dcp=4 it `serve deploy`s
one replica, sends the same long-context burst through the OpenAI API (official `openai` async client,
streaming), polls /health for the sequences the admission queue has granted (= sequences in the engine, which
reserves prompt + max_tokens up front), then shuts Serve down before the next layout. The per-rank KV budget is
sized so that dcp=1 holds only a few of the sequences: the burst queues in the admission FIFO, and dcp=4, which
keeps each token on one rank instead of on all four, holds 4x as many.

    python -m bench capacity                 # full run (console only)
    python -m bench capacity --write-docs    # also writes docs/img/capacity.png and its section of docs/benchmarks.md
    python -m bench capacity --quick         # a shorter workload
    python -m bench capacity --model tiny-mla --write-docs   # the same with the tiny DeepSeek-V2 (MLA: one latent
                                                              # KV head, whole on every TP rank)
    python -m bench capacity --stream-intervals 0,0.05 --write-docs   # dcp=1 and dcp=4 at each stream_interval_s

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
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.capacity_backends import main_backends
from bench.capacity_layouts import (
    BLOCK_SIZE,
    DCPS,
    TP,
    LayoutResult,
    Workload,
    add_options,
    chosen_workload,
    kv_budget_bytes,
    measure_layout,
    say,
    table_rows,
)
from bench.capacity_stream import main_stream_intervals
from bench.harness import compare
from bench.harness.docs_section import bench_command
from dcpserve.cluster.tiny_model import write_tiny_mla_model, write_tiny_model
from dcpserve.engine.config import ModelConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
DESCRIPTION = __doc__.split("\n\n")[0]
COMPARISON = compare.Comparison("bench/capacity.py", ("capacity",), ("dcp=1", "dcp=4"),
                                "KV capacity and throughput: dcp=1 vs dcp=4 through the deployed app",
                                REPO_ROOT / "docs" / "img" / "capacity.png", "dcp=1 vs dcp=4")
MLA_COMPARISON = compare.Comparison("bench/capacity.py --model tiny-mla", ("capacity", "--model", "tiny-mla"),
                                    ("dcp=1", "dcp=4"),
                                    "KV capacity of an MLA model: dcp=1 vs dcp=4 through the deployed app",
                                    REPO_ROOT / "docs" / "img" / "capacity_mla.png", "dcp=1 vs dcp=4, MLA")
# --model -> (how the checkpoint is written, what the docs call it, its comparison)
MODELS: dict[str, tuple[Callable[[Path], Path], str, compare.Comparison]] = {
    "tiny": (write_tiny_model, "the tiny model (dcpserve.cluster.tiny_model)", COMPARISON),
    "tiny-mla": (write_tiny_mla_model,
                 "the tiny DeepSeek-V2 (dcpserve.cluster.tiny_model.write_tiny_mla_model: MLA + MoE)",
                 MLA_COMPARISON),
}


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


def all_options(parser: argparse.ArgumentParser) -> None:
    """The workload's options, and --backend / --model, which main reads before the rest (listed here for --help)."""
    add_options(parser)
    parser.add_argument("--backend", choices=["native", "both"], default="native",
                        help="both: the native engine vs vLLM at tp=2 x dcp=1 (run with .venv-vllm/bin/python)")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny",
                        help="tiny (1-KV-head Llama, default) or tiny-mla (DeepSeek-V2: MLA + MoE)")


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
        return main_backends(rest, DESCRIPTION)
    write_model, model_label, comparison = MODELS[known.model]
    args = comparison.parse_args(DESCRIPTION, "a shorter workload (about 2 minutes in all)", rest,
                                 extra=all_options)
    workload = chosen_workload(args)
    if args.stream_intervals is not None:
        args.model = known.model
        command = bench_command("capacity", ([] if known.model == "tiny" else ["--model", known.model]) + rest)
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
        # `rest`: the comparison's command already names --model
        comparison.write_docs(rest, headline, rows, header_lines(workload, model, budget_bytes, results, model_label),
                              lambda path: write_plot(results, workload, path, model), say)
    return 0


if __name__ == "__main__":
    sys.exit(main())

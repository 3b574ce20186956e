"""capacity --backend both (bench/capacity.py): the same app at tp=2 x dcp=1 with the native engine and with vLLM (run
with .venv-vllm/bin/python), the same per-rank KV memory and burst, in a docs section and plot of their own."""

from __future__ import annotations

import time
from pathlib import Path

from bench.capacity_layouts import (
    BACKENDS_BLOCK_SIZE,
    BACKENDS_TP,
    add_options,
    chosen_workload,
    measure_layout,
    say,
    table_rows,
)
from bench.harness import compare
from dcpserve.cluster.tiny_model import write_tiny_model
from dcpserve.engine.config import ModelConfig
from dcpserve.engine.core.block_manager import blocks_needed

BACKENDS_COMPARISON = compare.Comparison(
    "bench/capacity.py --backend both", ("capacity", "--backend", "both"), ("native", "vllm"),
    "Engine backends through the deployed app: native vs vLLM (tp=2, dcp=1, CPU)",
    compare.REPO_ROOT / "docs" / "img" / "capacity_backends.png", "native vs vLLM")


def main_backends(argv: list[str], description: str) -> int:
    """--backend both: the native engine and vLLM behind the same app, tp=2 x dcp=1, one after the other."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("--backend both needs vLLM: run it with .venv-vllm/bin/python (make test-vllm builds it)")
    args = BACKENDS_COMPARISON.parse_args(description, "a shorter workload", argv, extra=add_options)
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


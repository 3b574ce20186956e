"""Time to first token of long prompts with and without prefill context parallelism, side by side in one run.

The native engine (LLM, the scheduler's chunked prefill, the Ray worker group for more than one rank) serves one
prompt of seeded random tokens at a time with max_tokens 1, prefix caching off, at each length and layout; the
TTFT is the wall time of that generate call (the prefill and one sampled token). Layouts, by default: tp=1 at pcp=1
and pcp=2, and tp=2 dcp=2 at pcp=1 and pcp=2. Each rank gets one core (torch threads = cores // ranks, the worker
group's rule; the one-rank engine runs in this process with the same one thread), so pcp=2 adds devices as it does
on GPUs. On this 2-core machine a 4-rank layout shares 2 cores: its ratio shows the overhead, not what 4 devices
would do.

    python -m bench pcp                                   # 4k, 16k and 32k tokens, 3 timed runs each
    python -m bench pcp --tokens 16384 --repeats 5
    python -m bench pcp --write-docs
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.harness.docs_section import DocsSection, bench_command
from dcpserve.cluster.tiny_model import TinyModelSpec, write_tiny_model
from dcpserve.engine.frontend.llm import LLM
from dcpserve.engine.sampling_params import SamplingParams

SCRIPT = "bench/pcp.py"
BLOCK_SIZE = 16
# (tp, dcp, pcp) pairs compared: each pcp=2 layout against the pcp=1 one above it.
LAYOUTS: list[tuple[tuple[int, int, int], tuple[int, int, int]]] = [((1, 1, 1), (1, 1, 2)), ((2, 2, 1), (2, 2, 2))]


def parse_layout(text: str) -> tuple[int, int, int]:
    try:
        tp, dcp, pcp = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a layout is tp,dcp,pcp (e.g. 1,1,2), got {text!r}") from None
    return tp, dcp, pcp


def ttfts(model: Path, layout: tuple[int, int, int], lengths: list[int], repeats: int, chunk: int,
          vocab: int) -> dict[int, list[float]]:
    """Seconds to first token per prompt length, `repeats` timed runs after one untimed warm-up at the shortest."""
    tp, dcp, pcp = layout
    longest = max(lengths)
    # Room for the longest prompt and its token; one KV head of 32 channels, 2 layers, K and V, fp32: 512 bytes a
    # token on every rank that holds it.
    kv_bytes = (longest + 1024) * 512 * 2
    generator = torch.Generator().manual_seed(0)
    results: dict[int, list[float]] = {n: [] for n in lengths}
    with LLM(model, tensor_parallel_size=tp, decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp,
             block_size=BLOCK_SIZE, max_model_len=longest + 16, max_num_batched_tokens=chunk,
             kv_cache_memory_bytes=kv_bytes, enable_prefix_caching=False, dtype="float32") as llm:
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        llm.generate(prompt_token_ids=[torch.randint(0, vocab, (min(lengths),), generator=generator).tolist()],
                     sampling_params=params)
        for _ in range(repeats):
            for n in lengths:
                prompt = torch.randint(0, vocab, (n,), generator=generator).tolist()
                started = time.perf_counter()
                llm.generate(prompt_token_ids=[prompt], sampling_params=params)
                results[n].append(time.perf_counter() - started)
                print(f"tp={tp} dcp={dcp} pcp={pcp} {n} tokens: {results[n][-1]:.2f} s", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768],
                        help="prompt lengths (default 4096 16384 32768)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per length and layout (default 3)")
    parser.add_argument("--chunk", type=int, default=4096,
                        help="max_num_batched_tokens: the prefill chunk (default 4096)")
    parser.add_argument("--write-docs", action="store_true", help="write the section of docs/benchmarks.md")
    args = parser.parse_args(argv)
    if args.repeats < 1 or min(args.tokens) < 1:
        parser.error("--repeats and --tokens must be positive")
    docs = DocsSection(SCRIPT)
    if args.write_docs:
        docs.check()
    torch.set_num_threads(1)  # one core: the one-rank engine's, as each rank of the worker group gets
    spec = TinyModelSpec(max_position_embeddings=max(args.tokens) + 1024)
    rows = []
    medians: dict[tuple[int, int, int], dict[int, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "model", seed=0, spec=spec)
        for pair in LAYOUTS:
            for layout in pair:
                runs = ttfts(model, layout, args.tokens, args.repeats, args.chunk, spec.vocab_size)
                medians[layout] = {n: statistics.median(times) for n, times in runs.items()}
        for base, split in LAYOUTS:
            for n in args.tokens:
                ratio = medians[split][n] / medians[base][n]
                rows.append(f"| tp={base[0]} dcp={base[1]} | {n:,} | {medians[base][n]:.2f} s | "
                            f"{medians[split][n]:.2f} s | {ratio:.2f}x |")
    section = "\n".join([
        f"## Prefill context parallelism: time to first token (`{SCRIPT}`)", "",
        f"`{bench_command('pcp', argv)}`; torch {torch.__version__}, python "
        f"{platform.python_version()}, {os.cpu_count()} cores, date {time.strftime('%Y-%m-%dT%H:%M:%S')}", "",
        f"The native engine, one prompt of seeded random tokens at a time (max_tokens 1, prefix caching off, chunks "
        f"of {args.chunk:,} tokens), on the tiny Llama (2 layers, 4 query heads and 1 KV head of 32, fp32). TTFT: "
        f"the median of {args.repeats} runs of the generate call. Each rank runs one torch thread (cores // ranks, "
        "the worker group's rule; the one-rank engine the same), so a pcp=2 replica has twice the devices of its "
        "pcp=1 row, as on GPUs. The tp=2 rows run 2 and 4 ranks on these 2 cores: at pcp=2 two ranks share each "
        "core, so that ratio is the cost of the exchange, not what 4 devices would give.", "",
        "| layout | prompt tokens | TTFT pcp=1 | TTFT pcp=2 | pcp=2 / pcp=1 |", "|---|---|---|---|---|",
        *rows,
    ])
    print(section)
    if args.write_docs:
        docs.write(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Exactness at 128k tokens: the native engine's model code against transformers at one very long prompt, at the
DCP layouts the suite covers, for a one-KV-head Llama and a DeepSeek-V2 MLA tiny random model.

tests/engine/models/test_long_context.py checks every covered layout at 32,768 tokens in the suite; this runs the same
check (bench/harness/long_context.py's checkpoints, scenario and `check_long_against_hf`: greedy tokens equal, logits
within 1e-4 at the last prompt position and every decode step, every rank bit-identical to rank 0, the far context
shown to matter) at a length the suite cannot afford, and prints how far our logits are from transformers' and how
long each side took.

    python -m bench long_context           # 131,072 tokens, (tp, dcp, pcp) = (1, 1, 1), (2, 2, 1), (1, 2, 2)
    python -m bench long_context --tokens 65536 --layouts 1,1 2,2 4,4 2,4,2
    python -m bench long_context --write-docs
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from bench.harness.docs_section import DocsSection, bench_command
from bench.harness.long_context import (
    BLOCK_SIZE,
    LLAMA_MQA,
    MLA,
    LongCase,
    check_long_against_hf,
    scenario,
    write_checkpoints,
)
from bench.harness.model_harness import Job, free_port, run_job, run_rank
from dcpserve.engine.config import ModelConfig, ParallelConfig
from dcpserve.engine.worker.parallel import ParallelState

SCRIPT = "bench/long_context.py"
MODELS = (LLAMA_MQA, MLA)  # both take every (tp, dcp) with dcp = tp (one KV head), and dcp = tp * pcp


def parse_layout(text: str) -> tuple[int, int, int]:
    try:
        parts = [int(part) for part in text.split(",")]
        if len(parts) not in (2, 3):
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"a layout is tp,dcp or tp,dcp,pcp (e.g. 2,2 or 1,2,2), got {text!r}") \
            from None
    tp, dcp, pcp = (*parts, 1) if len(parts) == 2 else parts
    return tp, dcp, pcp


def run_ours(tp: int, dcp: int, pcp: int, jobs: list[Job], out_dir: Path) -> list[dict[str, list]]:
    """Each job's results (rank 0's), checking every rank's tokens against rank 0's, and the logits of rank 0's
    PCP group (every rank at pcp = 1) bit for bit (other PCP groups run the decodes beside other prefill rows:
    MLA's MoE rounds them differently, within the bound)."""
    if tp * pcp == 1:
        results = []
        for job in jobs:
            config = ModelConfig.from_pretrained(job.model_dir)
            results.append(run_job(job, config, ParallelState.single(config.num_key_value_heads), 1, out_dir,
                                   BLOCK_SIZE))
        return results
    mp.spawn(run_rank, args=(tp, dcp, 1, free_port(), jobs, str(out_dir), BLOCK_SIZE, pcp), nprocs=tp * pcp,
             join=True)
    results = []
    for job in jobs:
        per_rank = [torch.load(out_dir / job.result_file(rank)) for rank in range(tp * pcp)]
        for rank, other in enumerate(per_rank[1:], start=1):
            if other["tokens"] != per_rank[0]["tokens"]:
                raise AssertionError(f"{job.name}: rank {rank} sampled other tokens than rank 0")
            if rank >= tp:
                continue
            for a, b in zip(other["logits"], per_rank[0]["logits"], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{job.name}: rank {rank}'s logits differ")
        results.append(per_rank[0])
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=131_072, help="prompt tokens (default 131072)")
    parser.add_argument("--chunk", type=int, default=8_192, help="prefill chunk in tokens (default 8192)")
    parser.add_argument("--layouts", type=parse_layout, nargs="+", default=[(1, 1, 1), (2, 2, 1), (1, 2, 2)],
                        help="tp,dcp or tp,dcp,pcp (default 1,1 2,2 1,2,2)")
    parser.add_argument("--write-docs", action="store_true", help="write the section of docs/benchmarks.md")
    args = parser.parse_args(argv)
    if args.tokens < 2 * args.chunk:
        parser.error(f"--tokens {args.tokens} is under two chunks of {args.chunk}: there is no far context to check")
    docs = DocsSection(SCRIPT)
    if args.write_docs:
        docs.check()
    torch.set_num_threads(1)  # one thread per rank, as the suite runs them
    # Positions past the prompt, RoPE scaled 4x from a quarter of them (LongCase).
    case = LongCase(args.tokens, args.chunk, max_positions=-(-(args.tokens + 1024) // 1024) * 1024)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoints = write_checkpoints(Path(tmp), case)
        for tp, dcp, pcp in args.layouts:
            for name in MODELS:
                ParallelConfig(tp, dcp, pcp).validate(ModelConfig.from_pretrained(checkpoints[name]))
            jobs = [Job(name, str(checkpoints[name]), (scenario(checkpoints[name], case),)) for name in MODELS]
            out_dir = Path(tmp) / f"tp{tp}-dcp{dcp}-pcp{pcp}"
            out_dir.mkdir()
            started = time.perf_counter()
            results = run_ours(tp, dcp, pcp, jobs, out_dir)
            ours_s = time.perf_counter() - started
            for job, result in zip(jobs, results, strict=True):
                started = time.perf_counter()
                try:
                    error, verdict = check_long_against_hf(job, result), "equal"
                except AssertionError as failure:
                    error, verdict = float("nan"), f"FAILED: {str(failure).splitlines()[0]}"
                layout = f"tp={tp} dcp={dcp}" + (f" pcp={pcp}" if pcp > 1 else "")
                row = (f"| {job.name} | {layout} | {verdict} | {error:.1e} | {ours_s:.0f} s | "
                       f"{time.perf_counter() - started:.0f} s |")
                print(row, flush=True)
                rows.append(row)
    section = "\n".join([
        f"## Exactness at {args.tokens:,} tokens (`{SCRIPT}`)", "",
        f"`{bench_command('long_context', argv)}`; torch {torch.__version__}, python {platform.python_version()}, "
        f"date {time.strftime('%Y-%m-%dT%H:%M:%S')}", "",
        f"One {args.tokens:,}-token prompt of seeded random tokens, prefilled in chunks of {args.chunk:,}, then 8 "
        f"greedy tokens, on the suite's tiny random models (bench/harness/long_context.py; positions up to "
        f"{case.max_positions:,}, RoPE scaled 4x), against transformers' fp32 forward (sdpa) on the same weights. "
        "Tokens: greedy tokens equal transformers' at every step; error: the largest logit difference at the last "
        "prompt position and every decode step (the suite's bound is 1e-4). Every rank's tokens are rank 0's, and the "
        "logits of every rank of rank 0's PCP group (every rank without PCP) are rank 0's, bit for bit; with pcp > 1 "
        "each chunk's parts are split across the PCP groups. Time: our run (all models of the layout, one thread per "
        "rank) and transformers' reference "
        "for that model (computed once per model and output: a later layout with the same tokens reuses it, 0 s).", "",
        "| model | layout | tokens | max logit error | ours | transformers |", "|---|---|---|---|---|---|",
        *rows,
    ])
    print(section)
    if args.write_docs:
        docs.write(section)
    return 0 if all("FAILED" not in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

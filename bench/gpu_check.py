"""Everything that needs a GPU, in one run on a single CUDA device (under 8 minutes on an H200-class GPU).

Stages, each a command of its own, in order; a stage that fails is reported and the next one still runs:
  1. the kernel tests natively (no Triton interpreter): fp32, fp16 and bf16;
  2. the model against transformers at tp=1 on the Triton kernels, in fp32 (logits within 1e-4, equal greedy
     tokens) and in bf16 (within bf16's spacing, equal up to near-ties);
  3. decode CUDA graphs: the engine with its captured graphs gives the enforce_eager engine's tokens;
  4. the kernels benchmark, the GQA and the MLA decode tables (share of the measured copy bandwidth);
  5. the engine benchmark at tp=1, CUDA graphs beside enforce_eager, beside transformers' generate.
The benches write their sections of docs/benchmarks.md. It needs no Ray and no vLLM (the device image has
neither): the tp=1 engine runs in this process.

    python -m bench gpu_check                    # every stage
    python -m bench gpu_check --out DIR          # also each stage's log and the updated docs/benchmarks.md in DIR
    python -m bench gpu_check --dry-run          # the stages and their commands (any machine)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra"]
BENCH = [sys.executable, "-m", "bench"]  # run in the repository root (run_stage's cwd), where `bench` imports


@dataclass(frozen=True)
class Stage:
    name: str
    command: list[str]
    timeout_s: float  # the stage is stopped (and reported) past this


STAGES = [
    Stage("kernel tests, fp32 / fp16 / bf16, native", [*PYTEST, "tests/kernels"], 180),
    Stage("model vs transformers, tp=1, Triton, fp32 and bf16",
          [*PYTEST, "tests/engine/models/test_model_vs_hf.py", "-k", "triton"], 120),
    Stage("decode CUDA graphs vs eager", [*PYTEST, "tests/engine/worker/test_cuda_graphs.py"], 90),
    Stage("bench kernels gqa", [*BENCH, "kernels", "--write-docs"], 120),
    Stage("bench kernels mla", [*BENCH, "kernels", "--shape", "mla", "--write-docs"], 90),
    Stage("bench engine tp=1, CUDA graphs vs eager",
          [*BENCH, "engine", "--skip-tp2", "--batches", "1", "8", "32", "64", "--rounds", "3",
           "--write-docs"], 150),
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="directory for each stage's log and the updated docs/benchmarks.md")
    parser.add_argument("--only", type=int, nargs="+", help="run only these stages (1-based numbers)")
    parser.add_argument("--dry-run", action="store_true", help="print the stages and their commands, run nothing")
    args = parser.parse_args(argv)
    if args.only and not all(1 <= n <= len(STAGES) for n in args.only):
        parser.error(f"--only takes stage numbers 1..{len(STAGES)}, got {args.only}")
    return args


def run_stage(number: int, stage: Stage, out: Path | None) -> tuple[str, float]:
    """Runs one stage with its output streamed here (and copied to out/NN.log); returns its outcome and seconds."""
    print(f"\n=== {number}. {stage.name}: {' '.join(stage.command[1:])}", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)  # the kernels run natively here
    log = open(out / f"{number:02d}.log", "w") if out is not None else None  # noqa: SIM115 - closed below
    start = time.monotonic()
    try:
        process = subprocess.Popen(stage.command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        assert process.stdout is not None
        watchdog = threading.Timer(stage.timeout_s, process.kill)  # also when the stage prints nothing
        watchdog.start()
        for line in process.stdout:
            sys.stdout.write(line)
            if log is not None:
                log.write(line)
        code = process.wait()
        watchdog.cancel()
    finally:
        if log is not None:
            log.close()
    seconds = time.monotonic() - start
    if seconds >= stage.timeout_s:
        return f"stopped after {stage.timeout_s:.0f}s", seconds
    return ("passed" if code == 0 else f"failed (exit {code})"), seconds


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chosen = [(n, s) for n, s in enumerate(STAGES, start=1) if not args.only or n in args.only]
    if args.dry_run:
        for number, stage in chosen:
            print(f"{number}. {stage.name} (at most {stage.timeout_s:.0f}s): {' '.join(stage.command[1:])}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("python -m bench gpu_check needs a CUDA device: this machine has none (--dry-run lists the stages)",
              file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    outcomes = [(number, stage, *run_stage(number, stage, args.out)) for number, stage in chosen]
    print("\n=== summary")
    for number, stage, outcome, seconds in outcomes:
        print(f"{number}. {stage.name}: {outcome} in {seconds:.0f}s")
    print(f"total {sum(seconds for *_, seconds in outcomes):.0f}s")
    if args.out is not None:
        shutil.copy(REPO_ROOT / "docs" / "benchmarks.md", args.out / "benchmarks.md")
    return 0 if all(outcome == "passed" for _, _, outcome, _ in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Everything that needs a GPU, in one run on a single CUDA device (H100 or H200) within 7 minutes: the stages' time
limits add up to under TOTAL_LIMIT_S = 420 s.

Stages, each a process of its own under its time limit, in order; a stage that fails or runs out of time is reported
and the next one still runs:
  1. versions (torch, triton, CUDA, driver, the GPU and its memory) and the measured copy bandwidth;
  2. the Triton kernels against the torch reference in bf16 at 32k-128k tokens, DCP emulated: the context split
     into dcp shards, each shard's partial attention merged by combine_lse as the exchange merges them, compared
     with the unsharded reference (bench/gpu_dcp.py);
  3. the 32k long-context test with the Triton kernels, natively (tests/engine/models/test_long_context.py);
  4. decode CUDA graphs against eager (tests/engine/worker/test_cuda_graphs.py);
  5. decode attention in KV GB/s, as a share of the GPU's spec and of the measured copy bandwidth, and prefill
     attention in TFLOP/s (bench/gpu_perf.py, on bench/kernels.py's measurements);
  6. a bf16 model of Llama-3-8B's layer widths at tp=1: KV sizing, graphs vs eager greedy tokens, decode step times
     at batch 1 / 8 / 32 (bench/gpu_model.py).
It prints one table at the end (stage, status, seconds, key numbers) and writes its section of docs/benchmarks.md.
No Ray and no vLLM on any of these paths (the device image has neither): the tp=1 engine runs in the stage's process.

    python -m bench gpu_check                    # every stage
    python -m bench gpu_check --out DIR          # also each stage's log and the updated docs/benchmarks.md in DIR
    python -m bench gpu_check --dry-run          # the stages, their limits and commands (any machine)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.harness.docs_section import DocsSection, bench_command

REPO_ROOT = Path(__file__).resolve().parents[1]
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra"]
STAGE = [sys.executable, "-m", "bench.gpu_check", "--stage"]  # an in-process stage of bench/gpu_stages.py
RESULT_ENV = "GPU_CHECK_RESULT"  # where an in-process stage writes its StageReport (JSON)
TOTAL_LIMIT_S = 420
DOCS = DocsSection("bench/gpu_check.py")
PYTEST_SUMMARY = re.compile(r"\b\d+ (passed|failed|skipped|errors?|deselected|xfailed|xpassed)\b")


@dataclass(frozen=True)
class Stage:
    """One stage: a command run in the repository root, stopped (and reported) past timeout_s."""

    name: str
    command: list[str]
    timeout_s: float


STAGES = [
    Stage("versions and copy bandwidth", [*STAGE, "versions"], 30),
    Stage("kernels vs reference, bf16, 32k-128k, DCP emulated", [*STAGE, "dcp_kernels"], 60),
    Stage("32k long context vs transformers, Triton",
          [*PYTEST, "tests/engine/models/test_long_context.py", "-k", "triton"], 100),
    Stage("decode CUDA graphs vs eager", [*PYTEST, "tests/engine/worker/test_cuda_graphs.py"], 60),
    Stage("decode GB/s, prefill TFLOP/s", [*STAGE, "attention_perf"], 60),
    Stage("bf16 model, Llama-3-8B widths, tp=1", [*STAGE, "model"], 100),
]


@dataclass(frozen=True)
class Outcome:
    """How a stage ended: its status, seconds, key numbers and docs lines (an in-process stage's report; a pytest
    stage's summary line)."""

    number: int
    stage: Stage
    status: str
    seconds: float
    key: str
    lines: tuple[str, ...] = ()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="directory for each stage's log and the updated docs/benchmarks.md")
    parser.add_argument("--only", type=int, nargs="+", help="run only these stages (1-based numbers)")
    parser.add_argument("--dry-run", action="store_true", help="print the stages and their commands, run nothing")
    parser.add_argument("--no-write-docs", action="store_true", help="leave docs/benchmarks.md as it is")
    parser.add_argument("--stage", help=argparse.SUPPRESS)  # one in-process stage (this module's own commands)
    args = parser.parse_args(argv)
    if args.only and not all(1 <= n <= len(STAGES) for n in args.only):
        parser.error(f"--only takes stage numbers 1..{len(STAGES)}, got {args.only}")
    return args


def run_stage(number: int, stage: Stage, out: Path | None, result: Path | None = None) -> tuple[str, float, str]:
    """Runs one stage with its output streamed here (and copied to out/NN.log); returns its outcome, its seconds and
    the last pytest summary line it printed ('' if none). `result` is handed to an in-process stage for its report."""
    print(f"\n=== {number}. {stage.name} (at most {stage.timeout_s:.0f}s): {' '.join(stage.command[1:])}",
          flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)  # the kernels run natively here
    if result is not None:
        env[RESULT_ENV] = str(result)
    log = open(out / f"{number:02d}.log", "w") if out is not None else None  # noqa: SIM115 - closed below
    summary = ""
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
            if PYTEST_SUMMARY.search(line):
                summary = line.strip().strip("=").strip()
        code = process.wait()
        watchdog.cancel()
    finally:
        if log is not None:
            log.close()
    seconds = time.monotonic() - start
    if seconds >= stage.timeout_s:
        return f"stopped after {stage.timeout_s:.0f}s", seconds, summary
    return ("passed" if code == 0 else f"failed (exit {code})"), seconds, summary


def run_one(number: int, stage: Stage, out: Path | None, scratch: Path) -> Outcome:
    """run_stage, then the stage's key numbers: its StageReport if it wrote one, else its pytest summary line."""
    result = scratch / f"{number:02d}.json"
    status, seconds, summary = run_stage(number, stage, out, result)
    if result.exists():  # bench/gpu_stages.py's StageReport.save
        report = json.loads(result.read_text())
        if status == "passed" and not report["passed"]:
            status = "failed (check)"
        return Outcome(number, stage, status, seconds, str(report["key"]), tuple(map(str, report["lines"])))
    return Outcome(number, stage, status, seconds, summary or "no result", (f"- pytest: {summary}",) if summary else ())


def summary_table(outcomes: list[Outcome]) -> list[str]:
    """The one table the run ends with: stage, status, seconds (of its limit), key numbers."""
    rows = [(f"{o.number}. {o.stage.name}", o.status, f"{o.seconds:.0f}/{o.stage.timeout_s:.0f}", o.key)
            for o in outcomes]
    rows.append(("total", f"{sum(o.status == 'passed' for o in outcomes)}/{len(outcomes)} passed",
                 f"{sum(o.seconds for o in outcomes):.0f}/{sum(o.stage.timeout_s for o in outcomes):.0f}", ""))
    header = ("stage", "status", "s/limit", "key numbers")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(3)]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)) + "  " + row[3]
            for row in [header, *rows]]


def markdown_section(command: str, outcomes: list[Outcome]) -> str:
    """The docs section: the summary as a markdown table, then each stage's own lines."""
    lines = ["## GPU check: one run on one CUDA device (`bench/gpu_check.py`)", "", f"Command: `{command}`", "",
             f"- date {datetime.datetime.now().isoformat(timespec='seconds')}; the stages' time limits add up to "
             f"{sum(s.timeout_s for s in STAGES):.0f} s (< {TOTAL_LIMIT_S} s)", "",
             "| stage | status | seconds / limit | key numbers |", "|---|---|---:|---|"]
    lines += [f"| {o.number}. {o.stage.name} | {o.status} | {o.seconds:.0f} / {o.stage.timeout_s:.0f} | "
              f"{o.key.replace('|', '/')} |" for o in outcomes]
    for o in outcomes:
        lines += ["", f"### {o.number}. {o.stage.name}", "", *(o.lines or ("- no result (see the run's log)",))]
    return "\n".join(lines)


def stage_main(name: str) -> int:
    """One in-process stage on the CUDA device: its lines printed, its report saved where RESULT_ENV says."""
    import torch

    if not torch.cuda.is_available():
        print(f"stage {name} needs a CUDA device: this machine has none", file=sys.stderr)
        return 2
    from bench.gpu_stages import STAGE_FUNCTIONS

    if name not in STAGE_FUNCTIONS:
        print(f"--stage takes one of {sorted(STAGE_FUNCTIONS)}, got {name!r}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    report = STAGE_FUNCTIONS[name](torch.device("cuda"))
    print("\n".join(report.lines) + f"\n\n{name}: {report.key}", flush=True)
    if os.environ.get(RESULT_ENV):
        report.save(Path(os.environ[RESULT_ENV]))
    return 0 if report.passed else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.stage is not None:
        return stage_main(args.stage)
    chosen = [(n, s) for n, s in enumerate(STAGES, start=1) if not args.only or n in args.only]
    if args.dry_run:
        for number, stage in chosen:
            print(f"{number}. {stage.name} (at most {stage.timeout_s:.0f}s): {' '.join(stage.command[1:])}")
        print(f"total at most {sum(stage.timeout_s for _, stage in chosen):.0f}s (limit {TOTAL_LIMIT_S}s)")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("python -m bench gpu_check needs a CUDA device: this machine has none (--dry-run lists the stages)",
              file=sys.stderr)
        return 2
    write_docs = not args.no_write_docs
    if write_docs:
        DOCS.check()  # fail now, not after the run
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        outcomes = [run_one(number, stage, args.out, Path(scratch)) for number, stage in chosen]
    print("\n=== summary\n" + "\n".join(summary_table(outcomes)), flush=True)
    if write_docs:
        DOCS.write(markdown_section(bench_command("gpu_check", argv), outcomes))
        print(f"updated {DOCS.path}")
    if args.out is not None:
        shutil.copy(REPO_ROOT / "docs" / "benchmarks.md", args.out / "benchmarks.md")
    return 0 if all(o.status == "passed" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())

"""`python -m bench gpu_check`, the one run a CUDA machine gets: its stages, its refusal without CUDA, and how a stage's
outcome is told (passed, failed, stopped at its time limit even when it prints nothing)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import BENCHMARKS
from bench.gpu_check import STAGES, Stage, run_stage

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_lists_every_stage_and_each_names_what_exists() -> None:
    out = subprocess.run([sys.executable, "-m", "bench", "gpu_check", "--dry-run"], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert len(out.splitlines()) == len(STAGES)
    for stage in STAGES:
        assert stage.name in out
        for part in stage.command:
            if part.startswith("tests/"):
                assert (REPO_ROOT / part).exists(), part
        if stage.command[1:3] == ["-m", "bench"]:
            assert stage.command[3] in BENCHMARKS, stage.command


def test_without_cuda_it_refuses_clearly() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    done = subprocess.run([sys.executable, "-m", "bench", "gpu_check"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and "needs a CUDA device" in done.stderr


def test_stage_outcomes(tmp_path: Path) -> None:
    assert run_stage(1, Stage("ok", [sys.executable, "-c", "print('hi')"], 30), tmp_path)[0] == "passed"
    assert (tmp_path / "01.log").read_text() == "hi\n"
    assert run_stage(2, Stage("fails", [sys.executable, "-c", "raise SystemExit(3)"], 30), None)[0] == \
        "failed (exit 3)"
    outcome, seconds = run_stage(3, Stage("hangs", [sys.executable, "-c", "import time; time.sleep(60)"], 1), None)
    assert outcome == "stopped after 1s" and seconds < 30

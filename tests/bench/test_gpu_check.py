"""`python -m bench gpu_check`, the one run a CUDA machine gets: its stages and their time limits (under 420 s in all),
its refusal without CUDA, how a stage's outcome is told (passed, failed, stopped at its time limit even when it prints
nothing), the summary table and docs section, and no Ray or vLLM on any of its paths."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from bench.gpu_check import (
    PYTEST,
    STAGE,
    STAGES,
    TOTAL_LIMIT_S,
    Outcome,
    Stage,
    markdown_section,
    run_one,
    run_stage,
    summary_table,
)
from bench.gpu_stages import STAGE_FUNCTIONS
from bench.harness.docs_section import DocsSection

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_stages_time_limits_add_up_to_under_seven_minutes() -> None:
    assert all(stage.timeout_s > 0 for stage in STAGES)
    assert sum(stage.timeout_s for stage in STAGES) < TOTAL_LIMIT_S <= 420


def test_dry_run_lists_every_stage_and_each_names_what_exists() -> None:
    out = subprocess.run([sys.executable, "-m", "bench", "gpu_check", "--dry-run"], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True).stdout
    lines = out.splitlines()
    assert len(lines) == len(STAGES) + 1
    assert lines[-1] == f"total at most {sum(s.timeout_s for s in STAGES):.0f}s (limit {TOTAL_LIMIT_S}s)"
    for line, stage in zip(lines, STAGES, strict=False):
        assert stage.name in line and f"(at most {stage.timeout_s:.0f}s)" in line
        if stage.command[: len(STAGE)] == STAGE:
            assert stage.command[len(STAGE)] in STAGE_FUNCTIONS, stage.command
        else:
            assert stage.command[: len(PYTEST)] == PYTEST, stage.command
            assert all((REPO_ROOT / part).exists() for part in stage.command if part.startswith("tests/"))


def test_without_cuda_it_refuses_clearly() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for command in (["bench", "gpu_check"], ["bench.gpu_check", "--stage", "versions"]):
        done = subprocess.run([sys.executable, "-m", *command], cwd=REPO_ROOT, capture_output=True, text=True)
        assert done.returncode == 2 and "needs a CUDA device" in done.stderr


def test_stage_outcomes(tmp_path: Path) -> None:
    assert run_stage(1, Stage("ok", [sys.executable, "-c", "print('hi')"], 30), tmp_path)[0] == "passed"
    assert (tmp_path / "01.log").read_text() == "hi\n"
    assert run_stage(2, Stage("fails", [sys.executable, "-c", "raise SystemExit(3)"], 30), None)[0] == \
        "failed (exit 3)"
    outcome, seconds, _ = run_stage(3, Stage("hangs", [sys.executable, "-c", "import time; time.sleep(60)"], 1), None)
    assert outcome == "stopped after 1s" and seconds < 30


def test_a_stage_report_or_a_pytest_summary_gives_the_key_numbers(tmp_path: Path) -> None:
    writes = textwrap.dedent("""
        import os
        from pathlib import Path
        from bench.gpu_stages import StageReport
        StageReport("12 GB/s", ["- a line"], passed=PASSED).save(Path(os.environ["GPU_CHECK_RESULT"]))
    """)
    good = run_one(1, Stage("report", [sys.executable, "-c", writes.replace("PASSED", "True")], 30), None, tmp_path)
    assert (good.status, good.key, good.lines) == ("passed", "12 GB/s", ("- a line",))
    bad = run_one(2, Stage("report", [sys.executable, "-c", writes.replace("PASSED", "False")], 30), None, tmp_path)
    assert bad.status == "failed (check)"  # exit 0, but its own check failed
    pytest_like = [sys.executable, "-c", "print('==== 2 passed, 1 skipped in 3.1s ====')"]
    summary = run_one(3, Stage("pytest", pytest_like, 30), None, tmp_path)
    assert summary.key == "2 passed, 1 skipped in 3.1s"
    assert json.loads((tmp_path / "01.json").read_text())["key"] == "12 GB/s"


def test_one_table_and_the_docs_section(tmp_path: Path) -> None:
    outcomes = [Outcome(1, STAGES[0], "passed", 4.2, "H100; copy 2900 GB/s", ("- torch: 2.11",)),
                Outcome(2, STAGES[2], "stopped after 100s", 100.0, "no result")]
    table = summary_table(outcomes)
    assert table[0].split() == ["stage", "status", "s/limit", "key", "numbers"]
    assert STAGES[0].name in table[1] and f"4/{STAGES[0].timeout_s:.0f}" in table[1]
    assert table[1].endswith("H100; copy 2900 GB/s")
    assert "stopped after 100s" in table[2] and f"100/{STAGES[2].timeout_s:.0f}" in table[2]
    assert table[3].startswith("total") and "1/2 passed" in table[3]
    docs = DocsSection("bench/gpu_check.py", tmp_path / "benchmarks.md")
    docs.write(markdown_section("python -m bench gpu_check", outcomes))
    text = (tmp_path / "benchmarks.md").read_text()
    assert "<!-- bench/gpu_check.py:begin -->" in text
    assert f"| 1. versions and copy bandwidth | passed | 4 / {STAGES[0].timeout_s:.0f} | H100; copy 2900 GB/s |" in text
    assert "- torch: 2.11" in text and "- no result (see the run's log)" in text


BLOCKER = textwrap.dedent("""
    import importlib.abc, sys
    class Blocked(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("ray", "vllm"):
                raise ImportError(f"{name} is not installed on the device image")
    sys.meta_path.insert(0, Blocked())
""")


def test_no_ray_nor_vllm_on_any_stage_path() -> None:
    """Every module the stages import (the in-process stages and the test modules the pytest stages run), imported
    where ray and vllm cannot be; and `--dry-run` there."""
    modules = ["bench.gpu_check", "bench.gpu_stages", "bench.gpu_dcp", "bench.gpu_perf", "bench.gpu_model",
               "tests.engine.models.test_long_context", "tests.engine.worker.test_cuda_graphs", "tests.conftest"]
    code = BLOCKER + "".join(f"import {m}\n" for m in modules) + textwrap.dedent("""
        from bench.gpu_check import main
        assert main(["--dry-run"]) == 0
        assert not [m for m in sys.modules if m.split(".")[0] in ("ray", "vllm")]
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    blocked = subprocess.run([sys.executable, "-c", BLOCKER + "import ray"], cwd=REPO_ROOT, capture_output=True,
                             text=True)
    assert blocked.returncode != 0 and "not installed on the device image" in blocked.stderr  # the blocker works

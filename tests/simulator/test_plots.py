"""The plots `dcpserve simulate --out` writes (dcpserve/simulator/plots.py): a run's timeline.png and its samples in
summary.json, a sweep's sweep.png and a timeline per point; matplotlib only when a plot is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dcpserve.simulator.cli import SAMPLE_KEYS
from tests.simulator.test_simulation import ROOT, simulate_cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# A small model on two simulated H100s: each run below simulates in about a second.
SMALL = ("--model", "deepseek-v2-lite", "--gpu", "h100", "--gpus-per-node", "2")


def assert_png(path: Path) -> None:
    """A PNG file that matplotlib reads back as an RGB(A) image of some size with more than one colour in it."""
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_MAGIC, path
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100 and image.shape[2] in (3, 4), image.shape
    assert image.min() < image.max(), f"{path} is one colour"


def assert_samples(summary: dict[str, Any]) -> None:
    """summary.json's samples: the Recorder's, one object per sample, in time order, covering the run."""
    samples = summary["samples"]
    assert samples and all(set(sample) == set(SAMPLE_KEYS) for sample in samples)
    times = [sample["t_s"] for sample in samples]
    assert times == sorted(times)
    assert times[-1] - times[0] >= summary["duration_s"]  # sampled from the start to the last finish
    kv = [sample["kv_utilization"] for sample in samples]
    assert all(0.0 <= value <= 1.0 for value in kv)
    assert sum(kv) / len(kv) == summary["kv_utilization_mean"]  # the same samples the mean is taken over
    assert max(sample["sequences"] for sample in samples) <= summary["peak_concurrent_sequences"]
    assert all(isinstance(sample[key], int) for sample in samples for key in ("replicas", "sequences", "queued"))


def test_a_run_writes_its_timeline_and_its_samples(tmp_path: Path) -> None:
    status, _, stderr = simulate_cli("--trace", "chat", "--requests", "60", *SMALL, "--layout", "tp=2,dcp=2",
                                     "--concurrency", "8", "--out", str(tmp_path))
    assert status == 0, stderr
    assert f"wrote {tmp_path / 'summary.json'}" in stderr and f"wrote {tmp_path / 'timeline.png'}" in stderr
    assert_png(tmp_path / "timeline.png")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert_samples(summary)
    assert {sample["replicas"] for sample in summary["samples"]} == {1}  # no autoscaling: the one replica
    assert max(sample["sequences"] for sample in summary["samples"]) <= 8  # 8 clients


def test_a_concurrency_sweep_writes_its_plot_and_a_timeline_per_point(tmp_path: Path) -> None:
    status, _, stderr = simulate_cli("--trace", "chat", "--requests", "60", *SMALL, "--layout", "tp=2",
                                     "--sweep", "concurrency=4,8", "--out", str(tmp_path))
    assert status == 0, stderr
    assert f"wrote {tmp_path / 'sweep.png'}" in stderr
    assert_png(tmp_path / "sweep.png")
    for point in ("concurrency_4", "concurrency_8"):
        assert_png(tmp_path / point / "timeline.png")
        assert_samples(json.loads((tmp_path / point / "summary.json").read_text()))


def test_a_layout_sweep_writes_its_scatter(tmp_path: Path) -> None:
    status, stdout, stderr = simulate_cli("--trace", "8k-1k", "--requests", "24", *SMALL, "--concurrency", "8",
                                          "--sweep", "layouts", "--out", str(tmp_path))
    assert status == 0, stderr
    assert f"wrote {tmp_path / 'sweep.png'}" in stderr
    assert_png(tmp_path / "sweep.png")
    for point in ("tp1_dcp1", "tp2_dcp1", "tp2_dcp2"):
        assert_png(tmp_path / point / "timeline.png")


def test_without_out_nothing_is_plotted_and_the_command_line_loads_no_matplotlib(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`dcpserve --help` stays fast: importing the command line imports no matplotlib (a process of its own: this
    one may have it loaded by the tests above). Without --out, a run writes no file."""
    result = subprocess.run(
        [sys.executable, "-c", "import sys, dcpserve.cli; print('matplotlib' in sys.modules)"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
    monkeypatch.chdir(tmp_path)
    status, _, stderr = simulate_cli("--trace", "chat", "--requests", "20", *SMALL, "--concurrency", "4")
    assert status == 0, stderr
    assert "wrote" not in stderr and not list(tmp_path.iterdir())

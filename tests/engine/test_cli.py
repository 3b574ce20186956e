"""The dcpserve command line, run as a user would (the installed console script)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def dcpserve(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("dcpserve") or str(Path(sys.executable).parent / "dcpserve")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)


def test_layout_prints_the_worked_example() -> None:
    result = dcpserve("layout", "--tokens", "9", "--dcp", "3", "--block-size", "2", "--interleave", "2")
    assert result.returncode == 0, result.stderr
    assert "rank 0: local_seq_len 4, positions [0, 1, 6, 7]" in result.stdout
    assert "rank 2: local_seq_len 2, positions [4, 5]" in result.stdout
    # position 8: rank 1, page 1, offset 0, slot 2
    assert any(line.split() == ["8", "1", "1", "0", "2"] for line in result.stdout.splitlines())


@pytest.mark.parametrize("args,message", [
    (("--tokens", "9", "--dcp", "2", "--block-size", "3", "--interleave", "2"), "interleave=2 must divide block_size=3"),
    (("--tokens", "9", "--dcp", "0"), "dcp_size must be a positive integer, got 0"),
    (("--tokens", "-1", "--dcp", "2"), "--tokens must be >= 0, got -1"),
])
def test_layout_rejects_bad_values_clearly(args, message) -> None:
    result = dcpserve("layout", *args)
    assert result.returncode != 0
    assert message in result.stderr

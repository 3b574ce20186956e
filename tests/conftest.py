"""Test-wide setup: Triton runs natively on CUDA, and under its CPU interpreter everywhere else.

TRITON_INTERPRET must be set before triton.jit decorates the kernels, so before `kernels` is imported.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def device() -> torch.device:
    return DEVICE

"""Kernel-test setup: the CPU kernels (impl "cpu") run on CPU tensors, whatever device the other kernels use."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def device(device: torch.device, request: pytest.FixtureRequest) -> torch.device:
    """The suite's device (tests/conftest.py), or the CPU for a test parametrized with impl="cpu"."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("impl") == "cpu":
        return torch.device("cpu")
    return device

"""Layers against transformers' own modules, bit for bit where the engine claims it."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from dcpserve.engine.layers.norm import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden,eps", [(64, 1e-6), (128, 1e-5), (4096, 1e-6)])
def test_rms_norm_is_transformers_bit_for_bit(dtype: torch.dtype, hidden: int, eps: float) -> None:
    """fp32 takes the fused F.rms_norm path, the other dtypes the explicit one: both equal LlamaRMSNorm exactly."""
    generator = torch.Generator().manual_seed(hidden)
    ours = RMSNorm(hidden, eps, dtype, torch.device("cpu"))
    theirs = LlamaRMSNorm(hidden, eps=eps).to(dtype)
    weight = torch.randn(hidden, generator=generator).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    for scale in (1e-3, 1.0, 50.0):
        x = (torch.randn(17, hidden, generator=generator) * scale).to(dtype)
        assert torch.equal(ours(x), theirs(x)), (dtype, hidden, scale)


def test_engine_modules_call_forward_directly_and_refuse_hooks() -> None:
    """Calling an EngineModule runs its forward (an override's in a subclass) without nn.Module's hook dispatch,
    so registering a forward hook, which would never run, raises instead."""
    from dcpserve.engine.layers.module import EngineModule

    class Double(EngineModule):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * x

    class Triple(Double):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 3 * x

    class Inherits(Double):
        pass

    x = torch.ones(2)
    assert torch.equal(Double()(x), 2 * x) and torch.equal(Triple()(x), 3 * x) and torch.equal(Inherits()(x), 2 * x)
    assert Double.__call__ is Double.forward
    with pytest.raises(RuntimeError, match="hook would never run"):
        Double().register_forward_hook(lambda *args: None)
    with pytest.raises(RuntimeError, match="hook would never run"):
        Triple().register_forward_pre_hook(lambda *args: None)

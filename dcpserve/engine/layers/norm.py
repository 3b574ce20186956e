"""RMSNorm exactly as transformers computes it: normalize in fp32, cast back, then scale in the input dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dcpserve.engine.layers.module import EngineModule
from dcpserve.engine.layers.weights import new_parameter


class RMSNorm(EngineModule):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension (replicated on every rank)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = new_parameter((hidden_size,), dtype, device)
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        if input_dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused op, bit for bit the three below in fp32 (the same products in the same order); in other
            # dtypes it scales before casting back, which transformers does not.
            return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        normed = x32 * torch.rsqrt(variance + self.eps)
        return self.weight * normed.to(input_dtype)

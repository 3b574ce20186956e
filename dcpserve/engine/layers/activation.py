"""SwiGLU on the merged gate/up projection: silu(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dcpserve.engine.layers.module import EngineModule


class SiluAndMul(EngineModule):
    """x = [gate | up] along the last dimension (each half this rank's shard) -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return F.silu(x[..., :half]) * x[..., half:]

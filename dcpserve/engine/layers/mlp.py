"""The SwiGLU feed-forward block on tensor-parallel layers: merged gate/up (column parallel), down (row parallel)."""

from __future__ import annotations

import torch

from dcpserve.engine.layers.activation import SiluAndMul
from dcpserve.engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from dcpserve.engine.layers.linear_method import UNQUANTIZED, LinearMethod
from dcpserve.engine.layers.module import EngineModule
from dcpserve.engine.worker.parallel import ParallelState


class SwiGluMLP(EngineModule):
    """down(silu(gate(x)) * up(x)), intermediate_size split over TP ranks; the checkpoint's gate_proj / up_proj load
    into gate_up_proj as parts 0 / 1."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        parallel: ParallelState,
        dtype: torch.dtype,
        device: torch.device,
        reduce_results: bool = True,
        method: LinearMethod = UNQUANTIZED,
    ) -> None:
        """reduce_results=False: forward returns this rank's partial sum (a MoE layer reduces its sum once);
        method: the projections' weight storage (FP8 for a block-quantized checkpoint)."""
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, parallel, bias=False, dtype=dtype, device=device, method=method
        )
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, parallel, bias=False, dtype=dtype, device=device,
            reduce_results=reduce_results, method=method,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))

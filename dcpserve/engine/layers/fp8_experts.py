"""The routed experts of an FP8 block-quantized checkpoint: stacked float8_e4m3fn weights and float32 block scales.

Fp8TensorParallelExperts stores what TensorParallelExperts (dcpserve/engine/layers/moe.py) stores, at 1 byte per
parameter: w13 [experts, 2 * I / tp, hidden] (this rank's gate rows, then its up rows) and w2 [experts, hidden,
I / tp], each with its scales, w13_scale_inv [experts, ceil(2 * I / tp / block_n), ceil(hidden / block_k)] and
w2_scale_inv [experts, ceil(hidden / block_n), ceil(I / tp / block_k)]. The checkpoint's per-expert
`experts.{e}.{gate_proj | up_proj | down_proj}.weight` / `.weight_scale_inv` load through StackedLoaders with the
same shard ids as the unquantized experts; the scales' shards are the weights' counted in blocks, so I / tp must be
a whole number of blocks (else a ValueError names the size, the block and tp when the layer is built).

Forward: the stacked weights dequantized block-wise into the activations' dtype for the call (fp8 value * scale of
its block, in fp32, rounded once: dcpserve/kernels/fp8_gemm.py's dequantize_fp8_block), then the same grouped,
host-sync-free computation as the unquantized experts (`moe.grouped_experts`). Exact against dequantize-then-matmul;
the transient dense copy of this rank's experts is the cost (a fused FP8 grouped GEMM on CUDA is the later step).
"""

from __future__ import annotations

import torch

from dcpserve.engine.layers.linear_method import FP8_DTYPE, scale_spec
from dcpserve.engine.layers.module import EngineModule
from dcpserve.engine.layers.moe import choose_experts_method, expert_shard_specs, grouped_experts
from dcpserve.engine.layers.weights import StackedLoader, new_parameter
from dcpserve.engine.quantization import Fp8BlockQuantization
from dcpserve.engine.worker.parallel import ParallelState
from dcpserve.kernels import dequantize_fp8_block


class Fp8TensorParallelExperts(EngineModule):
    """The routed experts with FP8 weights at rest (module docstring); the RoutedExperts surface of moe.py."""

    expert_ends: torch.Tensor  # a buffer: arange(1, num_experts + 1)

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, parallel: ParallelState,
        dtype: torch.dtype, device: torch.device, quantization: Fp8BlockQuantization,
    ) -> None:
        super().__init__()
        rows, w13_specs, w2_specs = expert_shard_specs(hidden_size, intermediate_size, parallel)
        self.num_experts = num_experts
        self.intermediate_per_rank = rows
        self.block = block = quantization.weight_block_size
        self.method = choose_experts_method(dtype, device, hidden_size, rows)
        what = f"the routed experts (moe_intermediate_size={intermediate_size}) at tp={parallel.tp_size}"
        self.w13 = new_parameter((num_experts, 2 * rows, hidden_size), FP8_DTYPE, device,
                                 StackedLoader(num_experts, w13_specs, source_dtype=FP8_DTYPE))
        self.w13_scale_inv = new_parameter(
            (num_experts, *quantization.scale_shape(2 * rows, hidden_size)), torch.float32, device,
            StackedLoader(num_experts, {part: scale_spec(spec, block, what) for part, spec in w13_specs.items()}),
        )
        self.w2 = new_parameter((num_experts, hidden_size, rows), FP8_DTYPE, device,
                                StackedLoader(num_experts, w2_specs, source_dtype=FP8_DTYPE))
        self.w2_scale_inv = new_parameter(
            (num_experts, *quantization.scale_shape(hidden_size, rows)), torch.float32, device,
            StackedLoader(num_experts, {part: scale_spec(spec, block, what) for part, spec in w2_specs.items()}),
        )
        self.register_buffer("expert_ends", torch.arange(1, num_experts + 1, device=device), persistent=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], weights [T, k] fp32, experts [T, k] int64 -> this rank's partial sum [T, hidden]."""
        w13 = dequantize_fp8_block(self.w13, self.w13_scale_inv, self.block, x.dtype)
        w2 = dequantize_fp8_block(self.w2, self.w2_scale_inv, self.block, x.dtype)
        return grouped_experts(x, weights, experts, w13, w2, self.method, self.expert_ends)

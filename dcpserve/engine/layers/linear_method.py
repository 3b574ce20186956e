"""How a linear layer stores and applies its weight: in the model's dtype, or FP8 block-quantized (vLLM's
LinearMethod). The tensor-parallel layers (dcpserve/engine/layers/linear.py) take one and stay the same classes.

- UnquantizedLinearMethod: `weight` [out, in] in the model's dtype; F.linear.
- Fp8LinearMethod: `weight` float8_e4m3fn [out, in] (1 byte per parameter at rest, on every rank) and
  `weight_scale_inv` float32 [ceil(out / block_n), ceil(in / block_k)], as DeepSeek-V3 checkpoints hold them
  (dcpserve/engine/quantization.py). Both load through ShardedLoaders from the same shard layout: the scales' shard
  specs are the weight's divided by the block (`scale_spec`), so a TP shard must start on a block boundary and hold
  whole blocks (the tensor's last, partial block aside); anything else is refused when the layer is built, naming
  the size, the block and tp. Forward on CUDA: the Triton block-FP8 GEMM (dcpserve/kernels/fp8_gemm.py, fp32
  accumulation); elsewhere (or a block_k Triton cannot tile): the weight dequantized block-wise into the activations'
  dtype for the call, then F.linear. Both equal dequantize-then-matmul up to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from dcpserve.engine.layers.weights import ShardedLoader, ShardId, ShardSpec, new_parameter
from dcpserve.engine.quantization import Fp8BlockQuantization
from dcpserve.kernels import HAS_TRITON, dequantize_fp8_block, fp8_block_gemm

FP8_DTYPE = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"  # the checkpoint's name of a quantized weight's scales: `X.weight` -> `X.weight_scale_inv`


class LinearMethod(Protocol):
    """A linear layer's weight storage and matmul."""

    def create_weights(
        self, shape: tuple[int, int], specs: dict[ShardId, ShardSpec], dtype: torch.dtype, device: torch.device,
        what: str,
    ) -> tuple[torch.nn.Parameter, torch.nn.Parameter | None]:
        """(weight, its scales or None) of this rank's `shape`, loaded by `specs` (shard id -> this rank's part of
        the checkpoint weight); `what` names the layer in errors."""
        ...

    def apply(self, x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor | None,
              bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype."""
        ...


@dataclass(frozen=True)
class UnquantizedLinearMethod:
    """The weight in the model's dtype."""

    def create_weights(
        self, shape: tuple[int, int], specs: dict[ShardId, ShardSpec], dtype: torch.dtype, device: torch.device,
        what: str,
    ) -> tuple[torch.nn.Parameter, torch.nn.Parameter | None]:
        return new_parameter(shape, dtype, device, ShardedLoader(specs)), None

    def apply(self, x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor | None,
              bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)


UNQUANTIZED = UnquantizedLinearMethod()


def scale_spec(spec: ShardSpec, block: tuple[int, int], what: str) -> ShardSpec:
    """The ShardSpec of a weight's block scales from the weight's: the same split, counted in blocks. Raises
    ValueError naming `what` when the split does not fall on block boundaries."""
    rows, cols = spec.full_shape
    full = (-(-rows // block[0]), -(-cols // block[1]))
    if spec.dim is None:
        return ShardSpec(full)
    if spec.dim not in (0, 1):
        raise ValueError(f"{what}: an FP8 weight splits along dim 0 or 1, got {spec.dim}")
    size, step = (rows, block[0]) if spec.dim == 0 else (cols, block[1])
    whole_blocks = spec.length % step == 0 or spec.start + spec.length == size
    if spec.start % step or spec.offset % step or not whole_blocks:
        side = "rows (output features)" if spec.dim == 0 else "columns (input features)"
        raise ValueError(
            f"{what}: this rank's {spec.length} {side} from {spec.start} of {size} (at offset {spec.offset} of the "
            f"merged weight) do not fall on the FP8 scale blocks of {step} (weight_block_size {list(block)}); "
            f"choose a tp that splits {size} into multiples of {step}, or use a dequantized (bf16) checkpoint"
        )
    return ShardSpec(full, spec.dim, spec.start // step, -(-spec.length // step), spec.offset // step)


@dataclass(frozen=True)
class Fp8LinearMethod:
    """FP8 e4m3 weights with float32 block scales (module docstring)."""

    quantization: Fp8BlockQuantization

    def create_weights(
        self, shape: tuple[int, int], specs: dict[ShardId, ShardSpec], dtype: torch.dtype, device: torch.device,
        what: str,
    ) -> tuple[torch.nn.Parameter, torch.nn.Parameter | None]:
        block = self.quantization.weight_block_size
        scale_specs = {shard: scale_spec(spec, block, what) for shard, spec in specs.items()}
        weight = new_parameter(shape, FP8_DTYPE, device, ShardedLoader(specs, source_dtype=FP8_DTYPE))
        scales = new_parameter(self.quantization.scale_shape(*shape), torch.float32, device,
                               ShardedLoader(scale_specs))
        return weight, scales

    def apply(self, x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor | None,
              bias: torch.Tensor | None) -> torch.Tensor:
        if weight_scale_inv is None:
            raise RuntimeError("Fp8LinearMethod.apply needs the weight's weight_scale_inv")
        block = self.quantization.weight_block_size
        if x.is_cuda and HAS_TRITON and block[1] % 16 == 0:
            return fp8_block_gemm(x if x.stride(-1) == 1 else x.contiguous(), weight, weight_scale_inv, block, bias)
        return F.linear(x, dequantize_fp8_block(weight, weight_scale_inv, block, x.dtype), bias)


def linear_method(quantization: Fp8BlockQuantization | None, *module_names: str) -> LinearMethod:
    """The method of the linear layer that loads the checkpoint modules `module_names` (several for a merged layer:
    q / k / v, gate / up): FP8 when the checkpoint quantizes them, else the model's dtype. A merged layer whose parts
    the checkpoint quantizes differently is refused by name."""
    if quantization is None:
        return UNQUANTIZED
    quantized = {name: quantization.is_quantized(name) for name in module_names}
    if len(set(quantized.values())) > 1:
        raise ValueError(
            f"the FP8 checkpoint quantizes some of {sorted(quantized)} and not others (modules_to_not_convert="
            f"{list(quantization.ignored_modules)}), but the engine runs them as one merged layer; use a "
            f"dequantized (bf16) checkpoint"
        )
    return Fp8LinearMethod(quantization) if all(quantized.values()) else UNQUANTIZED


def dequantize_weight(weight: torch.Tensor, weight_scale_inv: torch.Tensor | None,
                      quantization: Fp8BlockQuantization | None, dtype: torch.dtype) -> torch.Tensor:
    """A loaded weight in `dtype` (dequantized block-wise when it is FP8): for weights used other than through
    apply, such as MLA's absorbed kv_b_proj."""
    if weight.dtype != FP8_DTYPE:
        return weight.to(dtype)
    if weight_scale_inv is None or quantization is None:
        raise RuntimeError("an FP8 weight needs its weight_scale_inv and the checkpoint's quantization to dequantize")
    return dequantize_fp8_block(weight, weight_scale_inv, quantization.weight_block_size, dtype)

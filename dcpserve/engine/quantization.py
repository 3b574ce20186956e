"""A checkpoint's quantization_config, read once: what the native engine loads, and a refusal by name of the rest.

The native engine loads one quantized format: FP8 block quantization as DeepSeek-V3 / R1 / V3.1 and Kimi-K2 publish
it (quant_method "fp8", fmt "e4m3", weight_block_size [128, 128], activation_scheme "dynamic"): float8_e4m3fn
weights with a float32 `weight_scale_inv` per block of the weight (dequantized weight = fp8 value * scale of its
block), the modules the config names in `modules_to_not_convert` / `ignored_layers` left in the checkpoint's dtype.
Every other method (per-tensor fp8, static activation scales, AWQ, GPTQ, compressed-tensors, bitsandbytes, MXFP4,
...) is refused here, at config time, before any rank reads a weight, naming the method and the alternative.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

VLLM_ALTERNATIVE = "serve it with `backend: vllm`"
QUANTIZED_ALTERNATIVE = f"{VLLM_ALTERNATIVE}, or use a bf16 checkpoint of the model"


@dataclass(frozen=True)
class Fp8BlockQuantization:
    """FP8 (e4m3) weights with one float32 inverse scale per [block_n, block_k] block of each quantized weight."""

    block_n: int  # rows (output features) per scale block
    block_k: int  # columns (input features) per scale block
    ignored_modules: tuple[str, ...] = ()  # module name patterns kept unquantized (modules_to_not_convert)

    @property
    def weight_block_size(self) -> tuple[int, int]:
        return self.block_n, self.block_k

    def is_quantized(self, module_name: str) -> bool:
        """Whether the checkpoint holds `module_name`'s weight in FP8: every linear layer except the ignored ones
        (a pattern matches a module whose dotted name is it or ends with it, as vLLM's `is_layer_skipped`)."""
        return not any(module_name == p or module_name.endswith("." + p) or module_name.startswith(p + ".")
                       for p in self.ignored_modules)

    def scale_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        """The shape of a [out_features, in_features] weight's weight_scale_inv (the last blocks may be partial)."""
        return -(-out_features // self.block_n), -(-in_features // self.block_k)


def read_quantization_config(raw: dict[str, Any], source: str) -> Fp8BlockQuantization | None:
    """config.json's quantization_config (also under a `compression_config` key, as some exports write it), or None
    for an unquantized checkpoint; anything the native engine does not load is a ValueError naming it."""
    config = raw.get("quantization_config") or raw.get("compression_config")
    if not config:
        return None
    if not isinstance(config, dict):
        raise ValueError(f"{source}: quantization_config must be an object, got {config!r}")
    method = config.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"{source}: quantization method {method!r} is not supported by the native engine (it loads bf16 / fp16 "
            f"/ fp32 weights and FP8 block-quantized ones); {QUANTIZED_ALTERNATIVE}"
        )
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{source}: fp8 fmt={fmt!r} is not supported by the native engine (e4m3 only); "
                         f"{QUANTIZED_ALTERNATIVE}")
    block = config.get("weight_block_size")
    if block is None:
        raise ValueError(
            f"{source}: fp8 without weight_block_size (one scale per tensor or channel) is not supported by the "
            f"native engine, which loads block-quantized FP8 (weight_block_size [128, 128], as DeepSeek-V3 ships "
            f"it); {QUANTIZED_ALTERNATIVE}"
        )
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)):
        raise ValueError(f"{source}: fp8 weight_block_size={block!r} must be two positive integers, e.g. [128, 128]")
    activation = config.get("activation_scheme", "dynamic")
    if activation != "dynamic":
        raise ValueError(
            f"{source}: fp8 activation_scheme={activation!r} is not supported by the native engine (dynamic: the "
            f"activations stay in the model's dtype); {QUANTIZED_ALTERNATIVE}"
        )
    ignored = config.get("modules_to_not_convert") or config.get("ignored_layers") or []
    if not isinstance(ignored, list) or not all(isinstance(name, str) for name in ignored):
        raise ValueError(f"{source}: fp8 modules_to_not_convert={ignored!r} must be a list of module names")
    return Fp8BlockQuantization(block_n=block[0], block_k=block[1], ignored_modules=tuple(ignored))

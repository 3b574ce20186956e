"""How a checkpoint stores its weights, for counting their bytes: the parts of a model's parameters that quantization
treats apart (`ParameterParts`), and the bytes per parameter of each part in one format (`WeightFormat`).

`read_weight_format` reads config.json's quantization_config. FP8 block quantization, which the native engine loads,
goes through the engine's own reader (dcpserve/engine/quantization.py `read_quantization_config`); every other method
vLLM serves is read here from its generic fields (quant_method, bits, group_size, weight_block_size, compressed-tensors'
config_groups), since the planner must count what the native engine refuses:

- fp8: 1 byte per quantized parameter, plus a float32 scale per weight_block_size block, per output channel, or per
  tensor (negligible);
- awq / gptq (and their marlin variants): `bits` / 8 bytes, plus an fp16 scale and a `bits`-wide zero point per
  group_size input features (group_size -1: per output channel);
- mxfp4 (gpt-oss): 4-bit values and one 8-bit scale per 32, 4.25 bits, on the MoE experts only (vLLM's Mxfp4 method
  quantizes FusedMoE layers and leaves linear layers in bf16);
- compressed-tensors: its config_groups' weights (num_bits, type, strategy, group_size or block_structure); nvfp4
  (float 4-bit in groups of 16 with fp8 scales) 0.5625 bytes;
- modelopt (FP8, NVFP4), fbgemm_fp8 and bitsandbytes (4 / 8 bit).

Quantized: the linear layers of attention, dense MLPs and experts. Never: the embedding, the router, norms, biases
and (unless the config quantizes lm_head) the LM head; they stay in the checkpoint's dtype, as vLLM loads them. The
modules a config names as not converted (modules_to_not_convert, ignored_layers, ignore, exclude_modules) keep their
part unquantized. Scales are counted per parameter (block scales per full block: the partial blocks at a matrix's
edge, and per-channel scales' exact row counts, are within 0.1% of a rank's weights).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from fnmatch import fnmatch
from typing import Any

from dcpserve.engine.quantization import Fp8BlockQuantization, read_quantization_config

# A representative module name of each part that quantization may cover, as a config's ignore patterns name modules.
PART_MODULES = {
    "attention": ("model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.q_proj"),
    "dense_mlp": ("model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate_proj"),
    "experts": ("model.layers.0.mlp.experts.0.down_proj", "model.layers.0.mlp.experts"),
    "shared_experts": ("model.layers.0.mlp.shared_experts.down_proj", "model.layers.0.mlp.shared_expert.down_proj"),
    "lm_head": ("lm_head",),
}
LINEAR_PARTS = ("attention", "dense_mlp", "experts", "shared_experts")
_PART_NAMES = {"embedding": "embedding", "lm_head": "LM head", "attention": "attention", "dense_mlp": "dense MLPs",
               "experts": "experts", "shared_experts": "shared experts"}
_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1}
_SCALE_BYTES = 4  # float32 block / channel scales (fp8)
_HALF = 2  # fp16 / bf16 group scales (awq, gptq, compressed-tensors int)


@dataclass(frozen=True)
class ParameterParts:
    """Parameters one TP rank holds, by the part of the model they belong to (what a weight format treats apart)."""

    embedding: int  # the input embedding (vocab-parallel)
    lm_head: int  # 0 when tied to the embedding
    attention: int  # attention's linear layers (q / k / v / o, MLA's projections, linear attention's projections)
    dense_mlp: int  # the linear layers of dense MLPs
    experts: int  # the linear layers of the routed experts
    shared_experts: int  # the linear layers of the shared experts
    other: int  # never quantized: norms, biases, routers, convolutions, gates

    @property
    def total(self) -> int:
        return int(sum(getattr(self, field.name) for field in fields(self)))


@dataclass(frozen=True)
class WeightFormat:
    """Bytes per parameter of each part of the weights in one format: the quantized parts at quantized_bytes (scales
    included), the rest at other_bytes."""

    name: str  # what the plan prints: "fp8 e4m3, float32 scale per 128x128 block"
    quantized_bytes: float  # per parameter of the quantized parts, scales included
    other_bytes: int  # per parameter of the rest: the checkpoint's dtype
    quantized_parts: tuple[str, ...] = LINEAR_PARTS
    tensor_core_dtype: str = "bfloat16"  # the linear layers' rate: "float8", "nvfp4" (FP4), "bfloat16", "float32"
    block: tuple[int, int] | None = None  # (block_n, block_k) of block-quantized weights; None: not block-quantized

    @classmethod
    def uniform(cls, dtype: str) -> WeightFormat:
        """Every parameter in `dtype` (bfloat16, float16, float32, or float8 at 1 byte each)."""
        if dtype not in _BYTES:
            raise ValueError(f"weight dtype {dtype!r} is not supported; choose one of {sorted(_BYTES)}")
        size = _BYTES[dtype]
        return cls(name=dtype, quantized_bytes=size, other_bytes=size, tensor_core_dtype=dtype)

    def bytes_of(self, parts: ParameterParts) -> int:
        quantized = int(sum(getattr(parts, name) for name in self.quantized_parts))
        return round(quantized * self.quantized_bytes) + (parts.total - quantized) * self.other_bytes

    def describe(self, parts: ParameterParts) -> str:
        """One line: the format, and how many parameters each byte count covers (at tp=1 when parts is)."""
        quantized = int(sum(getattr(parts, name) for name in self.quantized_parts))
        if quantized == parts.total or self.quantized_bytes == self.other_bytes:
            return f"{self.name}: every parameter at {self.quantized_bytes:g} bytes"
        kept = [_PART_NAMES[name] for name in _PART_NAMES
                if name not in self.quantized_parts and getattr(parts, name)] + ["norms, routers, biases"]
        covered = [_PART_NAMES[name] for name in self.quantized_parts if getattr(parts, name)]
        return (f"{self.name}: {_billions(quantized)} parameters of {', '.join(covered)} at "
                f"{self.quantized_bytes:.5g} bytes each, the other {_billions(parts.total - quantized)} "
                f"({', '.join(kept)}) at {self.other_bytes}")


def _billions(count: int) -> str:
    return f"{count / 1e9:.2f}B"


def read_weight_format(raw: dict[str, Any], hidden_size: int, source: str) -> WeightFormat | None:
    """The checkpoint's quantization as a WeightFormat, or None for an unquantized checkpoint. hidden_size stands for
    a linear layer's input features where a scale is per output channel. A method whose bytes it cannot tell is a
    ValueError naming it."""
    config = raw.get("quantization_config") or raw.get("compression_config")
    if not config:
        return None
    if not isinstance(config, dict):
        raise ValueError(f"{source}: quantization_config must be an object, got {config!r}")
    other = _BYTES.get(str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16").replace("torch.", ""), 2)
    if other == 1 or other == 4:
        other = 2  # the unquantized parts of a quantized checkpoint load as bf16
    method = str(config.get("quant_method", "")).lower().replace("_", "-")
    ignored = _ignored(config)
    try:
        block = read_quantization_config(raw, source)  # the native engine's format: FP8 blocks
    except ValueError:
        block = None
    if block is not None:
        return fp8_block_format(block, other)
    if method in ("fp8", "fbgemm-fp8"):
        block_size = config.get("weight_block_size")
        if method == "fp8" and isinstance(block_size, list) and len(block_size) == 2:
            bn, bk = int(block_size[0]), int(block_size[1])
            return _format(f"fp8, float32 scale per {bn}x{bk} block", 1 + _SCALE_BYTES / (bn * bk), other,
                           LINEAR_PARTS, ignored, "float8", (bn, bk))
        if method == "fbgemm-fp8":
            return _format("fp8, float32 scale per output channel", 1 + _SCALE_BYTES / hidden_size, other,
                           LINEAR_PARTS, ignored, "float8")
        return _format("fp8, one scale per tensor", 1.0, other, LINEAR_PARTS, ignored, "float8")
    if method in ("awq", "gptq", "awq-marlin", "gptq-marlin", "auto-round"):
        bits = int(config.get("bits") or config.get("w_bit") or 4)
        group = int(config.get("group_size") or config.get("q_group_size") or 128)
        group = hidden_size if group <= 0 else group
        parts = LINEAR_PARTS + (("lm_head",) if config.get("lm_head") else ())
        return _format(f"{method} int{bits}, fp16 scale and int{bits} zero per {group} inputs",
                       bits / 8 + (_HALF + bits / 8) / group, other, parts, ignored, "bfloat16")
    if method == "mxfp4":
        return _format("mxfp4 (MoE experts only), an 8-bit scale per 32 values", 0.5 + 1 / 32, other,
                       ("experts",), ignored, "bfloat16")
    if method == "compressed-tensors":
        return _compressed_tensors(config, other, ignored, hidden_size, source)
    if method == "modelopt":
        algo = str(config.get("quant_algo") or (config.get("quantization") or {}).get("quant_algo") or "").upper()
        if algo == "FP8":
            return _format("modelopt fp8, one scale per tensor", 1.0, other, LINEAR_PARTS, ignored, "float8")
        if algo == "NVFP4":
            group = int(config.get("group_size") or 16)
            return _format(f"modelopt nvfp4, an fp8 scale per {group} values", 0.5 + 1 / group, other, LINEAR_PARTS,
                           ignored, "nvfp4")
        raise ValueError(f"{source}: modelopt quant_algo {algo!r} is not counted by the planner (FP8, NVFP4 are); "
                         f"pass --weight-dtype to plan the weights in one dtype")
    if method == "bitsandbytes":
        if config.get("load_in_4bit"):
            return _format("bitsandbytes 4-bit, a float32 absmax per 64 values", 0.5 + _SCALE_BYTES / 64, other,
                           LINEAR_PARTS, ignored, "bfloat16")
        return _format("bitsandbytes int8", 1.0, other, LINEAR_PARTS, ignored, "bfloat16")
    raise ValueError(
        f"{source}: quantization method {config.get('quant_method')!r} is not counted by the planner (it counts fp8, "
        f"awq, gptq, mxfp4, compressed-tensors, modelopt, fbgemm_fp8 and bitsandbytes); pass --weight-dtype to plan "
        f"the weights in one dtype"
    )


def fp8_block_format(block: Fp8BlockQuantization, other_bytes: int = 2) -> WeightFormat:
    """The native engine's FP8 block quantization (dcpserve/engine/quantization.py) as a WeightFormat: 1 byte per
    parameter and a float32 scale per block, the modules it ignores in the checkpoint's dtype."""
    bn, bk = block.weight_block_size
    return _format(f"fp8 e4m3, float32 scale per {bn}x{bk} block", 1 + _SCALE_BYTES / (bn * bk), other_bytes,
                   LINEAR_PARTS, block.ignored_modules, "float8", (bn, bk))


def check_block_shards(quantization: WeightFormat | None, tp: int, widths: dict[str, int]) -> None:
    """vLLM's rule for block-quantized weights: a tp-way split MLP width (dense, expert, shared; by its part name)
    must leave each rank whole blocks (vLLM's fp8 `validate_block_quant_shapes`; Qwen3-30B-A3B-FP8 at tp=4, 768 / 4 =
    192, fails to load: vllm-project/vllm#25292). A ValueError naming the width and the tp that would work."""
    if quantization is None or quantization.block is None or tp == 1:
        return
    step = max(quantization.block)
    for part, width in widths.items():
        if not width or part not in quantization.quantized_parts:
            continue
        if width % tp or (width // tp) % step:
            valid = [t for t in (1, 2, 4, 8, 16, 32, 64) if width % t == 0 and (width // t) % step == 0]
            raise ValueError(
                f"tp={tp} splits the {part} width {width} into {width / tp:g} per rank, not whole "
                f"{quantization.block[0]}x{quantization.block[1]} blocks of the checkpoint's block-quantized weights "
                f"(vLLM refuses to load it so without expert parallelism); tp in {valid} keeps whole blocks"
            )


def _compressed_tensors(config: dict[str, Any], other: int, ignored: tuple[str, ...], hidden_size: int,
                        source: str) -> WeightFormat:
    groups = config.get("config_groups") or {}
    weights = next((group.get("weights") for group in groups.values()
                    if isinstance(group, dict) and isinstance(group.get("weights"), dict)), None)
    if weights is None or weights.get("num_bits") is None:
        raise ValueError(f"{source}: compressed-tensors quantization_config has no config_groups with weights' "
                         f"num_bits; the planner cannot tell its bytes per parameter")
    bits = int(weights["num_bits"])
    kind = str(weights.get("type", "int"))
    strategy = str(weights.get("strategy", "tensor"))
    block: tuple[int, int] | None = None
    scale_bytes = 1 if (kind == "float" and bits == 4) else (_SCALE_BYTES if bits == 8 and kind == "float" else _HALF)
    if strategy in ("group", "tensor_group"):  # tensor_group: nvfp4's groups (and a global scale, not counted)
        group = int(weights.get("group_size") or 128)
        per_parameter = scale_bytes / group + (0 if weights.get("symmetric", True) else bits / 8 / group)
        where = f"per {group} values"
    elif strategy == "block":
        bn, bk = (int(n) for n in (weights.get("block_structure") or [128, 128]))
        per_parameter, where, block = scale_bytes / (bn * bk), f"per {bn}x{bk} block", (bn, bk)
    elif strategy == "channel":
        per_parameter, where = scale_bytes / hidden_size, "per output channel"
    else:
        per_parameter, where = 0.0, "per tensor"
    rate = "float8" if (kind == "float" and bits == 8) else "nvfp4" if (kind == "float" and bits == 4) else "bfloat16"
    name = f"compressed-tensors {kind}{bits}, scales {where}"
    return _format(name, bits / 8 + per_parameter, other, LINEAR_PARTS, ignored, rate, block)


def _ignored(config: dict[str, Any]) -> tuple[str, ...]:
    for key in ("modules_to_not_convert", "ignored_layers", "ignore", "exclude_modules"):
        value = config.get(key)
        if isinstance(value, list):
            return tuple(str(name) for name in value)
    return ()


def module_matches(name: str, pattern: str) -> bool:
    """Whether a config's ignore pattern names module `name`: "re:REGEX" (compressed-tensors), a glob
    ("model.layers.*.self_attn"), or a dotted name the module is, ends with, or sits under."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return any(fnmatch(name, form) for form in (pattern, f"*.{pattern}", f"{pattern}.*", f"*.{pattern}.*"))


def _format(name: str, quantized_bytes: float, other: int, parts: tuple[str, ...], ignored: tuple[str, ...],
            rate: str, block: tuple[int, int] | None = None) -> WeightFormat:
    kept = tuple(part for part in parts
                 if not any(module_matches(module, pattern) for module in PART_MODULES[part] for pattern in ignored))
    return WeightFormat(name=name, quantized_bytes=quantized_bytes, other_bytes=other, quantized_parts=kept,
                        tensor_core_dtype=rate, block=block)

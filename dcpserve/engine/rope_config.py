"""The RoPE part of a model config: theta, the scaling type and its parameters, read from config.json (rope_theta +
rope_scaling as checkpoints ship them, or transformers' rope_parameters) and checked.

The scalings the engine computes, each as transformers' `modeling_rope_utils` does (dcpserve/engine/layers/rotary.py):
- default: plain RoPE;
- linear: every inverse frequency divided by `factor`;
- llama3 (`RopeScaling`): Llama 3.1's long wavelengths divided by `factor`, short ones kept, a ramp between;
- yarn (`YarnScaling`): interpolated long wavelengths, extrapolated short ones, cos and sin times its attention
  factor (Qwen3's and Qwen2.5's long-context setting; DeepSeek-V2 / V3, Kimi K2);
- dynamic: transformers recomputes the frequencies from the longest sequence of a batch once it passes
  max_position_embeddings (each batch differently: no per-sequence equivalent exists); up to there it is plain RoPE,
  so the engine serves it as plain RoPE and never past max_position_embeddings.
Everything else (longrope, per-layer rope parameters, partial rotary) is refused, naming it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dcpserve.engine.quantization import VLLM_ALTERNATIVE


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LinearScaling:
    """Linear position interpolation (rope_type "linear"): every inverse frequency divided by factor."""

    factor: float


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (rope_type "yarn") as transformers computes it (`_compute_yarn_parameters`)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # None: derived from factor, mscale and mscale_all_dim
    truncate: bool = True

    @staticmethod
    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    @property
    def cos_sin_factor(self) -> float:
        """The factor on cos and sin (transformers' attention_scaling)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return self.get_mscale(self.factor, self.mscale) / self.get_mscale(self.factor, self.mscale_all_dim)
        return self.get_mscale(self.factor)

    @property
    def softmax_scale_factor(self) -> float:
        """DeepSeek's factor on the attention softmax scale: mscale(factor, mscale_all_dim) squared (1 without it)."""
        if not self.mscale_all_dim:
            return 1.0
        mscale = self.get_mscale(self.factor, self.mscale_all_dim)
        return mscale * mscale


Scaling = RopeScaling | LinearScaling | YarnScaling


@dataclass(frozen=True)
class RopeConfig:
    """A model's RoPE: theta and its scaling (None: plain RoPE)."""

    theta: float
    scaling: Scaling | None


def _positive(rope: dict[str, Any], name: str, kind: str, source: str) -> float:
    value = rope.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{source}: rope_scaling of type {kind!r} needs a positive {name!r}, got {value!r}")
    return float(value)


def read_yarn(rope: dict[str, Any], max_position_embeddings: int, source: str) -> YarnScaling:
    """A yarn rope_scaling / rope_parameters dict (factor None: max_position_embeddings over the original, as
    transformers derives it)."""
    original = int(rope.get("original_max_position_embeddings") or max_position_embeddings)
    factor = rope.get("factor")
    if factor is None:
        if "original_max_position_embeddings" not in rope:
            raise ValueError(f"{source}: rope_scaling of type 'yarn' needs 'factor'")
        factor = max_position_embeddings / original
    return YarnScaling(
        factor=_positive({"factor": factor}, "factor", "yarn", source),
        original_max_position_embeddings=original,
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        mscale=float(rope["mscale"]) if rope.get("mscale") is not None else None,
        mscale_all_dim=float(rope["mscale_all_dim"]) if rope.get("mscale_all_dim") is not None else None,
        attention_factor=float(rope["attention_factor"]) if rope.get("attention_factor") is not None else None,
        truncate=bool(rope.get("truncate", True)),
    )


def read_rope(raw: dict[str, Any], max_position_embeddings: int, source: str) -> RopeConfig:
    """theta and scaling of a config.json; refuses, naming the field, what the engine does not compute."""
    params = raw.get("rope_parameters") or {}
    if params and not isinstance(params, dict):
        raise ValueError(f"{source}: rope_parameters must be an object, got {params!r}")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(
            f"{source}: rope_parameters per layer type ({', '.join(params)}) are not supported by the native engine "
            f"(one RoPE for every layer); {VLLM_ALTERNATIVE}"
        )
    rope = raw.get("rope_scaling") or (params if params.get("rope_type") not in (None, "default") else {})
    partial = raw.get("partial_rotary_factor", params.get("partial_rotary_factor", rope.get("partial_rotary_factor")))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(
            f"{source}: partial_rotary_factor={partial} (RoPE on part of each head) is not supported by the native "
            f"engine, which rotates whole heads; {VLLM_ALTERNATIVE}"
        )
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
    if not rope:
        return RopeConfig(theta, None)
    kind = rope.get("rope_type") or rope.get("type")
    if kind in (None, "default"):
        return RopeConfig(theta, None)
    if kind == "linear":
        return RopeConfig(theta, LinearScaling(_positive(rope, "factor", kind, source)))
    if kind == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                   if rope.get(k) is None]
        if missing:
            raise ValueError(f"{source}: rope_scaling of type 'llama3' needs {missing}")
        scaling = RopeScaling(
            factor=_positive(rope, "factor", kind, source),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
        if scaling.low_freq_factor == scaling.high_freq_factor:
            raise ValueError(f"{source}: llama3 rope scaling needs high_freq_factor != low_freq_factor, both are "
                             f"{scaling.low_freq_factor}")
        return RopeConfig(theta, scaling)
    if kind == "yarn":
        return RopeConfig(theta, read_yarn(rope, max_position_embeddings, source))
    if kind == "dynamic":
        _positive(rope, "factor", kind, source)
        return RopeConfig(theta, None)  # plain RoPE up to max_position_embeddings: the module docstring says why
    raise ValueError(
        f"{source}: rope scaling {kind!r} is not supported by the native engine (it computes default, linear, "
        f"llama3, yarn, and dynamic up to max_position_embeddings); {VLLM_ALTERNATIVE}"
    )

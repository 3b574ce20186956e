"""Rotary position embedding as Hugging Face Llama applies it (neox style: rotate the two halves of each head), and
as DeepSeek applies it (interleaved: rotate the pairs (x0, x1), (x2, x3), ...).

inv_freq[i] = 1 / theta^(2i / head_dim), optionally rescaled linearly (divided by the factor), Llama-3 style
(transformers' `_compute_llama3_parameters`) or by YaRN (`_compute_yarn_parameters`, which also scales cos and sin
by its attention factor). cos / sin are computed once per forward from the positions, in fp32, and applied to q and k in
their own dtype (Llama) or in fp32 (DeepSeek), as transformers does.
"""

from __future__ import annotations

import math

import torch

from dcpserve.engine.layers.module import EngineModule
from dcpserve.engine.rope_config import LinearScaling, RopeScaling, YarnScaling


def default_inv_freq(head_dim: int, rope_theta: float) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies of plain RoPE."""
    if head_dim % 2 != 0:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (rope_theta**exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, a smooth ramp in between."""
    if scaling.high_freq_factor == scaling.low_freq_factor:
        raise ValueError(
            f"llama3 rope scaling needs high_freq_factor != low_freq_factor, both are {scaling.high_freq_factor}"
        )
    factor = scaling.factor
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context_len / scaling.low_freq_factor
    high_freq_wavelen = old_context_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_inv_freq(head_dim: int, rope_theta: float, scaling: YarnScaling) -> torch.Tensor:
    """YaRN: interpolated (divided by factor) long wavelengths, extrapolated short ones, a linear ramp between the
    correction range of beta_fast / beta_slow rotations at the original context length."""
    if head_dim % 2 != 0:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    base, dim, factor = rope_theta, head_dim, scaling.factor
    original = scaling.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(EngineModule):
    """Computes per-position cos / sin and rotates query and key heads."""

    def __init__(
        self,
        head_dim: int,
        rope_theta: float,
        rope_scaling: RopeScaling | LinearScaling | YarnScaling | None,
        device: torch.device,
        interleaved: bool = False,
    ) -> None:
        """interleaved: rotate pairs of neighbouring channels (DeepSeek) instead of the two halves (Llama)."""
        super().__init__()
        self.cos_sin_factor = 1.0
        if isinstance(rope_scaling, YarnScaling):
            inv_freq = yarn_inv_freq(head_dim, rope_theta, rope_scaling)
            self.cos_sin_factor = rope_scaling.cos_sin_factor
        else:
            inv_freq = default_inv_freq(head_dim, rope_theta)
            if isinstance(rope_scaling, LinearScaling):
                inv_freq = inv_freq / rope_scaling.factor
            elif rope_scaling is not None:
                inv_freq = llama3_inv_freq(inv_freq, rope_scaling)
        self.head_dim = head_dim
        self.interleaved = interleaved
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, 1, head_dim] ([T, 1, head_dim // 2] when interleaved): computed in
        fp32 (times YaRN's attention factor) and cast to `dtype` (the model's, as transformers casts them), once per
        forward for every layer and head."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = (freqs if self.interleaved else torch.cat((freqs, freqs), dim=-1))[:, None, :]
        cos, sin = emb.cos(), emb.sin()
        if self.cos_sin_factor != 1.0:
            cos, sin = cos * self.cos_sin_factor, sin * self.cos_sin_factor
        return cos.to(dtype), sin.to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] rotated by (cos, sin) [T, 1, head_dim] in x's dtype (from cos_sin)."""
        return x * cos + rotate_half(x) * sin

    @staticmethod
    def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] with pairs (x0, x1), (x2, x3), ... rotated by (cos, sin) [T, 1, head_dim // 2]
        (from an interleaved cos_sin), in fp32, back in x's dtype. The result lists the pairs' first halves, then
        their second halves (DeepSeek's layout after its permute): queries and keys rotate alike, so their dot
        products are those of the interleaved layout."""
        x32 = x.to(torch.float32)
        x1, x2 = x32[..., 0::2], x32[..., 1::2]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

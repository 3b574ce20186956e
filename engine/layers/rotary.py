"""Rotary position embedding as Hugging Face Llama applies it (neox style: rotate the two halves of each head).

inv_freq[i] = 1 / theta^(2i / head_dim), optionally rescaled Llama-3 style (transformers'
`_compute_llama3_parameters`). cos / sin are computed once per forward from the positions, in fp32, and
applied to q and k in their own dtype, exactly as transformers does.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.config import RopeScaling


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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Computes per-position cos / sin and rotates query and key heads."""

    def __init__(
        self, head_dim: int, rope_theta: float, rope_scaling: RopeScaling | None, device: torch.device
    ) -> None:
        super().__init__()
        inv_freq = default_inv_freq(head_dim, rope_theta)
        if rope_scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, rope_scaling)
        self.head_dim = head_dim
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, 1, head_dim]: computed in fp32 and cast to `dtype` (the model's, as
        transformers casts them), once per forward for every layer and head."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] rotated by (cos, sin) [T, 1, head_dim] in x's dtype (from cos_sin)."""
        return x * cos + rotate_half(x) * sin

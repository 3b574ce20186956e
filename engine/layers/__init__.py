"""Model building blocks: TP-sharded linear and embedding layers, RoPE, RMSNorm, SwiGLU and DCP attention."""

from __future__ import annotations

from engine.layers.activation import SiluAndMul
from engine.layers.attention import Attention
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.layers.weights import TensorSource, WeightSource

__all__ = [
    "Attention",
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "TensorSource",
    "VocabParallelEmbedding",
    "WeightSource",
]

"""Model building blocks: TP-sharded linear and embedding layers, RoPE, RMSNorm, SwiGLU and DCP attention."""

from __future__ import annotations

from dcpserve.engine.layers.activation import SiluAndMul
from dcpserve.engine.layers.attention import Attention
from dcpserve.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from dcpserve.engine.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from dcpserve.engine.layers.norm import RMSNorm
from dcpserve.engine.layers.rotary import RotaryEmbedding
from dcpserve.engine.layers.weights import TensorSource, WeightSource

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

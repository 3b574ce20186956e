"""What every model class the runner drives shares: a decoder (`self.model`, a `DecoderModel`: embedding, layers,
final norm) plus a vocabulary-parallel LM head (tied to the embedding when the config says so), the paged KV cache
the config describes, forward and logits."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal, overload

import torch
from torch import nn

from dcpserve.engine.config import ModelConfig
from dcpserve.engine.kv_cache import KvCacheSpec
from dcpserve.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from dcpserve.engine.layers.module import EngineModule
from dcpserve.engine.layers.norm import RMSNorm
from dcpserve.engine.layers.rotary import RotaryEmbedding
from dcpserve.engine.layers.weights import WeightSource
from dcpserve.engine.worker.attention_metadata import AttentionMetadata
from dcpserve.engine.worker.parallel import ParallelState


class DecoderLayer(EngineModule):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)); the model gives the attention and MLP."""

    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = mlp

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderModel(EngineModule):
    """Embedding, decoder layers and the final norm (transformers' `model.` prefix). Each layer is called as
    layer(hidden, cos, sin, kv_cache, metadata); `rope_dtype` is the dtype the rotary tables are made in (None: the
    hidden states')."""

    def __init__(self, config: ModelConfig, parallel: ParallelState, rotary_emb: RotaryEmbedding,
                 layers: Sequence[nn.Module], dtype: torch.dtype, device: torch.device,
                 rope_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel, dtype, device)
        self.rotary_emb = rotary_emb
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.rope_dtype = rope_dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} (k_cache, v_cache) pairs for {len(self.layers)} layers")
        if input_ids.shape != positions.shape or input_ids.dim() != 1:
            raise ValueError(
                f"input_ids and positions must be 1-D of the same length, got {tuple(input_ids.shape)} and "
                f"{tuple(positions.shape)}"
            )
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb.cos_sin(positions, self.rope_dtype or hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, metadata)
        return self.norm(hidden)


class CausalLM(EngineModule):
    """A decoder and its LM head; subclasses build the decoder (with an `embed_tokens`) and load checkpoints."""

    def __init__(self, config: ModelConfig, parallel: ParallelState, decoder: DecoderModel, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel
        self.model = decoder
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, parallel, dtype, device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def load_weights(self, weights: Iterable[tuple[str, WeightSource | torch.Tensor]]) -> None:
        """Copies this rank's shard of every checkpoint tensor (Hugging Face names) into the parameters."""
        raise NotImplementedError(f"{type(self).__name__} loads no checkpoints")

    @property
    def kv_cache_spec(self) -> KvCacheSpec:
        """This rank's paged KV cache (K and V of the KV heads it holds; MLA: the one latent head, no V cache)."""
        return self.config.kv_cache_spec(self.parallel.tp_size)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [T] int64 (decode rows first, then prefill chunks) -> final hidden [T, hidden]."""
        return self.model(input_ids, positions, kv_caches, metadata)

    @overload
    def compute_logits(self, hidden: torch.Tensor, driver_only: Literal[False] = False) -> torch.Tensor: ...

    @overload
    def compute_logits(self, hidden: torch.Tensor, driver_only: bool) -> torch.Tensor | None: ...

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor, driver_only: bool = False) -> torch.Tensor | None:
        """hidden [S, hidden] -> logits [S, vocab_size] float32, the full vocabulary on every rank (driver_only: on
        TP rank 0 alone, None elsewhere)."""
        return self.lm_head.compute_logits(hidden, driver_only)

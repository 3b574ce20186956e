"""Llama-family decoder (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM) with TP-sharded layers and DCP
attention over a paged KV cache.

The differences inside the family are three flags of ModelConfig: attention_bias (q/k/v bias; Qwen2 has no
o_proj bias, Llama and Qwen3 put it on o_proj too), qk_norm (Qwen3: per-head RMSNorm on q and k before RoPE)
and tie_word_embeddings (the LM head shares the embedding). Module names follow transformers', with q/k/v and
gate/up merged, so checkpoint names map one to one (STACKED_PARAMS).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dcpserve.engine.config import ModelConfig
from dcpserve.engine.layers.attention import Attention
from dcpserve.engine.layers.linear import QKVParallelLinear, RowParallelLinear
from dcpserve.engine.layers.linear_method import linear_method
from dcpserve.engine.layers.mlp import SwiGluMLP
from dcpserve.engine.layers.module import EngineModule
from dcpserve.engine.layers.norm import RMSNorm
from dcpserve.engine.layers.rotary import RotaryEmbedding
from dcpserve.engine.layers.weights import ShardId, WeightSource
from dcpserve.engine.models.causal_lm import CausalLM, DecoderLayer, DecoderModel
from dcpserve.engine.models.checkpoint import load_named_weights
from dcpserve.engine.worker.attention_metadata import AttentionMetadata
from dcpserve.engine.worker.parallel import ParallelState

# (our merged module, the checkpoint's module, shard id)
STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)
# Checkpoint entries that are not parameters (old checkpoints saved the RoPE buffer).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaAttention(EngineModule):
    """Self-attention block: merged QKV projection, optional q/k norm, RoPE, paged DCP attention, o_proj."""

    def __init__(self, config: ModelConfig, parallel: ParallelState, dtype: torch.dtype, device: torch.device,
                 prefix: str = "self_attn") -> None:
        """prefix: the module's checkpoint name (which modules an FP8 checkpoint leaves unquantized)."""
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_attention_heads, config.num_key_value_heads,
            parallel, bias=config.attention_bias, dtype=dtype, device=device,
            method=linear_method(config.quantization, *(f"{prefix}.{p}_proj" for p in "qkv")),
        )
        o_bias = config.attention_bias and config.architecture != "Qwen2ForCausalLM"
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim, config.hidden_size, parallel, bias=o_bias, dtype=dtype,
            device=device, method=linear_method(config.quantization, f"{prefix}.o_proj"),
        )
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device) if config.qk_norm else None
        self.attn = Attention(
            self.qkv_proj.num_heads_per_rank, self.qkv_proj.num_kv_heads_per_rank, config.head_dim, parallel, device
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if self.q_norm is not None and self.k_norm is not None:
            q, k, v = self.qkv_proj(hidden)
            q, k = self.q_norm(q), self.k_norm(k)
            q, k = RotaryEmbedding.rotate(q, cos, sin), RotaryEmbedding.rotate(k, cos, sin)
        else:  # queries and keys rotate in one pass (the same elementwise products: the same bits)
            qk, v = self.qkv_proj.forward_qk(hidden)
            qk = RotaryEmbedding.rotate(qk, cos, sin)
            q, k = qk.split([self.qkv_proj.num_heads_per_rank, self.qkv_proj.num_kv_heads_per_rank], dim=1)
        out = self.attn(q, k, v, kv_cache[0], kv_cache[1], metadata)
        return self.o_proj(out.reshape(out.shape[0], -1))


class LlamaDecoderLayer(DecoderLayer):
    """Pre-norm block of Llama attention and a SwiGLU MLP."""

    def __init__(self, config: ModelConfig, parallel: ParallelState, dtype: torch.dtype, device: torch.device,
                 layer: int = 0) -> None:
        prefix = f"model.layers.{layer}"
        mlp_method = linear_method(config.quantization, *(f"{prefix}.mlp.{p}" for p in ("gate_proj", "up_proj",
                                                                                         "down_proj")))
        super().__init__(config, LlamaAttention(config, parallel, dtype, device, prefix=f"{prefix}.self_attn"),
                         SwiGluMLP(config.hidden_size, config.intermediate_size, parallel, dtype, device,
                                   method=mlp_method),
                         dtype, device)


class LlamaModel(DecoderModel):
    """Embedding, Llama decoder layers and the final norm (transformers' `model.` prefix)."""

    def __init__(self, config: ModelConfig, parallel: ParallelState, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(
            config, parallel, RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, device),
            [LlamaDecoderLayer(config, parallel, dtype, device, i) for i in range(config.num_hidden_layers)],
            dtype, device,
        )


class LlamaForCausalLM(CausalLM):
    """The decoder plus a vocabulary-parallel LM head; what the model runner drives."""

    def __init__(self, config: ModelConfig, parallel: ParallelState, dtype: torch.dtype, device: torch.device) -> None:
        if parallel.num_kv_heads != config.num_key_value_heads:
            raise ValueError(
                f"ParallelState was built for {parallel.num_kv_heads} KV heads but the model has "
                f"{config.num_key_value_heads}: pass config.num_key_value_heads to init_parallel_state"
            )
        super().__init__(config, parallel, LlamaModel(config, parallel, dtype, device), dtype, device)

    def checkpoint_names(self) -> set[str]:
        """The Hugging Face tensor names this model loads (q/k/v and gate/up unmerged; no lm_head when tied)."""
        names: set[str] = set()
        for name, _ in self.named_parameters():  # a tied lm_head.weight is listed once, as the embedding
            unmerged = [name.replace(ours, theirs) for ours, theirs, _ in STACKED_PARAMS if ours in name]
            names.update(unmerged or [name])
        return names

    def load_weights(self, weights: Iterable[tuple[str, WeightSource | torch.Tensor]]) -> None:
        """Copies this rank's shard of every checkpoint tensor (Hugging Face names) into the parameters.

        Raises ValueError naming the tensors when some are missing or unexpected, or a shape does not match."""
        config = self.config

        def skip(name: str) -> bool:
            # Tied: the embedding is the LM head; some checkpoints store both copies.
            return name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings)

        load_named_weights(
            dict(self.named_parameters()), weights, self.checkpoint_names(), resolve_stacked, skip,
            f"{config.architecture} as config.json describes it ({config.num_hidden_layers} layers, "
            f"attention_bias={config.attention_bias}, qk_norm={config.qk_norm}, "
            f"tie_word_embeddings={config.tie_word_embeddings})",
        )


def resolve_stacked(name: str) -> tuple[str, ShardId]:
    """A checkpoint name -> (our parameter, shard id): q/k/v into qkv_proj, gate/up into gate_up_proj."""
    for ours, theirs, shard in STACKED_PARAMS:
        if theirs in name:
            return name.replace(theirs, ours), shard
    return name, None

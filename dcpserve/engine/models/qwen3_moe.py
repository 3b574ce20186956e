"""Qwen3-MoE and Qwen2-MoE decoders (Qwen3MoeForCausalLM, Qwen2MoeForCausalLM): Llama-family attention with
TP-sharded layers and DCP over a paged KV cache, and a mixture-of-experts MLP in the sparse layers.

Attention is llama.py's: Qwen3-MoE's has per-head q / k RMSNorm and no bias, Qwen2-MoE's a q / k / v bias without an
o_proj bias. A sparse layer (QwenMoeConfig.is_moe_layer: not in mlp_only_layers, every decoder_sparse_step-th) is
`QwenSparseMoE`: the shared router (softmax, greedy top-k, renormalized when norm_topk_prob) and the grouped
tensor-parallel experts of dcpserve/engine/layers/moe.py, plus Qwen2-MoE's shared expert scaled per token by
sigmoid(shared_expert_gate(x)); one all-reduce of the summed partials. The other layers are dense SwiGLU MLPs of
intermediate_size. Checkpoint names are transformers' (which are Qwen's): experts one tensor per expert and
projection, stacked here into w13 / w2.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from dcpserve.engine.config import ModelConfig
from dcpserve.engine.layers.linear import ReplicatedLinear, RowParallelLinear
from dcpserve.engine.layers.mlp import SwiGluMLP
from dcpserve.engine.layers.module import EngineModule
from dcpserve.engine.layers.moe import TensorParallelExperts, TopKRouter
from dcpserve.engine.layers.rotary import RotaryEmbedding
from dcpserve.engine.layers.weights import ShardId, WeightSource
from dcpserve.engine.models.causal_lm import CausalLM, DecoderLayer, DecoderModel
from dcpserve.engine.models.checkpoint import load_named_weights
from dcpserve.engine.models.llama import IGNORED_SUFFIXES, LlamaAttention, resolve_stacked
from dcpserve.engine.models.llama import STACKED_PARAMS as ATTENTION_AND_MLP_PARAMS
from dcpserve.engine.qwen_moe_config import QKV_BIAS_ARCHITECTURES, QwenMoeConfig
from dcpserve.engine.worker.parallel import ParallelState

# model.layers.{layer}.mlp.experts.{expert}.{gate_proj | up_proj | down_proj}.weight
EXPERT_NAME = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)
# checkpoint projection -> (our stacked parameter, part of its loader)
EXPERT_PARTS: dict[str, tuple[str, int | None]] = {
    "gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None),
}


class QwenSparseMoE(EngineModule):
    """Router, grouped routed experts and (Qwen2-MoE) the gated shared expert of one layer; one all-reduce of their
    summed partials."""

    def __init__(self, hidden_size: int, moe: QwenMoeConfig, parallel: ParallelState, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.parallel = parallel
        self.gate = TopKRouter(hidden_size, moe, device)
        self.experts = TensorParallelExperts(
            moe.n_routed_experts, hidden_size, moe.moe_intermediate_size, parallel, dtype, device
        )
        shared = moe.shared_expert_intermediate_size
        self.shared_expert = (
            SwiGluMLP(hidden_size, shared, parallel, dtype, device, reduce_results=False) if shared else None
        )
        # One logit per token, replicated: every rank scales its partial shared output by the same sigmoid.
        self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, False, dtype, device) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        out = self.experts(x, weights, experts)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.parallel.all_reduce(out)


class QwenMoeAttention(LlamaAttention):
    """llama.py's attention; Qwen2-MoE's bias is on q / k / v only (its o_proj has none)."""

    def __init__(self, config: ModelConfig, parallel: ParallelState, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(config, parallel, dtype, device)
        if config.architecture in QKV_BIAS_ARCHITECTURES and self.o_proj.bias is not None:
            self.o_proj = RowParallelLinear(config.num_attention_heads * config.head_dim, config.hidden_size,
                                            parallel, bias=False, dtype=dtype, device=device)


class QwenMoeDecoderLayer(DecoderLayer):
    """Pre-norm block of Qwen attention and a sparse MoE or dense SwiGLU MLP (QwenMoeConfig.is_moe_layer)."""

    def __init__(self, config: ModelConfig, layer: int, parallel: ParallelState, dtype: torch.dtype,
                 device: torch.device) -> None:
        mlp: QwenSparseMoE | SwiGluMLP
        if isinstance(config.moe, QwenMoeConfig) and config.moe.is_moe_layer(layer):
            mlp = QwenSparseMoE(config.hidden_size, config.moe, parallel, dtype, device)
        else:
            mlp = SwiGluMLP(config.hidden_size, config.intermediate_size, parallel, dtype, device)
        super().__init__(config, QwenMoeAttention(config, parallel, dtype, device), mlp, dtype, device)


class QwenMoeModel(DecoderModel):
    """Embedding, Qwen MoE decoder layers and the final norm (transformers' `model.` prefix)."""

    def __init__(self, config: ModelConfig, parallel: ParallelState, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(
            config, parallel, RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, device),
            [QwenMoeDecoderLayer(config, i, parallel, dtype, device) for i in range(config.num_hidden_layers)],
            dtype, device,
        )


class Qwen3MoeForCausalLM(CausalLM):
    """The decoder plus a vocabulary-parallel LM head; what the model runner drives (Qwen3-MoE and Qwen2-MoE)."""

    def __init__(self, config: ModelConfig, parallel: ParallelState, dtype: torch.dtype, device: torch.device) -> None:
        if config.moe is not None and not isinstance(config.moe, QwenMoeConfig):
            raise ValueError(
                f"{config.architecture}: Qwen3MoeForCausalLM needs Qwen's MoE fields (QwenMoeConfig, from "
                f"dcpserve/engine/qwen_moe_config.py), got {type(config.moe).__name__}"
            )
        if parallel.num_kv_heads != config.num_key_value_heads:
            raise ValueError(
                f"ParallelState was built for {parallel.num_kv_heads} KV heads but the model has "
                f"{config.num_key_value_heads}: pass config.num_key_value_heads to init_parallel_state"
            )
        super().__init__(config, parallel, QwenMoeModel(config, parallel, dtype, device), dtype, device)

    def checkpoint_names(self) -> set[str]:
        """The Hugging Face tensor names this model loads (experts one by one, q/k/v and gate/up unmerged, no
        lm_head when tied)."""
        experts = self.config.moe.n_routed_experts if self.config.moe is not None else 0
        names: set[str] = set()
        for name, _ in self.named_parameters():  # a tied lm_head.weight is listed once, as the embedding
            if name.endswith((".mlp.experts.w13", ".mlp.experts.w2")):
                prefix, stacked = name.rsplit(".", 1)
                projections = ("gate_proj", "up_proj") if stacked == "w13" else ("down_proj",)
                names.update(f"{prefix}.{e}.{p}.weight" for e in range(experts) for p in projections)
                continue
            unmerged = [name.replace(ours, theirs) for ours, theirs, _ in ATTENTION_AND_MLP_PARAMS if ours in name]
            names.update(unmerged or [name])
        return names

    def load_weights(self, weights: Iterable[tuple[str, WeightSource | torch.Tensor]]) -> None:
        """Copies this rank's shard of every checkpoint tensor (Hugging Face names) into the parameters.

        Raises ValueError naming the tensors when some are missing or unexpected, or a shape does not match."""
        config = self.config

        def skip(name: str) -> bool:
            return name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings)

        moe = config.moe
        experts = (f"{moe.n_routed_experts} routed experts, {moe.num_experts_per_tok} per token"
                   if moe is not None else "dense")
        load_named_weights(
            dict(self.named_parameters()), weights, self.checkpoint_names(), resolve_name, skip,
            f"{config.architecture} as config.json describes it ({config.num_hidden_layers} layers, {experts}, "
            f"attention_bias={config.attention_bias}, tie_word_embeddings={config.tie_word_embeddings})",
        )


def resolve_name(name: str) -> tuple[str, ShardId]:
    """A checkpoint name -> (our parameter, shard id): experts into the stacked w13 / w2, q/k/v into qkv_proj,
    gate/up (dense and shared expert) into gate_up_proj."""
    expert = EXPERT_NAME.match(name)
    if expert is not None:
        stacked, part = EXPERT_PARTS[expert.group("proj")]
        return f"{expert.group('prefix')}.{stacked}", (int(expert.group("expert")), part)
    return resolve_stacked(name)

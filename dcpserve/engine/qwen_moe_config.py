"""The mixture-of-experts part of a Qwen3-MoE / Qwen2-MoE config.json.

`read_qwen_moe_fields(raw, architecture, source)` reads a Qwen3MoeForCausalLM / Qwen2MoeForCausalLM config.json into
a `QwenMoeConfig`: a `MoeConfig` (dcpserve/engine/deepseek_config.py) with Qwen's routing, which the shared router
and grouped experts run as they are (dcpserve/engine/layers/moe.py), plus Qwen's own layer rule and shared expert.
It refuses, naming the field and the value, what the engine does not implement. ModelConfig.moe holds the result.

Routing, as transformers' Qwen3MoeTopKRouter / Qwen2MoeTopKRouter: softmax of the router logits over all
num_experts, the greedy top num_experts_per_tok, their probabilities renormalized to sum 1 when norm_topk_prob, no
scaling factor, no expert groups. A layer is sparse when it is not in mlp_only_layers and (layer + 1) is a
multiple of decoder_sparse_step; the others are dense SwiGLU MLPs of intermediate_size. Qwen2-MoE adds one shared
expert per sparse layer (a SwiGLU MLP of shared_expert_intermediate_size) whose output is scaled per token by
sigmoid(shared_expert_gate(x)) and added to the routed experts'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dcpserve.engine.deepseek_config import MoeConfig, read_int

QWEN_MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
# The attention of the dense and MoE models alike (ModelConfig's qk_norm and attention_bias): Qwen3's per-head q / k
# RMSNorm; Qwen2's q / k / v bias (Qwen2-MoE's config field qkv_bias, true unless set) without an o_proj bias.
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
QKV_BIAS_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")


@dataclass(frozen=True)
class QwenMoeConfig(MoeConfig):
    """Qwen's mixture of experts: MoeConfig's routing fields (softmax, greedy, no shared experts of DeepSeek's
    kind), Qwen's sparse-layer rule and Qwen2-MoE's gated shared expert."""

    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's one gated shared expert (0: none, Qwen3-MoE)

    def is_moe_layer(self, layer: int) -> bool:
        """Qwen's rule (transformers' Qwen3MoeDecoderLayer): sparse unless in mlp_only_layers, every
        decoder_sparse_step-th layer counting from 1."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


def read_qwen_moe_fields(raw: dict[str, Any], architecture: str, source: str) -> QwenMoeConfig | None:
    """The MoE fields of a Qwen3-MoE / Qwen2-MoE config.json, checked; None when num_experts is 0 (every layer
    dense, as transformers builds it). Refuses what is not implemented."""
    if architecture not in QWEN_MOE_ARCHITECTURES:
        raise ValueError(
            f"{source}: {architecture} is not a Qwen MoE architecture ({', '.join(QWEN_MOE_ARCHITECTURES)})"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act={raw['hidden_act']!r} is not supported (Qwen's experts use silu)")
    # transformers writes Qwen3-MoE's count as num_local_experts (its attribute_map); the checkpoints say num_experts.
    key = "num_experts" if raw.get("num_experts") is not None else "num_local_experts"
    experts = read_int(raw, key, source, minimum=0)
    if experts == 0:
        return None
    top_k = read_int(raw, "num_experts_per_tok", source)
    if top_k > experts:
        raise ValueError(f"{source}: num_experts_per_tok={top_k} exceeds {key}={experts}")
    layers = read_int(raw, "num_hidden_layers", source)
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise ValueError(f"{source}: mlp_only_layers={only!r} must be a list of layer indices")
    outside = [i for i in only if not 0 <= i < layers]
    if outside:
        raise ValueError(f"{source}: mlp_only_layers {outside} are not layers of the model's {layers} "
                         f"(num_hidden_layers); list indices 0 to {layers - 1}")
    shared = 0
    if architecture == "Qwen2MoeForCausalLM":
        shared = read_int(raw, "shared_expert_intermediate_size", source)
    elif raw.get("shared_expert_intermediate_size"):
        raise ValueError(
            f"{source}: shared_expert_intermediate_size={raw['shared_expert_intermediate_size']!r} on "
            f"{architecture}: Qwen3-MoE has no shared expert (transformers ignores the field); remove it, or use "
            f"Qwen2MoeForCausalLM if the checkpoint has shared_expert weights"
        )
    return QwenMoeConfig(
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
        n_shared_experts=0,
        moe_intermediate_size=read_int(raw, "moe_intermediate_size", source),
        first_k_dense_replace=0,
        moe_layer_freq=1,
        routed_scaling_factor=1.0,
        scoring_func="softmax",
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        decoder_sparse_step=read_int(raw, "decoder_sparse_step", source, default=1),
        mlp_only_layers=tuple(sorted(set(only))),
        shared_expert_intermediate_size=shared,
    )
